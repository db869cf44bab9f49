"""Rendering of gap reports: a rich table, ``report.json`` and a PNG (|Δ| histogram + per-position curve).

Shared by ``skyrl-numerics doctor`` (one row per ablation) and ``skyrl-numerics gap FILE`` (one row).
Files are written to temp names and renamed, so an error never leaves a partial report.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from skyrl_numerics.atomic import atomic_file, atomic_files
from skyrl_numerics.errors import InputError

# (column title, summary key, format)
COLUMNS = [
    ("mean |Δ|", "mean_abs", "{:.2e}"),
    ("p99 |Δ|", "p99_abs", "{:.2e}"),
    ("max |Δ|", "max_abs", "{:.2e}"),
    ("bitwise =", "frac_bitwise_equal", "{:.1%}"),
    ("KL k3", "kl_k3", "{:.2e}"),
    ("F(2)", "F_2", "{:.2%}"),
    ("PPL ratio", "ppl_ratio", "{:.4f}"),
    ("ESS", "ess", "{:.4f}"),
]


@dataclass
class ReportRow:
    name: str
    report: Any                      # skyrl_numerics.gap.GapReport
    abs_delta: np.ndarray            # flat |Δ| per token, for the histogram
    extra: dict = field(default_factory=dict)   # e.g. tokens/s, note


def _fmt(v, f):
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "-"
    return f.format(v)


def plain(text) -> str:
    """``text`` as rich prints it verbatim: markup-like brackets escaped (a path ``run[/x]`` or
    an engine name from a file is not a style), and code points a terminal cannot encode (lone
    surrogates, e.g. from undecodable file names) as ``\\udXXX`` escapes."""
    from rich.markup import escape

    return escape(str(text).encode("utf-8", "backslashreplace").decode("utf-8"))


@dataclass
class _Summary:
    """A per-turn row of a GapReport (a dict of its summary keys) where a report is expected."""
    row: dict

    def summary(self) -> dict:
        return self.row


def turn_rows(report) -> list[ReportRow]:
    """One :class:`ReportRow` per turn of ``report.per_turn`` (for :func:`render_table`)."""
    return [ReportRow(f"turn {r['turn']}", _Summary(r), np.zeros(0)) for r in report.per_turn]


def render_table(rows: list[ReportRow], title: str, console=None, label: str = "configuration") -> None:
    """The rows as one rich table; every text is printed as given (:func:`plain`). ``label``:
    the first column's title."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title=plain(title), title_justify="left")
    t.add_column(label, style="bold")
    t.add_column("tokens", justify="right")
    for c, _, _ in COLUMNS:
        t.add_column(c, justify="right")
    # keys starting with "_" are not columns; "_<key> mark" = (mark, footnote) flags a cell
    extra_keys = sorted({k for r in rows for k in r.extra if k != "note" and not k.startswith("_")})
    for k in extra_keys:
        t.add_column(k, justify="right")
    footnotes = {}
    for r in rows:
        s = r.report.summary()
        cells = [plain(r.name), str(s.get("n_tokens", "-"))]
        cells += [_fmt(s.get(key), f) for _, key, f in COLUMNS]
        for k in extra_keys:
            v = r.extra.get(k)
            cell = _fmt(v, "{:.4g}") if isinstance(v, (int, float)) else str(r.extra.get(k, "-"))
            mark = r.extra.get(f"_{k} mark")
            if mark:
                cell += mark[0]
                footnotes[mark[0]] = mark[1]
            cells.append(plain(cell))
        t.add_row(*cells)
    console.print(t)
    for mark, text in footnotes.items():
        console.print(f"  [dim]{plain(mark)} {plain(text)}[/dim]")
    for r in rows:
        if r.extra.get("note"):
            console.print(f"  [dim]{plain(r.name)}: {plain(r.extra['note'])}[/dim]")


def check_out_dir(out, flag: str = "--out", names=()) -> Path:
    """``out`` as a directory the outputs (files ``names``) can go to, checked before any work:
    it is a directory or does not exist yet, its nearest existing ancestor is a writable
    directory, and no output name is taken by a directory (nothing is created here). Otherwise
    the project's error naming the flag and the path."""
    import os

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"{flag} {out}: exists and is not a directory", field=flag.lstrip("-"))
    for name in names:
        if (out / name).is_dir():
            raise InputError(f"{flag} {out}: {name} is a directory", field=flag.lstrip("-"))
    anc = out
    while not anc.exists():
        if anc.parent == anc:
            break
        anc = anc.parent
    if not anc.is_dir():
        raise InputError(f"{flag} {out}: {anc} is not a directory", field=flag.lstrip("-"))
    if not os.access(anc, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {out}: {anc} is not writable", field=flag.lstrip("-"))
    return out


def write_files(out, writers: dict, flag: str = "--out") -> list[Path]:
    """Write ``{name: write(path)}`` into the directory ``out`` as one unit: every file goes to
    a temporary name first, and only when all are written are they renamed into place — an
    error (a target that is a directory, a full disk) leaves none of them, and is the
    project's error naming the path."""
    out = check_out_dir(out, flag, names=list(writers))
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with atomic_files([out / name for name in writers]) as tmps:
            for write, tmp in zip(writers.values(), tmps):
                write(tmp)
    except BaseException as e:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if isinstance(e, OSError):
            raise InputError(f"{flag} {out}: cannot write: {e.strerror or e}",
                             field=flag.lstrip("-")) from None
        raise
    return [out / name for name in writers]


def _atomic_write(path: Path, write) -> None:
    with atomic_file(path) as tmp:
        write(tmp)


def write_json(path: Path, payload: dict) -> None:
    def w(tmp):
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=2, default=_json_default)
    _atomic_write(path, w)


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def _plot_text(text) -> str:
    """``text`` as matplotlib draws it verbatim: ``$`` escaped (not mathtext), code points
    a font cannot take (lone surrogates) as ``\\udXXX`` escapes."""
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8").replace("$", r"\$")


