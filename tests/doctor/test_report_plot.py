"""gap.png's layout (doctor/report.py ``plot_figure``): with the demo's 27 rows the figure title, the
panels' titles and labels and the legend do not overlap, and every row is drawn."""
from __future__ import annotations

import numpy as np
import pytest

from skyrl_numerics.doctor.report import ReportRow, plot_figure, write_plot
from skyrl_numerics.gap import measure

TITLE = "trainer vs vllm (cpu) 0.32.0 — tiny qwen3_moe, 8×64 tokens"


def synthetic_rows(n: int) -> list[ReportRow]:
    """``n`` rows like the doctor's (long names; some bitwise equal, i.e. all |Δ| zero)."""
    from skyrl_numerics.doctor.rows import ROWS

    rng = np.random.default_rng(0)
    names = [r.name for r in ROWS]
    rows = []
    for i in range(n):
        b, t = 8, 64
        ro = (-np.abs(rng.normal(-2, 1, (b, t))) - 0.5).astype(np.float32)
        scale = 0.0 if i % 6 == 5 else 10 ** rng.uniform(-3, -1)
        tr = np.minimum(ro + (rng.standard_t(3, (b, t)) * scale).astype(np.float32), 0)
        rep = measure(tr.ravel(), ro.ravel(), cu_seqlens=np.arange(0, b * t + 1, t))
        rows.append(ReportRow(names[i % len(names)], rep, np.abs(tr - ro).ravel()))
    return rows


def layout_problems(fig, title: str) -> list[str]:
    """What overlaps in a drawn figure, in words (empty: nothing)."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    axes = fig.get_axes()
    problems = []
    sup = [t for t in fig.texts if t.get_text() == title]
    if len(sup) != 1:
        return [f"{len(sup)} figure titles"]
    sup_bb = sup[0].get_window_extent(r)
    for ax in axes:
        if sup_bb.overlaps(ax.title.get_window_extent(r)):
            problems.append(f"the figure title overlaps the title {ax.get_title()!r}")
        if sup_bb.overlaps(ax.get_tightbbox(r)):
            problems.append(f"the figure title overlaps the panel {ax.get_title()!r}")
    legends = [lg for f in [fig, *fig.subfigs] for lg in f.legends] + \
              [ax.get_legend() for ax in axes if ax.get_legend() is not None]
    for lg in legends:
        lg_bb = lg.get_window_extent(r)
        for ax in axes:
            if lg_bb.overlaps(ax.get_window_extent(r)):   # the plotting area: bars, lines
                problems.append(f"the legend covers the panel {ax.get_title()!r}")
            elif lg_bb.overlaps(ax.get_tightbbox(r)):
                problems.append(f"the legend covers the labels of {ax.get_title()!r}")
        if not fig.bbox.contains(lg_bb.x0, lg_bb.y0) or not fig.bbox.contains(lg_bb.x1, lg_bb.y1):
            problems.append("the legend leaves the figure")
    for ax in axes:
        bb = ax.get_tightbbox(r)
        if bb.x0 < -1 or bb.y0 < -1 or bb.x1 > fig.bbox.x1 + 1 or bb.y1 > fig.bbox.y1 + 1:
            problems.append(f"the panel {ax.get_title()!r} is cut off by the figure's edge")
    return problems


@pytest.mark.parametrize("n", [1, 5, 27])
def test_no_overlaps_and_every_row_drawn(n):
    import matplotlib.pyplot as plt

    rows = synthetic_rows(n)
    fig = plot_figure(rows, TITLE)
    try:
        assert layout_problems(fig, TITLE) == []
        by_title = {ax.get_title(): ax for ax in fig.get_axes()}
        hist, pos = by_title["distribution of |Δ| (non-zero tokens)"], by_title["mean |Δ| by position"]
        nonzero = sum(bool((r.abs_delta > 0).any()) for r in rows)
        assert len(hist.patches) == nonzero          # one step histogram per row with a gap
        assert len(pos.lines) == n                   # one curve per row
        (legend,) = [lg for f in fig.subfigs for lg in f.legends]
        assert len(legend.get_texts()) == n
        # past 20 rows the colours repeat: the line style tells them apart
        keys = {(tuple(h.get_color()), h.get_linestyle()) for h in legend.legend_handles}
        assert len(keys) == n
    finally:
        plt.close(fig)


def test_the_figure_grows_with_the_rows(tmp_path):
    import matplotlib.pyplot as plt

    heights = []
    for n in (3, 27):
        fig = plot_figure(synthetic_rows(n), TITLE)
        heights.append(fig.get_figheight())
        plt.close(fig)
    assert heights[1] > heights[0] + 0.3 * 24
    write_plot(tmp_path / "gap.png", synthetic_rows(27), TITLE)
    write_plot(tmp_path / "empty.png", [], "t")
    assert (tmp_path / "gap.png").read_bytes()[:4] == b"\x89PNG"
    assert not plt.get_fignums()   # write_plot closes its figure
