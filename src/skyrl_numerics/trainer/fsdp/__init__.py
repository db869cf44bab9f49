"""The FSDP2 trainer: policy forward over HF models, the training step, LoRA, checkpoints."""
