"""Thin adapters for the RL frameworks' own released code, one module per framework; each imports
its framework at module level, so import the module you use (``skyrl_numerics.integrations.skyrl``
needs ``skyrl``). Nothing here is imported by the rest of the package."""
