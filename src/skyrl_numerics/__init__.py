"""skyrl-numerics: measure the trainer-inference logprob gap in RL post-training and remove its causes.

Subpackages (imported lazily; heavy dependencies load only inside the functions that need them):

- ``skyrl_numerics.gap``         the gap tool: ``measure(trainer_lp, rollout_lp, mask=None) -> GapReport``
- ``skyrl_numerics.correction``  off-policy corrections (TIS, masks, MIS)
- ``skyrl_numerics.rollout``     the ragged ``Rollout`` batch and its file formats
- ``skyrl_numerics.models``      tiny seeded random-weight HF MoE checkpoints
- ``skyrl_numerics.kernels``     batch-invariant kernels (folder ``kernels/``)
- ``skyrl_numerics.quant``       bit-exact fake-quant (folder ``quant/``)
- ``skyrl_numerics.replay``      R3 routes and top-p/top-k support replay (folder ``replay/``)
- ``skyrl_numerics.trainer``     vLLM generator, trainer logprobs, weight sync (folder ``trainer/``)
"""

__version__ = "0.1.0"
