"""The tracer's comparator: two :class:`Trace`\\ s of the same token sequences, module by module
in forward order — where they first part, by how much, and how the difference grows after it.

Rows are aligned by ``(sequence, position)`` and compared where both sides computed them (vLLM
computes the logits of the sampled positions only; a trainer, of every position). Per module:

- ``rows ≠``: the share of aligned rows whose digests differ (a digest is 16 bytes of the row's
  float32 bytes: equal digests, equal bits);
- ``max|x|`` and ``mean`` of each side (from each row's ``max|x|`` and sum);
- with kept tensors (``keep_tensors``): ``max|Δ|`` over the aligned elements, ``ulps``: the
  largest ``|a - b|`` in units in the last place **at bf16** of the larger of the two
  magnitudes (:func:`bf16_ulps`; a float32 router logit that differs below bf16's resolution
  counts a fraction of one), and ``elements ≠``: the share of elements whose float32 values
  differ. Without kept
  tensors ``max|Δ|`` is not known; ``Δ max|x|`` (the largest difference of the rows' ``max|x|``)
  stands in for its size.

The **first divergence** is the first module in forward order with a differing row; the modules
after it show the growth (the ``layer`` rows: the residual stream after each layer).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from skyrl_numerics.atomic import atomic_file


@dataclass
class ModuleRows:
    """One module's rows on one side: per sequence a dict of arrays (``pos``, ``digest``,
    ``max_abs``, ``sum``, ``rows`` or None), or None where the side computed none."""
    width: int
    dtype: str
    seqs: list


@dataclass
class Trace:
    """One side's trace of the sequences: its modules by canonical name (forward order)."""
    side: str
    kind: str                   # hf | hf-mode | invariant | vllm | vllm-invariant
    modules: dict
    order: list                 # canonical names in forward order (trace_roles.canonical_order)
    algo: str
    forward_s: float = 0.0      # wall time of the traced forwards (hooks included)
    capture_s: float = 0.0      # of which: cutting, converting, hashing rows
    steps: list | None = None   # vLLM's schedule: per forward [request, first position, n, kind]
    notes: list = field(default_factory=list)

    def info(self) -> dict:
        """trace.json's record of the side (no rows)."""
        out = {"side": self.side, "kind": self.kind, "modules": len(self.modules),
               "forward_s": round(self.forward_s, 4), "capture_s": round(self.capture_s, 4),
               "notes": self.notes}
        if self.steps is not None:
            kinds = [r[3] for step in self.steps for r in step]
            out["vllm_schedule"] = {"forwards": len(self.steps),
                                    **{k: kinds.count(k) for k in ("prefill", "chunk", "decode")},
                                    "steps": self.steps}
        return out


@dataclass
class ModuleDiff:
    name: str
    status: str                 # equal | differs | only <side> | shapes differ
    rows: int = 0
    rows_differing: int = 0
    first_row: list | None = None      # [sequence, position] of the first differing row
    max_abs_a: float | None = None
    max_abs_b: float | None = None
    mean_a: float | None = None
    mean_b: float | None = None
    delta_max_abs: float | None = None
    max_abs_delta: float | None = None   # kept tensors only
    max_ulps_bf16: float | None = None
    frac_elements_differing: float | None = None

    @property
    def frac_rows(self) -> float:
        return self.rows_differing / self.rows if self.rows else 0.0


def bf16_ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|a - b|`` in units of the bf16 ulp of the larger magnitude: ``ulp(x) = 2**(e - 7)`` for
    ``2**e <= |x| < 2**(e+1)`` (bf16 keeps 8 significant bits), floored at bf16's smallest
    normal's ulp ``2**-133``. Two neighbouring bf16 values are 1 ulp apart; a float32 difference
    below bf16's resolution is a fraction of one."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    big = np.maximum(np.abs(a), np.abs(b))
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(big > 0, big, 1.0)))
    ulp = np.exp2(np.maximum(e, -126.0) - 7.0)   # 2**-133 at and below the smallest normal
    return np.abs(a - b) / ulp


