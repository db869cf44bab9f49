"""skyrl-numerics: measure the trainer-inference logprob gap in RL post-training and remove its causes.

Packages (imported lazily; heavy dependencies load only inside the functions that need them):

- ``skyrl_numerics.gap``         the gap tool: ``measure(trainer_lp, rollout_lp, mask=None) -> GapReport``
- ``skyrl_numerics.correction``  off-policy corrections (TIS, masks, MIS)
- ``skyrl_numerics.rollout``     the ragged ``Rollout`` batch, its file formats, seeded prompts
- ``skyrl_numerics.models``      tiny seeded random-weight HF checkpoints
- ``skyrl_numerics.kernels``     batch-invariant kernels and ``batch_invariant_mode()``
- ``skyrl_numerics.quant``       bit-exact fake-quant, STE/QAT, KV simulation
- ``skyrl_numerics.replay``      R3 routes and top-p/top-k support replay
- ``skyrl_numerics.invariant``   the batch-invariant forward both the trainer and vLLM run
- ``skyrl_numerics.sync``        delta weight sync, the part both sides share
- ``skyrl_numerics.engine``      inference: everything that imports vLLM
- ``skyrl_numerics.trainer``     FSDP2 / megatron-core trainers, the PPO step, the RL loop
- ``skyrl_numerics.doctor``      the ablation table and the checks behind it
- ``skyrl_numerics.cli``         the ``skyrl-numerics`` command
"""

__version__ = "0.1.0"
