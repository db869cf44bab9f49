"""vLLM general plugin (entry point ``vllm.general_plugins``), run in every vLLM process:

* registers the batch-invariant architectures (one per family in
  ``skyrl_numerics.invariant.FAMILIES``), by import path, so nothing heavy is imported
  until an engine actually selects one;
* registers the ``skyrl_delta`` weight-transfer backend (``engine/transfer_backend.py``);
* installs the server-side patches of ``vllm_patches.py`` (control routes behind ``--api-key``,
  prefix cache reset after a weight update).

First it checks the vLLM release (``vllm_versions.py``): outside the tested range it raises
``UnsupportedVersion`` (one line) and patches nothing; vLLM runs general plugins unguarded, so
the process stops there.
"""


def register() -> None:
    import vllm
    from vllm import ModelRegistry

    from .vllm_versions import check_vllm_version

    check_vllm_version(vllm.__version__, what="skyrl-numerics vLLM plugin")

    from skyrl_numerics.engine import transfer_backend as vllm_backend

    from . import vllm_patches
    from .vllm_invariant_model import ARCHS

    known = ModelRegistry.get_supported_archs()
    for arch in ARCHS.values():
        if arch not in known:
            ModelRegistry.register_model(
                arch, f"skyrl_numerics.engine.vllm_invariant_model:{arch}")
    vllm_backend.register()
    if not vllm_patches.installed():
        vllm_patches.install()
