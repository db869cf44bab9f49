"""Thin adapters for the RL frameworks' own released code, one module per framework
(docs/integrations.md). Import the module you use: ``integrations.trl`` imports nothing of TRL at
module level; ``integrations.skyrl`` imports ``skyrl``. Nothing else in the package imports them."""
