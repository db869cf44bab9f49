"""The package layout the docs promise: only the inference package (and the host capability probe)
imports vLLM, no module imports another module's private name, and the import graph has no cycle
across packages. Read from the source with ``ast``: nothing is imported."""
from __future__ import annotations

import ast
import os
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "skyrl_numerics"
VLLM_ALLOWED = ("skyrl_numerics.engine", "skyrl_numerics.host")


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


MODULES = _modules()


def _imports(mod: str):
    """``(target module, imported name or None, line)`` of every import in ``mod``, at any depth."""
    path, is_pkg = MODULES[mod]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = mod.split(".")[:None if is_pkg else -1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                yield (sub, None, node.lineno) if sub in MODULES else (base, a.name, node.lineno)


def test_only_the_engine_package_and_the_host_probe_import_vllm():
    bad = [f"{m}:{line} imports {t}" for m in MODULES for t, _, line in _imports(m)
           if (t == "vllm" or t.startswith("vllm.")) and not m.startswith(VLLM_ALLOWED)]
    assert not bad, "\n".join(bad)


def test_no_module_imports_a_private_name_of_another():
    bad = [f"{m}:{line} imports {name} from {t}" for m in MODULES for t, name, line in _imports(m)
           if name and name.startswith("_") and not name.startswith("__") and t in MODULES and t != m]
    assert not bad, f"{len(bad)} private imports:\n" + "\n".join(bad)


def _package(mod: str) -> str:
    """The top-level piece a module belongs to (``skyrl_numerics.trainer.fsdp.lora`` -> ``trainer``)."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycle_crosses_packages():
    graph = {m: {t for t, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    crossing = [c for c in comps if len({_package(m) for m in c}) > 1]
    assert not crossing, f"import cycles across packages: {crossing}"
    assert max(len(c) for c in comps) <= 6, max(comps, key=len)


def test_hypothesis_is_derandomized_under_ci():
    from hypothesis import settings

    ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    if os.environ.get("HYPOTHESIS_PROFILE"):
        assert settings.default.derandomize == (os.environ["HYPOTHESIS_PROFILE"] == "ci")
    else:
        assert settings.default.derandomize == ci


# Packages from the bottom up: each imports only packages before it in this list (README, Layout).
LAYERS = ["errors", "atomic", "paths", "hashing", "patching", "host", "safetensors_header",
          "hf_config", "kernels", "quant", "replay", "gap", "correction_skyrl", "correction_trl", "correction",
          "rollout", "copy_task", "models", "trained_models",
          "invariant", "sync", "engine", "trainer", "doctor", "integrations", "cli"]


def test_packages_import_only_the_layers_below_them():
    pieces = {_package(m) for m in MODULES} - {""}
    assert pieces == set(LAYERS), f"a package is missing from LAYERS: {sorted(pieces ^ set(LAYERS))}"
    bad = [f"{m}:{line} ({_package(m)}) imports {t} ({_package(t)})"
           for m in MODULES for t, _, line in _imports(m)
           if t in MODULES and _package(t) not in ("", _package(m))
           and LAYERS.index(_package(t)) > LAYERS.index(_package(m))]
    assert not bad, "\n".join(bad)