def _aligned(ma: ModuleRows, mb: ModuleRows):
    """Per sequence present on both sides: (sequence, positions, a's arrays, b's arrays) over the
    positions both computed."""
    for i, (sa, sb) in enumerate(zip(ma.seqs, mb.seqs)):
        if sa is None or sb is None:
            continue
        pos, ia, ib = np.intersect1d(sa["pos"], sb["pos"], return_indices=True)
        if len(pos):
            yield i, pos, {k: (v[ia] if v is not None else None) for k, v in sa.items()}, \
                {k: (v[ib] if v is not None else None) for k, v in sb.items()}


def compare_module(name: str, ma: ModuleRows, mb: ModuleRows) -> ModuleDiff:
    if ma.width != mb.width:
        return ModuleDiff(name, f"shapes differ ({ma.width} / {mb.width} per row)")
    d = ModuleDiff(name, "equal")
    mx_a, mx_b, s_a, s_b, dmx = [], [], [], [], []
    tens = []
    for i, pos, a, b in _aligned(ma, mb):
        neq = (a["digest"] != b["digest"]).any(axis=1)
        if neq.any() and d.first_row is None:
            d.first_row = [int(i), int(pos[int(np.argmax(neq))])]
        d.rows += len(pos)
        d.rows_differing += int(neq.sum())
        mx_a.append(a["max_abs"]), mx_b.append(b["max_abs"])
        s_a.append(a["sum"]), s_b.append(b["sum"])
        dmx.append(np.abs(a["max_abs"] - b["max_abs"]))
        if a["rows"] is not None and b["rows"] is not None:
            tens.append((a["rows"], b["rows"]))
    if not d.rows:
        return ModuleDiff(name, "no common rows")
    d.status = "differs" if d.rows_differing else "equal"
    width = max(ma.width, 1)
    d.max_abs_a, d.max_abs_b = float(np.concatenate(mx_a).max()), float(np.concatenate(mx_b).max())
    d.mean_a = float(np.concatenate(s_a).sum() / (d.rows * width))
    d.mean_b = float(np.concatenate(s_b).sum() / (d.rows * width))
    d.delta_max_abs = float(np.concatenate(dmx).max())
    if tens:
        ra, rb = np.concatenate([t[0] for t in tens]), np.concatenate([t[1] for t in tens])
        with np.errstate(invalid="ignore"):
            d.max_abs_delta = float(np.nanmax(np.abs(ra - rb))) if ra.size else 0.0
        with np.errstate(invalid="ignore"):
            d.max_ulps_bf16 = float(np.nanmax(bf16_ulps(ra, rb))) if ra.size else 0.0
        same = (ra == rb) | (np.isnan(ra) & np.isnan(rb))
        d.frac_elements_differing = float(1.0 - same.mean()) if ra.size else 0.0
    return d


@dataclass
class TraceComparison:
    """Module by module, in forward order (see the module docstring)."""
    a: Trace
    b: Trace
    modules: list

    @property
    def first(self) -> ModuleDiff | None:
        return next((m for m in self.modules if m.status == "differs"), None)

    @property
    def growth(self) -> list:
        """The compared modules from the first divergence on."""
        f = self.first
        if f is None:
            return []
        i = self.modules.index(f)
        return [m for m in self.modules[i:] if m.rows]

    def to_dict(self) -> dict:
        f = self.first
        return {"sides": [self.a.info(), self.b.info()], "algo": self.a.algo,
                "first_divergence": None if f is None else
                {**asdict(f), "frac_rows_differing": f.frac_rows},
                "modules": [{**asdict(m), "frac_rows_differing": m.frac_rows}
                            for m in self.modules]}


