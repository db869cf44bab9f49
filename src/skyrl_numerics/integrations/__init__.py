"""Thin adapters for RL frameworks' own trainers (one module per framework; each imports nothing of
its framework at module level). docs/integrations.md."""
