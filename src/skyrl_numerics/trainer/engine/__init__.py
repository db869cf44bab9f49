"""Engine side: the vLLM generator, its worker extension (route/support capture, in-place weight
update), the ``vllm.general_plugins`` entry point, the invariant models vLLM runs out of tree, and
the quantized serving checkpoints."""