def compare(a: Trace, b: Trace) -> TraceComparison:
    """Every module of either side, in forward order (names only one side has: ``only <side>``)."""
    order = list(dict.fromkeys([n for n in a.order if n in a.modules or n in b.modules]
                               + [n for n in b.order if n in a.modules or n in b.modules]))
    out = []
    for name in order:
        ma, mb = a.modules.get(name), b.modules.get(name)
        if ma is None or mb is None:
            out.append(ModuleDiff(name, f"only {(a if mb is None else b).side}"))
        else:
            out.append(compare_module(name, ma, mb))
    return TraceComparison(a, b, out)


def _g(x, fmt="{:.3g}"):
    return "-" if x is None else fmt.format(x)


def table_rows(cmp: TraceComparison) -> list[list[str]]:
    """The table: one row per module both sides have (header first)."""
    rows = [["module", "rows ≠", f"max|x| {cmp.a.side}", f"max|x| {cmp.b.side}", "Δ max|x|",
             "max|Δ|", "ulps (bf16)", "elements ≠"]]
    first = cmp.first
    for m in cmp.modules:
        if not m.rows:
            continue
        mark = " ← first" if m is first else ""
        rows.append([m.name + mark, f"{m.rows_differing}/{m.rows}", _g(m.max_abs_a),
                     _g(m.max_abs_b), _g(m.delta_max_abs), _g(m.max_abs_delta),
                     _g(m.max_ulps_bf16, "{:.3g}"), _g(m.frac_elements_differing, "{:.1%}")])
    return rows


def format_table(cmp: TraceComparison) -> str:
    rows = table_rows(cmp)
    w = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w[j]) for j, c in enumerate(r)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    f = cmp.first
    head = (f"{cmp.a.side} vs {cmp.b.side}: " + ("no divergence (every common row bitwise equal)"
            if f is None else f"first divergence at {f.name} (sequence {f.first_row[0]}, "
            f"position {f.first_row[1]}; {f.rows_differing}/{f.rows} rows differ)"))
    one_sided = [m.name for m in cmp.modules if not m.rows]
    tail = [f"not compared ({len(one_sided)}): " + ", ".join(
        f"{m.name} [{m.status}]" for m in cmp.modules if not m.rows)] if one_sided else []
    return "\n".join([head, *lines, *tail])


def plot(cmp: TraceComparison, path: Path) -> None:
    """The PNG: per compared module (forward order) the share of rows that differ, and the size
    of the difference (max|Δ| with kept tensors, else Δ max|x|), the first divergence marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mods = [m for m in cmp.modules if m.rows]
    x = np.arange(len(mods))
    size = [m.max_abs_delta if m.max_abs_delta is not None else m.delta_max_abs for m in mods]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 0.35 * len(mods) + 2), 6),
                                      sharex=True)
    top.bar(x, [100 * m.frac_rows for m in mods], color="tab:blue")
    top.set_ylabel("rows differing (%)")
    bottom.plot(x, [max(s or 0.0, 1e-12) for s in size], "o-", color="tab:red")
    bottom.set_yscale("log")
    bottom.set_ylabel("max|Δ|" if any(m.max_abs_delta is not None for m in mods)
                      else "Δ max|x| (digests only)")
    f = cmp.first
    if f is not None and f in mods:
        for ax in (top, bottom):
            ax.axvline(mods.index(f), color="k", ls="--", lw=1)
    bottom.set_xticks(x, [m.name for m in mods], rotation=90, fontsize=7)
    fig.suptitle(f"{cmp.a.side} vs {cmp.b.side}: "
                 + ("no divergence" if f is None else f"first divergence at {f.name}"))
    fig.tight_layout()
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=100, format="png")
    finally:
        plt.close(fig)


def write(cmp: TraceComparison, out_dir: Path, extra: dict | None = None) -> dict:
    """``trace.json`` and ``trace.png`` in ``out_dir``; returns the JSON written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {**(extra or {}), **cmp.to_dict()}
    with atomic_file(out_dir / "trace.json") as tmp:
        tmp.write_text(json.dumps(doc, indent=1, default=str))
    plot(cmp, out_dir / "trace.png")
    return doc
