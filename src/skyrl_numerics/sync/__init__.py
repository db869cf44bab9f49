"""Weight sync trainer -> engine, the part both sides share: the XOR + zstd delta codec
(``codec.py``), the store (``store.py``), the signed manifest (``manifest.py``), the publisher and
receiver (``weight_sync.py``), the serving format of quantized weights (``serving.py``), sharded
plans and transfers (``shard_layouts.py``, ``shard_plan.py``, ``sharded.py``) and vLLM's load
blocks (``load_blocks.py``). Loading into a running vLLM engine is
:mod:`skyrl_numerics.engine.weight_update` / :mod:`skyrl_numerics.engine.sharded_worker`."""
