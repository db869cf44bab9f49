"""The batch-invariant forward that the trainer and vLLM both run (one module per family)."""
