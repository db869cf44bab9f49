"""``skyrl-numerics serve`` + ``RemoteGenerator``: the invariant model behind a real ``vllm serve``
(started by the CLI, stopped by Ctrl-C) gives the same rollouts, bit for bit, as the in-process
invariant engine, and the invariant trainer reproduces its logprobs exactly."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from skyrl_numerics.errors import InputError

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(qwen_moe_dir, tmp_path_factory):
    """``skyrl-numerics serve DIR --batch-invariant`` as a subprocess; yields its URL."""
    from skyrl_numerics.engine.server import free_port

    log = tmp_path_factory.mktemp("serve") / "vllm.log"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "skyrl_numerics.cli", "serve",
                             str(qwen_moe_dir), "--batch-invariant", "--port", str(port),
                             "--log", str(log)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()          # blocks until healthy (or the CLI exits)
    assert line.startswith("serving "), (line, proc.stderr.read() if proc.poll() is not None else "")
    url = line.split(" at ")[1].split(";")[0]
    assert url == f"http://127.0.0.1:{port}"
    yield url, proc, log
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def _same(a, b):
    assert np.array_equal(a.prompt_tokens, b.prompt_tokens)
    assert np.array_equal(a.prompt_cu, b.prompt_cu)
    assert np.array_equal(a.response_tokens, b.response_tokens)
    assert np.array_equal(a.response_cu, b.response_cu)
    assert np.array_equal(a.group_ids, b.group_ids)
    # bitwise, not close
    assert np.array_equal(a.rollout_logprobs.view(np.uint32), b.rollout_logprobs.view(np.uint32))


def test_remote_rollouts_equal_the_in_process_engine(served, vllm_qwen_invariant, qwen_moe_dir):
    from skyrl_numerics.rollout.prompts import make_prompts
    from skyrl_numerics.engine.remote import RemoteGenerator

    url, _, _ = served
    remote = RemoteGenerator(url)
    assert remote.batch_invariant and remote.dtype == "bfloat16"
    assert remote.engine_host.get("isa") == vllm_qwen_invariant.engine_host.get("isa")
    prompts = make_prompts(6, 12, 512, 3)
    kw = dict(temperature=1.0, top_k=16, max_tokens=10, seed=7, n=2, capture_support=True)
    a = remote.generate(prompts, **kw)
    b = vllm_qwen_invariant.generate(prompts, **kw)
    _same(a, b)
    assert a.support == b.support                     # -9999.0 on the wire read back as -inf
    # routes from vLLM's own routed_experts field == the in-process capture over collective_rpc
    assert a.routes is not None and a.routes == b.routes
    assert a.engine.startswith("vllm server") and a.meta["server"] == url
    assert a.sampling["logprobs_mode"] == "processed_logprobs"


def test_the_invariant_trainer_reproduces_the_server_bit_for_bit(served, qwen_moe_dir):
    from skyrl_numerics.rollout.prompts import make_prompts
    from skyrl_numerics.engine.remote import RemoteGenerator
    from skyrl_numerics.trainer.invariant_trainer import InvariantTrainer

    url, _, _ = served
    ro = RemoteGenerator(url).generate(make_prompts(4, 9, 512, 11), temperature=1.0,
                                       max_tokens=12, seed=1, n=3)
    lp = InvariantTrainer(str(qwen_moe_dir)).logprobs(ro)
    assert np.array_equal(np.asarray(lp, np.float32).view(np.uint32),
                          ro.rollout_logprobs.view(np.uint32))


def test_trace_through_the_server_worker_shows_no_divergence(served, qwen_moe_dir, tmp_path):
    """The layer-by-layer tracer's ``vllm-serve`` side: the server's worker records per-module
    digests (``/collective_rpc``), matched to the sequences by their prompt ids; against the
    invariant trainer every module is bitwise equal, prefill and decode."""
    from skyrl_numerics.cli import main
    from skyrl_numerics.doctor.trace import Side, run_trace
    from skyrl_numerics.engine.remote import RemoteGenerator

    url, _, _ = served
    r = run_trace(qwen_moe_dir, ["invariant", Side("vllm-serve", model=RemoteGenerator(url))],
                  per_op=True, decode=2, n_prompts=3)
    assert r.first is None, r.table()
    by = {m.name: m for m in r.comparison.modules}
    assert by["L1.layer"].rows == 3 * 18 and by["L1.router_ids"].rows == 3 * 18
    sched = r.comparison.b.info()["vllm_schedule"]
    assert sched["prefill"] == 3 and sched["decode"] == 3 * 2
    out = tmp_path / "t"
    assert main(["trace", "--model", str(qwen_moe_dir), "--sides", "invariant,vllm-serve",
                 "--server", url, "--prompts", "2", "--out", str(out)]) == 0
    assert (out / "trace.json").is_file()
    assert main(["trace", "--model", str(qwen_moe_dir), "--sides", "invariant,vllm-serve",
                 "--out", str(out)]) == 2     # the server side without --server


def test_the_server_reports_the_contract_its_worker_computes(served, vllm_qwen_invariant,
                                                             qwen_moe_dir):
    """``GET /skyrl_contract`` (the worker's ``skyrl_contract``): the same contract as the
    in-process invariant engine's and the invariant trainer's, one fingerprint."""
    import requests

    from skyrl_numerics.engine.remote import RemoteGenerator
    from skyrl_numerics.invariant import contract as C, from_checkpoint

    url, _, _ = served
    got = RemoteGenerator(url).contract()
    assert got == vllm_qwen_invariant.contract() == C.of_model(from_checkpoint(qwen_moe_dir))
    raw = requests.get(url + "/skyrl_contract", timeout=30).json()
    assert len(raw["workers"]) == 1 and raw["contract"]["fingerprint"] == got.fingerprint()


def test_a_bitwise_loop_whose_trainer_runs_another_kernel_build_is_refused(served, qwen_moe_dir,
                                                                           tmp_path):
    """The trainer as a Ray actor whose process runs without the compiled C kernels
    (``SKYRL_NUMERICS_NATIVE=0``), the server's worker with them: the bitwise loop is refused
    naming ``kernel_build`` before the first step; the server keeps its weights."""
    import ray
    import requests

    from skyrl_numerics.errors import ContractMismatch
    from skyrl_numerics.trainer.loop import CONFIGS, LoopSettings, run_loop

    url, _, _ = served
    version = requests.get(url + "/weight_info", timeout=10).json()["weight_version"]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"SKYRL_NUMERICS_NATIVE": "0"}})
    try:
        with pytest.raises(ContractMismatch) as e:
            run_loop(str(qwen_moe_dir), [CONFIGS["bitwise"]],
                     LoopSettings(steps=1, prompts_per_step=1, samples_per_prompt=1, max_tokens=4,
                                  measure_grad=False),
                     server=url, use_ray=True, work_dir=tmp_path, progress=False)
    finally:
        ray.shutdown()
    assert e.value.fields == ["kernel_build"]
    assert "config 'bitwise', before the first step" in str(e.value)
    assert requests.get(url + "/weight_info", timeout=10).json()["weight_version"] == version


def test_bad_requests_and_servers(served):
    from skyrl_numerics.engine.remote import RemoteGenerator

    url, _, _ = served
    remote = RemoteGenerator(url)
    with pytest.raises(InputError, match="outside the vocabulary"):
        remote.generate([[1, 2, 10**6]])
    with pytest.raises(InputError, match="sampling_mask"):
        remote.generate([[1, 2]], top_p=0.8, capture_support=True)
    with pytest.raises(InputError, match="logits_digest"):
        remote.generate([[1, 2]], logits_digest=True)
    with pytest.raises(InputError, match="no vLLM server"):
        RemoteGenerator("http://127.0.0.1:9")


def test_serve_refuses_an_open_address_without_keys(qwen_moe_dir):
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_API_KEY", "SKYRL_NUMERICS_SYNC_KEY")}
    r = subprocess.run([sys.executable, "-m", "skyrl_numerics.cli", "serve", str(qwen_moe_dir),
                        "--host", "0.0.0.0"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        r.stderr.strip().splitlines()[-1]] and "without an API key" in r.stderr
    r = subprocess.run([sys.executable, "-m", "skyrl_numerics.cli", "serve", str(qwen_moe_dir),
                        "--host", "0.0.0.0", "--api-key", "k"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "without a sync key" in r.stderr


def test_doctor_against_the_server(served, qwen_moe_dir, tmp_path):
    """``doctor --server URL --model DIR``: the bitwise row is 100 % against the invariant server;
    rows that need another engine are skipped with the reason."""
    import json

    from skyrl_numerics.cli import main

    url, _, _ = served
    rows = ["baseline: HF trainer, bf16", "+ batch-invariant (trainer and vLLM)",
            "nvfp4 experts: plain bf16 trainer", "+ batch-invariant, FP8 KV (trainer simulates the cache)",
            "top-p/top-k: + support replay", "+ R3 (router replay)",
            "multi-turn: batch-invariant (trainer and vLLM)"]
    argv = ["doctor", "--server", url, "--model", str(qwen_moe_dir), "--out", str(tmp_path),
            "--max-tokens", "12", "--prompts", "4", "--no-progress"]
    for r in rows:
        argv += ["--row", r]
    assert main(argv) == 0
    rep = {r["name"]: r for r in json.loads((tmp_path / "report.json").read_text())["rows"]}
    assert rep[rows[1]]["summary"]["frac_bitwise_equal"] == 1.0
    assert rep[rows[1]]["summary"]["max_abs"] == 0.0
    # and the whole top-20 distribution per position, read from the server's JSON
    assert rep[rows[1]]["distribution"]["frac_bitwise"] == 1.0
    assert rep[rows[1]]["distribution"]["positions"] == 48
    assert rep[rows[1]]["top-20 dist. bitwise ="] == "100%"
    # both execution contracts recorded, compared before the row ran: one fingerprint
    c = rep[rows[1]]["contract"]
    assert c["diff"] == [] and c["refuses"] and c["trainer"]["fingerprint"] == c["engine"]["fingerprint"]
    # the full-row digest is hashed in an in-process engine's worker: a server sends none
    assert "full distribution bitwise =" not in rep[rows[1]] and "logits_digest" not in rep[rows[1]]
    assert rep[rows[0]]["status"] == "measured" and rep[rows[0]]["summary"]["n_tokens"] == 48
    # multi-turn through the server: each turn one request, routes as routed_experts_prompt_start
    # deltas; every model token of every turn bitwise, its top-20 too
    mt = rep[rows[6]]
    assert mt["summary"]["max_abs"] == 0.0 and mt["top-20 dist. bitwise ="] == "100%", mt
    assert [t["turn"] for t in mt["report"]["per_turn"]] == [0, 1, 2]
    assert rep[rows[4]]["status"] == "measured"
    assert rep[rows[5]]["status"] == "measured"         # routes from the server's routed_experts
    assert rep[rows[2]]["status"].startswith("skipped: the scenario serves other weights")
    assert rep[rows[3]]["status"] == (f"skipped: needs a server storing its KV cache as fp8; {url} "
                                      "stores auto")
    assert main(["doctor", "--server", url, "--out", str(tmp_path / "x")]) == 2   # no --model


@pytest.mark.parametrize("off_policy", [0, 1])
def test_the_bitwise_loop_against_the_server_stays_exact(served, qwen_moe_dir, tmp_path, off_policy):
    """``train --server``: every step's weights go through vLLM's HTTP client and skyrl_delta
    (asynchronous: paused with mode=keep around the update); the invariant trainer recomputes
    the server's logprobs bit for bit at every step. Changes the served weights: runs after the
    tests that compare against the checkpoint."""
    import requests

    from skyrl_numerics.trainer.loop import CONFIGS, LoopSettings, run_loop
    from skyrl_numerics.trainer.reward import RewardTask

    url, _, _ = served
    s = LoopSettings(steps=2, prompts_per_step=2, samples_per_prompt=2, max_tokens=8,
                     off_policy=off_policy, measure_grad=False)
    seen = []

    def even_tokens(ro):     # a user's verifier (--reward): share of even token ids per row
        r = np.array([np.mean(ro.response(i) % 2 == 0) for i in range(len(ro))])
        seen.append(r)
        return r

    res = run_loop(str(qwen_moe_dir), [CONFIGS["bitwise"]], s, server=url, work_dir=tmp_path,
                   progress=False, task=RewardTask(even_tokens, name="even"))
    rows = res.history["bitwise"]
    assert res.settings["task"] == {"reward": "even"}
    assert [r["reward"] for r in rows] == [float(x.mean()) for x in seen]
    if not off_policy:
        assert [r["gap_max_abs"] for r in rows] == [0.0, 0.0]
        assert [r["gap_frac_bitwise_equal"] for r in rows] == [1.0, 1.0]
    else:   # step 1 was sampled one version behind (generated while step 0 trained)
        assert rows[0]["gap_max_abs"] == 0.0 and rows[1]["rollout_lag"] == 1
        assert rows[1]["gap_max_abs"] > 0.0
    assert [r["sync_version"] for r in rows] == [1, 2] and rows[0]["sync_payload_bytes"] > 0
    # the contracts compared before the first step and at both syncs, equal every time
    c = res.contracts["bitwise"]
    assert c["equal"] and c["checks"] == 3 and c["refuses"] and c["engine_changed_at"] == []
    assert c["trainer"]["fingerprint"] == c["engine"]["fingerprint"]
    assert res.to_dict()["contracts"] == res.contracts
    assert requests.get(url + "/weight_info", timeout=10).json()["weight_version"] == "2"
    assert requests.get(url + "/is_paused", timeout=10).json()["is_paused"] is False
    with pytest.raises(InputError, match="needs a stock server"):
        run_loop(str(qwen_moe_dir), [CONFIGS["plain"]], s, server=url, work_dir=tmp_path / "p",
                 progress=False)


def test_ctrl_c_stops_the_server_and_its_processes(served):
    """Last in this module: SIGINT to the CLI ends it with 0 and leaves no vLLM process."""
    import urllib.request

    url, proc, log = served
    port = url.rsplit(":", 1)[1]
    api = subprocess.run(["pgrep", "-f", "--", f"api_server --model .* --port {port} "],
                         capture_output=True, text=True).stdout.split()
    assert len(api) == 1, api
    group = os.getpgid(int(api[0]))    # the server's own session: API process, engine, workers
    members = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True)
    assert len(members.stdout.split()) >= 2      # the API process and at least the engine core
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    assert "stopped" in proc.stderr.read()
    deadline = time.monotonic() + 20
    while True:   # SIGKILLed members may linger a moment as zombies: those do not count
        ps = subprocess.run(["ps", "-eo", "pgid=,stat="], capture_output=True, text=True).stdout
        alive = [ln for ln in ps.splitlines()
                 if ln.split()[0] == str(group) and not ln.split()[1].startswith("Z")]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert alive == []
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/health", timeout=2)
