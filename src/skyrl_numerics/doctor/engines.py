"""The doctor's engines over a run: which engine each scenario uses (:func:`engine_kinds`,
:func:`engine_plan`), one scenario's weights served in place for a while
(:class:`ServedInPlace`), the next engine started while the current one samples
(:class:`EngineStarts`), and whether memory holds another engine (:func:`room_for_engine`, by
the arithmetic of :mod:`skyrl_numerics.doctor.engine_memory`). Used by
:func:`skyrl_numerics.doctor.run_doctor`."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from skyrl_numerics.host import cpu_memory_share


def engine_kinds(spec) -> tuple[bool, bool]:
    """``(in_place, own)`` of a scenario: its weights loaded into the shared engine in place;
    an engine of its own, closed once sampled (another checkpoint, KV format or numerics plan)."""
    in_place = spec.serve is not None and spec.weights_only and not spec.engine
    own = ((spec.serve is not None and not in_place) or "kv_cache" in spec.engine
           or "numerics" in spec.engine)
    return in_place, own


def prefetch_enabled() -> bool:
    """Start engines ahead (``SKYRL_NUMERICS_DOCTOR_PREFETCH=0`` turns it off)."""
    import os

    return os.environ.get("SKYRL_NUMERICS_DOCTOR_PREFETCH", "1") != "0"


def engine_plan(scenarios: list, specs: dict, model_dir, ekw: dict, vllm_generator,
                get_generator) -> tuple[dict, set]:
    """``({scenario: build() of the engine it starts}, {scenarios with an own engine})``; the
    scenarios of the shared stock engine are not in it (the doctor starts that one itself)."""
    plan, own_scenarios = {}, set()
    for sc in scenarios:
        spec = specs[sc]
        in_place, own = engine_kinds(spec)
        if spec.serve is None and spec.engine and not own:     # a shared engine variant
            plan[sc] = lambda spec=spec: get_generator(model_dir, **{**ekw, **spec.engine_for(model_dir)})
        elif own and spec.serve is None:   # a one-off engine variant, closed once sampled
            plan[sc] = lambda spec=spec: vllm_generator(model_dir, **{**ekw, **spec.engine_for(model_dir)})
            own_scenarios.add(sc)
        elif own:                          # another checkpoint: its own engine, closed once sampled
            plan[sc] = lambda spec=spec: vllm_generator(spec.serve(model_dir), **ekw,
                                                        capture_routes=True)
            own_scenarios.add(sc)
    return plan, own_scenarios


class ServedInPlace:
    """The running engine serving another checkpoint's weight values for one scenario: the
    tensors that differ are loaded in place (whole blocks, ``update_vllm_weights``) and the
    original ones loaded back on exit, also after an error. 0.05 s against an engine start of
    20-50 s on CPU; the rollouts are a fresh engine's on the served checkpoint, bit for bit
    (tests/e2e/test_doctor.py)."""

    def __init__(self, engine, base_dir: Path, served_dir: Path, base: dict | None = None):
        import torch

        from skyrl_numerics.invariant.base import load_checkpoint_tensors

        self.engine = engine
        self.base = base if base is not None else load_checkpoint_tensors(base_dir)   # (read once per run)
        self.served = load_checkpoint_tensors(served_dir)
        if set(self.base) != set(self.served) or any(
                self.base[k].shape != self.served[k].shape or self.base[k].dtype != self.served[k].dtype
                for k in self.base):
            raise ValueError(f"{served_dir}: not the same tensors as {base_dir} (weights_only)")
        self.changed = [k for k in self.base if not torch.equal(self.base[k], self.served[k])]

    def __enter__(self):
        from skyrl_numerics.engine.weight_update import update_vllm_weights

        if self.changed:
            try:
                update_vllm_weights(self.engine, self.served, changed=self.changed)
            except BaseException:
                # a load that failed part-way must not leave the shared engine serving a mix
                update_vllm_weights(self.engine, self.base, changed=self.changed)
                raise
        return self.engine

    def __exit__(self, *exc):
        from skyrl_numerics.engine.weight_update import update_vllm_weights

        if self.changed:
            update_vllm_weights(self.engine, self.base, changed=self.changed)
        return False


class EngineStarts:
    """Engines of the coming scenarios, each started one scenario ahead in a background thread
    while the current one samples: on CPU an engine start is 20-50 s of process spawn, imports
    and profiling, most of the doctor's time. At most one start is in flight, and only when
    the machine has memory for one more engine beside those running (:func:`room_for_engine`);
    ``SKYRL_NUMERICS_DOCTOR_PREFETCH=0`` turns it off. An engine that fails to start fails its
    scenario when that scenario asks for it, as a synchronous start would; engines started but
    never used are closed by :meth:`close`. ``alone``: scenarios whose engine starts only after
    the others are released (the memory plan): nothing starts ahead of them."""

    def __init__(self, plan: dict, enabled: bool, alone: frozenset = frozenset()):
        self.plan = plan            # scenario -> build() of the engine it starts
        self.enabled = enabled
        self.alone = set(alone)
        self.futures: dict = {}
        self.used: set = set()
        self.ahead_started: list = []   # scenarios whose engine started in the background
        self.pool = None

    def busy(self) -> bool:
        """Is an engine starting right now (it shares the cores with the sampling engine)?"""
        return any(not f.done() for f in self.futures.values())

    def get(self, scenario: str):
        self.used.add(scenario)
        fut = self.futures.pop(scenario, None)
        return fut.result() if fut is not None else self.plan[scenario]()

    def ahead(self, scenarios: list, i: int, room: Callable[[], bool]) -> None:
        """Start the engine of the next scenario after ``scenarios[i]`` that builds one."""
        if not self.enabled or any(not f.done() for f in self.futures.values()):
            return
        nxt = next((s for s in scenarios[i + 1:] if s in self.plan and s not in self.used), None)
        if nxt is None or nxt in self.futures or nxt in self.alone or not room():
            return
        if self.pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(1, thread_name_prefix="doctor-engine-start")
        self.futures[nxt] = self.pool.submit(self.plan[nxt])
        self.ahead_started.append(nxt)

    def close(self, own: set) -> None:
        """Close the unused engines of ``own`` scenarios (after their start finishes)."""
        for sc, fut in self.futures.items():
            try:
                engine = fut.result()
            except Exception:
                continue
            if sc in own:
                engine.close()
        self.futures.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def room_for_engine(ckpt) -> bool:
    """True on CPU when the measured available RAM holds one more engine beside everything
    running now: the largest engine of the run as :mod:`skyrl_numerics.doctor.engine_memory` sizes it
    (``ckpt.memory_plan``, set by the doctor's memory plan) plus ``HEADROOM``; without a plan,
    the engines' ``gpu_memory_utilization`` share of RAM (``host.cpu_memory_share()``) + twice the weights + 1.5 GiB, twice. False on GPU
    (engines there share the device's memory by ``gpu_memory_utilization``) and when psutil is
    missing."""
    try:
        import psutil
        import torch

        if torch.cuda.is_available():
            return False
        vm = psutil.virtual_memory()
    except Exception:
        return False
    plan = getattr(ckpt, "memory_plan", None)
    if plan is not None and plan.prefetch_bytes:
        from skyrl_numerics.doctor.engine_memory import HEADROOM

        return vm.available >= plan.prefetch_bytes + HEADROOM
    weights = int(getattr(ckpt, "weight_bytes", 0) or 0)
    one = cpu_memory_share() * vm.total + 2 * weights + 1.5 * (1 << 30)
    return vm.available > 2 * one