def plot_figure(rows: list[ReportRow], title: str):
    """The figure :func:`write_plot` saves (open; close it with ``plt.close``). Top: mean and
    max |Δ| per configuration (the ablation at a glance; bitwise-equal rows are marked). Bottom
    left: histogram of non-zero |Δ| (log x). Bottom right: mean |Δ| by position. The two bottom
    panels share one legend below them (a row's colour and line style; ``tab20`` colours repeat
    after 20 rows, dashed). Constrained layout in two subfigures: the title, the panels' titles,
    the bar labels and the legend do not overlap, whatever the row count (the figure grows with
    it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    n = len(rows)
    palette = plt.get_cmap("tab20").colors
    colors = [palette[i % len(palette)] for i in range(n)]
    styles = ["-" if i < len(palette) else "--" for i in range(n)]
    top_h = 1.2 + 0.32 * n                    # the bars, one per row
    legend_h = 0.5 + 0.17 * ((n + 1) // 2)    # two columns of legend entries
    fig = plt.figure(figsize=(13, 0.5 + top_h + 4 + legend_h), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[top_h, 4 + legend_h])
    ax0 = top.subplots()
    ax1, ax2 = bottom.subplots(1, 2)

    nz_all = np.concatenate([r.abs_delta[r.abs_delta > 0] for r in rows] + [np.zeros(0)])
    lo = max(nz_all.min() if len(nz_all) else 1e-8, 1e-9)
    hi = max(nz_all.max() if len(nz_all) else 1.0, lo * 10)

    y = np.arange(n)[::-1]
    means = [r.report.summary()["mean_abs"] for r in rows]
    maxes = [r.report.summary()["max_abs"] for r in rows]
    floor = lo / 2  # where a zero gap is drawn on the log axis
    ax0.barh(y, [max(m, floor) for m in maxes], color=colors, alpha=0.35, label="max |Δ|")
    ax0.barh(y, [max(m, floor) for m in means], color=colors, label="mean |Δ|")
    for yi, m in zip(y, maxes):
        if m == 0:
            ax0.text(floor * 1.3, yi, "bitwise equal: every token", va="center", fontsize=8,
                     fontweight="bold")
    ax0.set_yticks(y, [_plot_text(r.name) for r in rows], fontsize=8)
    ax0.set_ylim(-0.6, n - 0.4)
    ax0.set_xscale("log")
    ax0.set_xlim(floor, hi * 2)
    ax0.set_xlabel("|Δ logprob| (bar: mean; pale bar: max)")
    ax0.set_title("trainer − engine gap per configuration")

    bins = np.logspace(np.log10(lo), np.log10(hi), 50)
    handles = []
    for r, c, ls in zip(rows, colors, styles):
        nz = r.abs_delta[r.abs_delta > 0]
        zero = 1 - len(nz) / max(len(r.abs_delta), 1)
        if len(nz):
            ax1.hist(nz, bins=bins, histtype="step", linewidth=1.4, color=c, linestyle=ls)
        curve = r.report.to_dict().get("per_position", {})
        mean = np.asarray(curve.get("mean_abs", []), dtype=float)
        if len(mean):
            ax2.plot(np.arange(len(mean)), mean, linewidth=1.1, color=c, linestyle=ls)
        if len(nz) or len(mean):
            handles.append(Line2D([], [], color=c, linestyle=ls, linewidth=1.4,
                                  label=f"{_plot_text(r.name)} ({zero:.0%} exactly 0)"))
    ax1.set_xscale("log")
    ax1.set_xlabel("|Δ logprob| per token (trainer − engine)")
    ax1.set_ylabel("tokens")
    ax1.set_title("distribution of |Δ| (non-zero tokens)")
    ax2.set_xlabel("response position")
    ax2.set_ylabel("mean |Δ|")
    ax2.set_title("mean |Δ| by position")
    ax2.set_yscale("symlog", linthresh=1e-6)
    if handles:
        bottom.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=7,
                      frameon=False)
    fig.suptitle(_plot_text(title))
    return fig


def write_plot(path: Path, rows: list[ReportRow], title: str) -> None:
    """:func:`plot_figure` as a PNG at ``path`` (written atomically)."""
    import matplotlib.pyplot as plt

    fig = plot_figure(rows, title)

    def w(tmp):
        fig.savefig(tmp, dpi=110, format="png")
    try:
        _atomic_write(path, w)
    finally:
        plt.close(fig)
