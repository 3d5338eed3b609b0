"""Plots (``meshplan plot``): Gantt timelines, assignment matrices, predicted-vs-measured, scaling curves.

The data come from :mod:`meshplan.show.plot_data`; this module only draws. matplotlib is imported inside the
functions and drives a bare :class:`matplotlib.figure.Figure` on the Agg canvas (no pyplot, no global state);
a figure is rendered in memory and written atomically as PNG or SVG, chosen by the file's suffix.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from meshplan.core.errors import UserError
from meshplan.show.plot_data import SHARED, Panel, ScalingData, ScatterRow, TimelineData, mape_pct, tile_shape

FORMATS = {".png": "png", ".svg": "svg"}
KIND_COLOURS = {"compute": "#4c72b0", "send": "#dd8452", "recv": "#55a868", "merge": "#c44e52",
                "accumulate": "#8172b3", "collective": "#937860"}


def check_out(path: str) -> str:
    """The format of ``--out`` (``png`` or ``svg``). Raises UserError for another suffix."""
    fmt = FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        raise UserError("--out", f"{path!r} is not a .png or .svg name", "name the file *.png or *.svg")
    return fmt


def _figure(width_in: float, height_in: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width_in, height_in), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig, path: str) -> Path:
    """Render ``fig`` in memory and write it atomically (PNG at 150 dpi, or SVG)."""
    from meshplan.core.fileio import write_atomic
    buf = io.BytesIO()
    fig.savefig(buf, format=check_out(path), dpi=150)
    return write_atomic(path, buf.getvalue())


# ---------------------------------------------------------------------------------------------------- timeline
def timeline_figure(data: TimelineData):
    """One Gantt chart per panel (predicted, measured) side by side, same x scale, rows (rank, stream)."""
    n_rows = len(data.rows)
    fig = _figure(7.0 * len(data.panels), min(2.0 + 0.28 * n_rows, 40.0))
    axes = fig.subplots(1, len(data.panels), sharex=True, sharey=True, squeeze=False)[0]
    for ax, panel in zip(axes, data.panels):
        _gantt(ax, panel)
        ax.set_xlabel("time (ms)")
    axes[0].set_yticks(range(n_rows), [f"rank {r} · {s}" for r, s in data.rows], fontsize=7)
    axes[0].set_ylim(n_rows - 0.5, -0.5)
    axes[0].set_ylabel("rank · stream")
    kinds = sorted({int(k) for p in data.panels for k in np.unique(p.kind)})
    handles = [_patch(_kind_colour(k), _kind_name(k)) for k in kinds]
    fig.legend(handles=handles, loc="outside lower center", ncols=max(len(handles), 1), fontsize=8)
    fig.suptitle(data.title, fontsize=10)
    return fig


def _gantt(ax, panel: Panel) -> None:
    """Bars: compute-like ops fill the row; sends take its upper half and recvs its lower half."""
    from meshplan.plan.schedule import OP_KINDS
    offset = {OP_KINDS.index("send"): -0.2, OP_KINDS.index("recv"): 0.2}
    for k in np.unique(panel.kind).tolist():
        sel = panel.kind == k
        dy, h = offset.get(k, 0.0), 0.4 if k in offset else 0.8
        ax.barh(panel.row[sel] + dy, (panel.end_s - panel.start_s)[sel] * 1e3, left=panel.start_s[sel] * 1e3,
                height=h, color=_kind_colour(k), edgecolor="none")
    for t in panel.pass_start_s:
        ax.axvline(t * 1e3, color="grey", linestyle="--", linewidth=0.8)
    ax.set_title(f"{panel.label}: makespan {panel.makespan_s * 1e3:.4g} ms", fontsize=10)
    ax.grid(axis="x", linewidth=0.3)


def _kind_name(k: int) -> str:
    from meshplan.plan.schedule import OP_KINDS
    return OP_KINDS[k]


def _kind_colour(k: int) -> str:
    return KIND_COLOURS.get(_kind_name(k), "#999999")


def _patch(colour: str, label: str):
    from matplotlib.patches import Patch
    return Patch(facecolor=colour, label=label)


# ---------------------------------------------------------------------------------------------------- matrix
def matrix_figure(owner: np.ndarray, n_ranks: int, knobs: dict, title: str):
    """The Nq x Nkv grid coloured by computing rank; masked blocks grey; the tile grid when a tile is known."""
    import matplotlib
    from matplotlib.colors import BoundaryNorm, ListedColormap
    n = owner.shape[0]
    side = min(max(5.0, 3.0 + 0.25 * n), 14.0)
    fig = _figure(side + 2.0, side)
    ax = fig.subplots()
    base = matplotlib.colormaps["tab20" if n_ranks <= 20 else "turbo"]
    colours = base(np.arange(n_ranks) % 20) if n_ranks <= 20 else base(np.linspace(0, 1, n_ranks))
    cmap = ListedColormap(colours).with_extremes(bad="#e6e6e6")   # bad: blocks the mask skips
    norm = BoundaryNorm(np.arange(n_ranks + 1) - 0.5, n_ranks)
    image = ax.imshow(np.ma.masked_less(owner, 0), cmap=cmap, norm=norm, interpolation="nearest", aspect="equal")
    if (owner == SHARED).any():
        ax.imshow(np.ma.masked_not_equal(owner, SHARED), cmap=ListedColormap(["black"]), interpolation="nearest")
    if n <= 32:
        for (i, j), r in np.ndenumerate(owner):
            if r >= 0:
                light = colours[r, :3] @ [0.299, 0.587, 0.114] > 0.6
                ax.text(j, i, str(r), ha="center", va="center", fontsize=6 if n > 16 else 8,
                        color="black" if light else "white")
    _grid_lines(ax, n, tile_shape(knobs))
    keys = [_patch("#e6e6e6", "skipped by the mask")] + \
        ([_patch("black", "several ranks (conflict)")] if (owner == SHARED).any() else [])
    fig.legend(handles=keys, loc="outside lower center", ncols=len(keys), fontsize=8)
    ticks = np.arange(n_ranks) if n_ranks <= 32 else np.linspace(0, n_ranks - 1, 9).round().astype(int)
    bar = fig.colorbar(image, ax=ax, ticks=ticks, shrink=0.8)
    bar.set_label("rank computing the block")
    from matplotlib.ticker import MaxNLocator
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("KV chunk")
    ax.set_ylabel("Q chunk")
    ax.set_title(title, fontsize=9)
    return fig


def _grid_lines(ax, n: int, tile: tuple[int, int] | None) -> None:
    """Thin lines between blocks; with a tile a x b, thick lines every a Q chunks (one tile row) and every a
    KV chunks (each such band holds one KV chunk of every tile of the row)."""
    edges = np.arange(n + 1) - 0.5
    if n <= 64:
        ax.hlines(edges, -0.5, n - 0.5, color="white", linewidth=0.5)
        ax.vlines(edges, -0.5, n - 0.5, color="white", linewidth=0.5)
    if tile is not None and n % tile[0] == 0:
        major = edges[:: tile[0]]
        ax.hlines(major, -0.5, n - 0.5, color="black", linewidth=1.5)
        ax.vlines(major, -0.5, n - 0.5, color="black", linewidth=0.8, linestyle="--")


# ---------------------------------------------------------------------------------------------------- scatter
def scatter_figure(rows: list[ScatterRow], title: str = "predicted vs measured"):
    """Log-log scatter with y = x and a ±10 % band; colour per algorithm, labels beside the points."""
    fig = _figure(6.5, 6.0)
    ax = fig.subplots()
    p = np.array([r.predicted_s for r in rows]) * 1e3
    m = np.array([r.measured_s for r in rows]) * 1e3
    lo, hi = min(p.min(), m.min()) / 1.5, max(p.max(), m.max()) * 1.5
    x = np.geomspace(lo, hi, 50)
    ax.fill_between(x, x * 0.9, x * 1.1, color="grey", alpha=0.2, label="±10 %")
    ax.plot(x, x, color="black", linewidth=0.8, label="predicted = measured")
    for algo in sorted({r.algorithm for r in rows}):
        sel = np.array([r.algorithm == algo for r in rows])
        ax.scatter(m[sel], p[sel], label=algo, s=25, zorder=3)
    if len(rows) <= 30:
        for r, xm, yp in zip(rows, m, p):
            ax.annotate(r.label, (xm, yp), xytext=(3, 3), textcoords="offset points", fontsize=6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured time (ms)")
    ax.set_ylabel("predicted time (ms)")
    ax.set_title(f"{title}: MAPE {mape_pct(rows):.1f} % over {len(rows)} point(s)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(which="both", linewidth=0.3)
    return fig


# ---------------------------------------------------------------------------------------------------- scaling
def scaling_figure(data: ScalingData, title: str):
    """Predicted time (ms) and bytes received per GPU (MB) against the GPU count, log2 x axis."""
    fig = _figure(11.0, 4.8)
    ax_t, ax_b = fig.subplots(1, 2, sharex=True)
    for algo in data.gpus:
        g = data.gpus[algo]
        ax_t.plot(g, np.array(data.makespan_s[algo]) * 1e3, marker="o", label=algo)
        ax_b.plot(g, np.array(data.recv_bytes[algo]) / 1e6, marker="o", label=algo)
    counts = sorted({n for g in data.gpus.values() for n in g})
    for ax, label in ((ax_t, "predicted time (ms)"), (ax_b, "bytes received per GPU, max (MB)")):
        ax.set_xscale("log", base=2)
        if counts:
            ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.grid(which="both", linewidth=0.3)
    ax_t.set_yscale("log")
    for algo, at in data.skipped_at.items():   # a legend entry without a line for what could not run
        ax_t.plot([], [], " ", label=f"{algo}: skipped at {', '.join(map(str, at))} GPUs")
    if data.gpus or data.skipped_at:
        ax_t.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return fig
