#!/usr/bin/env python
"""The GPU check: the ``gpu``-marked tests and the GPU benchmarks under one time budget, one report.

    python benchmarks/gpu_check.py OUT_DIR             # or: OUT=dir python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py OUT_DIR --budget 300 --sections kernels,mode,quant
    python benchmarks/gpu_check.py OUT_DIR --dry-run   # CPU: Triton interpreter, tiny shapes

Nothing here checks a kernel itself: each section is a child ``python -m pytest -m gpu`` on test
or benchmark files of this checkout, and this script budgets them and writes ``gpu.json`` and
``gpu.md`` (rewritten after every section). The checks are the tests, with one case list per op
shared with the CPU runs (tests/device_cases.py):

  kernels         tests/kernels/test_triton_ops.py (every Triton kernel, the CPU tests' cases on
                  the device) + tests/kernels/test_triton_real_sizes.py (real sizes, bf16 tl.dot)
  mode            tests/kernels/test_mode.py: batch_invariant_mode() per claimed aten op and on
                  models (MLP, HF Qwen3-MoE forward + backward), on the device
  quant           tests/quant/test_triton.py: Triton fake-quant bitwise vs the torch recipes
  matmul_perf     benchmarks/bench_gpu_kernels.py: matmul / bmm / grouped vs cuBLAS
  attention_perf  benchmarks/bench_gpu_kernels.py: attention (prefill, decode) vs torch SDPA
  quant_perf      benchmarks/bench_gpu_quant.py: fake-quant GB/s vs y.copy_(x)

The package must be installed (``pip install -e .``): when ``skyrl_numerics`` is not importable
this script says so and exits 2. ``--dry-run`` sets ``TRITON_INTERPRET=1`` and
``SKYRL_NUMERICS_GPU_DRY_RUN=1`` in the children only: the same tests run on CPU tensors in the
Triton interpreter with tiny shapes (tests/kernels/test_gpu_check_dry_run.py runs it in make test).

Budget: ``--budget`` seconds (default 480) for all sections. Each section gets its share of what
is left (unused time rolls over) as its timeout; a test slower than ``--test-timeout`` fails
(pytest-timeout) and the section goes on. At its timeout a section is interrupted (SIGINT: pytest
writes the results so far), killed ``--grace`` seconds later if still running, and is
``timeout``; a section reached after the budget is spent is ``skipped``.

gpu.json (schema 2):
  schema, tool, command, dry_run, started_at, wall_s, budget_s, exit_code
  env:      python, platform, torch, torch_cuda, triton, transformers, skyrl_numerics (where it is
            imported from), device, device_name, capability, sm_count, memory_gib, nvidia_smi,
            triton_interpret, git_commit
  sections: {name: {status, seconds, notes[], rows[], returncode, command, counts}}
            status: "ok" | "mismatch" (a test failed) | "failed" (pytest itself failed, or no
            test ran) | "skipped" | "timeout"
            counts: {passed, failed, error, skipped}
  rows:     one per test: test, file, outcome ("passed" | "failed" | "error" | "skipped"), ok
            (true / false / null for skipped), seconds, message?, and what the test recorded
            (record_property), e.g. max_rel_err, tol (kernels); ours_ms, base_ms,
            frac_of_base = base_ms / ours_ms, baseline, ours_tflops (matmul_perf, attention_perf);
            gbs, copy_gbs, frac_of_copy (quant_perf)
  summary:  {ok, mismatch, failed, skipped, timeout} counts of sections
Exit code: 0 when no section is mismatch / failed / timeout, 1 otherwise, 2 when there is no CUDA
device and --dry-run was not given, or skyrl_numerics is not importable (gpu.json still written).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMA = 2
# name: (pytest targets and selection, share of the budget)
SECTIONS = {
    "kernels": (["tests/kernels/test_triton_ops.py", "tests/kernels/test_triton_real_sizes.py"], 2.0),
    "mode": (["tests/kernels/test_mode.py"], 1.5),
    "quant": (["tests/quant/test_triton.py"], 2.0),
    "matmul_perf": (["benchmarks/bench_gpu_kernels.py", "-k", "not attention"], 3.0),
    "attention_perf": (["benchmarks/bench_gpu_kernels.py", "-k", "attention"], 1.0),
    "quant_perf": (["benchmarks/bench_gpu_quant.py"], 1.0),
}
DRY_ENV = "SKYRL_NUMERICS_GPU_DRY_RUN"
BAD = ("mismatch", "failed", "timeout")


# ============================================================================ one section
def pytest_cmd(name: str, xml: Path, out: Path, args) -> list[str]:
    targets, _ = SECTIONS[name]
    how = args.inject.get(name)
    if how == "hang":        # for the tests of this script: a section that never ends
        return [sys.executable, "-c", "import time; time.sleep(3600)"]
    if how == "fail":        # ... and one whose pytest dies without a report
        return [sys.executable, "-c", "raise SystemExit(3)"]
    cmd = [sys.executable, "-m", "pytest", *targets, "-m", "gpu", "-q", "-p", "no:cacheprovider",
           "--rootdir", str(REPO), "-o", "python_files=test_*.py bench_*.py", "-o", "junit_family=xunit1",
           f"--junitxml={xml}", f"--timeout={args.test_timeout:g}"]
    if targets[0].startswith("benchmarks/"):
        cmd += (["--benchmark-disable"] if args.dry_run else
                ["--benchmark-columns=min,median,max", f"--benchmark-json={out / f'bench_{name}.json'}"])
    return cmd


def child_env(dry: bool) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", DRY_ENV, "SKYRL_NUMERICS_INTERPRETER_CHILD")}
    if dry:
        env.update({"TRITON_INTERPRET": "1", DRY_ENV: "1"})
    return env


def run_child(cmd: list[str], env: dict, timeout: float, grace: float, log: Path) -> tuple[int | None, bool]:
    """Runs ``cmd`` in its own process group; at ``timeout`` SIGINT (pytest then writes its junit
    report), SIGKILL ``grace`` s later. Returns (returncode, timed_out)."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=max(timeout, 0.1)), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return proc.returncode, True


