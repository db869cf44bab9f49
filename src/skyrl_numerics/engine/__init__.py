"""Inference: everything that imports vLLM (and only this package, besides the host capability
probe ``skyrl_numerics.host``).

- ``generator.py`` — :class:`VLLMGenerator`, one in-process engine; ``remote.py`` —
  :class:`RemoteGenerator`, the same interface over a ``vllm serve`` server; ``multiturn.py`` —
  tool-using trajectories; ``router.py`` — several engine replicas behind one generator;
- ``server.py`` — ``skyrl-numerics serve``; ``vllm_plugin.py`` — the ``vllm.general_plugins``
  entry point (the ``skyrl_delta`` weight-transfer backend, ``transfer_backend.py``, and the
  invariant architectures, ``vllm_invariant_model.py``);
- ``vllm_ext.py`` — the worker extension (route / support / digest capture, ``route_store.py``,
  ``support_store.py``, ``digest_store.py``; vLLM's own fields on CPU, ``aux_outputs.py``;
  in-place weight update, ``weight_update.py``; sharded sync, ``sharded_worker.py``; the MLA
  attribution mixins, ``mla_worker.py``); ``vllm_patches.py`` — every patch of vLLM, listed and
  reversible;
- ``arch_check.py`` — can this vLLM run a checkpoint; ``serving_checkpoint.py`` — the quantized
  serving checkpoints the doctor and trainers hand the engine; ``quiet.py`` — vLLM's logs to a
  file; ``heap.py`` — a CPU worker keeps its freed memory (no page faults per step).

The batch-invariant model the engine runs lives beside it in :mod:`skyrl_numerics.invariant`
(the trainer runs it too); the wire format of weight sync in :mod:`skyrl_numerics.sync`.
"""
