"""megatron-core side of the trainer: the CPU compatibility module (:mod:`.compat`), the HF <-> megatron-core
weight mapping (:mod:`.mapping`), model construction and vocab-parallel logprobs (:mod:`.model`), and
:class:`~.trainer.MegatronTrainer`. megatron-core is imported lazily inside these modules' functions."""