def _num(v: str):
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


def junit_rows(xml: Path) -> list[dict]:
    if not xml.exists():
        return []
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        row = dict(test=case.get("name"), file=case.get("file") or case.get("classname"),
                   outcome="passed", ok=True, seconds=float(case.get("time") or 0.0))
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                row.update(outcome="failed" if tag == "failure" else tag, ok=None if tag == "skipped" else False,
                           message=((el.get("message") or "") + "\n" + (el.text or "")).strip()[:1500])
                break
        for prop in case.iter("property"):
            row[prop.get("name")] = _num(prop.get("value"))
        rows.append(row)
    return rows


def run_section(name: str, timeout: float, out: Path, args) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = pytest_cmd(name, xml, out, args)
        log = out / f"{name}.log"
        t0 = time.monotonic()
        rc, timed_out = run_child(cmd, child_env(args.dry_run), timeout, args.grace, log)
        rows = junit_rows(xml)
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error", "skipped")}
    notes = []
    if timed_out:
        status = "timeout"
        notes.append(f"stopped at its {timeout:.0f} s share of the budget; {len(rows)} tests reported")
    elif counts["failed"] or counts["error"]:
        status = "mismatch"
    elif rc != 0:
        status = "failed"
        notes.append(f"pytest exited {rc}" + (" (no tests collected)" if rc == 5 else ""))
    elif not counts["passed"]:
        status = "skipped"
        notes.append("every test skipped: " + "; ".join(sorted({r.get("message", "")[:120] for r in rows})))
    else:
        status = "ok"
    if status in ("failed", "timeout") or (status == "mismatch" and not rows):
        notes.append("log tail:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
    return dict(status=status, seconds=round(time.monotonic() - t0, 2), notes=notes, rows=rows,
                returncode=rc, counts=counts, command=" ".join(cmd[1:]), log=log.name)


# ============================================================================ output
def _fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "**no**", None: ""}[v]
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v).replace("|", "/").replace("\n", " ")[:200]


def to_markdown(res: dict) -> str:
    env = res["env"]
    title = env.get("device_name") or ("CPU" if res["dry_run"] else "no CUDA device")
    dry = " (DRY RUN: CPU, Triton interpreter, tiny shapes; timings meaningless)" if res["dry_run"] else ""
    lines = [f"### GPU check: {title}{dry}", "", f"Command: `{res['command']}`  ",
             f"python {env.get('python')}, torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), "
             f"triton {env.get('triton')}, transformers {env.get('transformers')}, capability "
             f"{env.get('capability')}, {env.get('sm_count')} SMs, commit {env.get('git_commit')}  ",
             f"wall {res.get('wall_s', 0):.1f} s of a {res['budget_s']:.0f} s budget; sections: "
             + ", ".join(f"{k} **{v['status']}**" for k, v in res["sections"].items()), ""]
    for name, s in res["sections"].items():
        c = s.get("counts") or {}
        lines.append(f"#### {name}: {s['status']}, {s.get('seconds', 0):.1f} s"
                     + (f" ({', '.join(f'{v} {k}' for k, v in c.items() if v)})" if c else ""))
        lines += [f"* {n}" if "\n" not in n else f"```\n{n}\n```" for n in s.get("notes", [])]
        rows = s.get("rows", [])
        if rows:
            cols = ["test", "outcome", "seconds"]
            cols += [k for r in rows for k in r if k not in cols + ["file", "ok", "message"]]
            cols = list(dict.fromkeys(cols)) + (["message"] if any("message" in r for r in rows) else [])
            lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines) + "\n"


def write(out: Path, res: dict) -> None:
    res["summary"] = {k: sum(s["status"] == k for s in res["sections"].values())
                      for k in ("ok", "mismatch", "failed", "skipped", "timeout")}
    for fname, text in (("gpu.json", json.dumps(res, indent=1, default=str)), ("gpu.md", to_markdown(res))):
        fd, tmp = tempfile.mkstemp(dir=out, prefix="." + fname)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out / fname)


def _version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str]):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(dry: bool, spec) -> dict:
    env = dict(python=platform.python_version(), platform=platform.platform(), torch=None, torch_cuda=None,
               triton=_version("triton"), transformers=_version("transformers"),
               skyrl_numerics=spec.origin if spec else None, device="cpu" if dry else "cuda",
               triton_interpret="1" if dry else None,
               git_commit=_run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]))
    import torch
    env.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
    if not dry and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device_name=p.name, capability=f"sm_{p.major}{p.minor}", sm_count=p.multi_processor_count,
                   memory_gib=round(p.total_memory / 2**30, 1),
                   nvidia_smi=_run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                    "--format=csv,noheader"]))
    return env


# ============================================================================ main
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("out", nargs="?", default=None, help="output folder (default: $OUT, else ./gpu_check_out)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all sections (default 480)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds between a section's interrupt at its timeout and its kill (default 30)")
    p.add_argument("--test-timeout", type=float, default=300.0, help="seconds per test (pytest-timeout)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list from {','.join(SECTIONS)}")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: the children run with TRITON_INTERPRET=1 and tiny shapes")
    # for the tests of this script: SECTION=hang|fail replaces that section's pytest
    p.add_argument("--inject", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.inject = dict(item.split("=", 1) for item in args.inject)
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        p.error(f"unknown section(s) {bad}; choose from {', '.join(SECTIONS)}")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or "gpu_check_out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    spec = importlib.util.find_spec("skyrl_numerics")
    res = dict(schema=SCHEMA, tool="benchmarks/gpu_check.py",
               command=("python benchmarks/gpu_check.py " + " ".join(argv)).strip(), dry_run=args.dry_run,
               started_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               wall_s=0.0, budget_s=args.budget, exit_code=None, env={}, sections={})

    def give_up(why: str) -> int:
        for name in args.sections:
            res["sections"][name] = dict(status="skipped", seconds=0.0, notes=[why], rows=[])
        res.update(exit_code=2, error=why)
        write(out, res)
        print(f"gpu_check: {why}; wrote {out / 'gpu.json'}", file=sys.stderr)
        return 2
    if spec is None:
        res["env"] = dict(python=platform.python_version(), skyrl_numerics=None)
        return give_up(f"skyrl_numerics is not importable from {sys.executable}: install this checkout "
                       f"(pip install -e {REPO}) into the python that has the CUDA torch")
    res["env"] = environment(args.dry_run, spec)
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        return give_up("no CUDA device (use --dry-run on CPU)")

    for i, name in enumerate(args.sections):
        left = args.budget - (time.monotonic() - t0)
        if left <= 0:
            res["sections"][name] = dict(status="skipped", seconds=0.0, rows=[],
                                         notes=[f"skipped: the {args.budget:.0f} s budget was used up before this section"])
            print(f"[gpu_check] {name}: skipped (budget used up)", flush=True)
        else:
            share = SECTIONS[name][1]
            slot = left * share / sum(SECTIONS[s][1] for s in args.sections[i:])
            print(f"[gpu_check] {name}: start ({slot:.0f} s share, {left:.0f} s left)", flush=True)
            res["sections"][name] = sec = run_section(name, slot, out, args)
            print(f"[gpu_check] {name}: {sec['status']} in {sec['seconds']:.1f} s, {sec['counts']}", flush=True)
        res["wall_s"] = round(time.monotonic() - t0, 2)
        write(out, res)
    bad = [n for n, s in res["sections"].items() if s["status"] in BAD]
    res.update(exit_code=1 if bad else 0, wall_s=round(time.monotonic() - t0, 2))
    write(out, res)
    print(f"[gpu_check] wrote {out / 'gpu.json'} and {out / 'gpu.md'}; "
          f"{'problems in: ' + ', '.join(bad) if bad else 'no failures'}; {res['wall_s']:.1f} s", flush=True)
    return res["exit_code"]


if __name__ == "__main__":
    raise SystemExit(main())
