"""``meshplan plot ...``: timelines, assignment matrices, predicted-vs-measured and scaling plots.

Each command checks ``--out`` (``.png`` or ``.svg``) first, renders in memory, writes the file atomically and
prints its path; matplotlib and the planner are imported inside the commands, so ``--help`` stays fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from meshplan.cli import options as o

plot_app = typer.Typer(no_args_is_help=True, help="Plot timelines, assignment matrices, predicted vs measured, "
                                                  "scaling (PNG or SVG by the --out suffix).")

Out = Annotated[str, typer.Option("--out", help="image to write: *.png or *.svg")]


def _written(path) -> None:
    sys.stdout.write(f"{path}\n")


@plot_app.command("timeline")
def timeline(schedule: Annotated[str, typer.Argument(help="a schedule file (.json or .json.gz)")],
             measurement: Annotated[Optional[str], typer.Argument(help="its Measurement JSON (run --out)")] = None,
             out: Out = ..., topo: o.Topo = None,
             ranks: Annotated[Optional[str], typer.Option("--ranks", help="ranks shown: 0-7 or 0,2,4-5 "
                                                                         "(default: the first 16)")] = None) -> None:
    """Gantt chart per rank and stream, coloured by op kind; beside it the measurement, if given."""
    from meshplan.show.plot import check_out, save, timeline_figure
    from meshplan.show.plot_data import timeline_data
    check_out(out)
    _written(save(timeline_figure(timeline_data(schedule, measurement, topo, ranks)), out))


@plot_app.command("matrix")
def matrix(schedule: Annotated[Optional[str], typer.Argument(help="a schedule file (or use --algo)")] = None,
           out: Out = ..., algo: Annotated[Optional[str], typer.Option("--algo", help="algorithm name")] = None,
           gpus: o.Gpus = None, topo: o.Topo = None, model: o.Model = None, seq_len: o.SeqLen = None,
           batch: o.Batch = None, heads: o.Heads = None, kv_heads: o.KvHeads = None, head_dim: o.HeadDim = None,
           dtype: o.Dtype = None, mask: o.MaskOpt = None, layout: o.Layout = None, passes: o.Pass = None,
           valid_len: o.ValidLen = None, prefix_len: o.PrefixLen = None,
             doc_layout: o.DocLayout = None, tile: o.Tile = None, mapping: o.Mapping = None,
           ulysses_degree: o.UlyssesDegree = None, inner_ring: o.InnerRing = None, team_size: o.TeamSize = None,
           domains: o.Domains = None, knob: o.KnobKV = None) -> None:
    """The Q-chunk x KV-chunk grid coloured by the rank computing each block (grey: skipped by the mask)."""
    from meshplan.core.errors import UserError
    from meshplan.show.plot import check_out, matrix_figure, save
    from meshplan.show.plot_data import assignment_grid, heads_split

    check_out(out)
    if (schedule is None) == (algo is None):
        raise UserError("SCHEDULE", "give a schedule file or --algo NAME, not both and not neither",
                        "e.g. meshplan plot matrix s.json --out m.png")
    if schedule is not None:
        from meshplan.plan.json.io import read_schedule
        sched, where = read_schedule(schedule), Path(schedule).name
    else:
        from meshplan.search.candidate import predict
        wl = o.workload(model, seq_len, batch, heads, kv_heads, head_dim, dtype, mask, layout, passes, valid_len,
                    prefix_len, doc_layout)
        kn = o.knobs(tile, mapping, None, None, ulysses_degree, inner_ring, team_size, domains, knob)
        topo_obj = o.topology(topo, gpus, "plot matrix")
        sched = predict(algo, wl, topo_obj, gpus or topo_obj.n_devices, kn).schedule
        where = f"{topo_obj.name} x {sched.n_ranks}"
    knobs = ", ".join(f"{k}={v}" for k, v in sched.knobs.items() if k in ("tile", "ulysses_degree", "inner_ring",
                                                                            "team_size", "domains") and v is not None)
    title = f"{sched.algorithm}{f' ({knobs})' if knobs else ''}, {sched.n_ranks} ranks ({where})\n" \
            f"{sched.workload.describe()}" + ("; owners of head 0 (heads are split)" if heads_split(sched) else "")
    _written(save(matrix_figure(assignment_grid(sched), sched.n_ranks, sched.knobs, title), out))


@plot_app.command("scatter")
def scatter(pairs: Annotated[str, typer.Argument(help="JSON rows {label, algorithm, predicted_s, measured_s} "
                                                      "(or a CSV with those columns)")],
            out: Out = ...,
            title: Annotated[str, typer.Option("--title", help="title before the MAPE")] = "predicted vs measured"
            ) -> None:
    """Predicted against measured, log-log, with y = x, a ±10 % band and the MAPE."""
    from meshplan.show.plot import check_out, save, scatter_figure
    from meshplan.show.plot_data import read_pairs
    check_out(out)
    _written(save(scatter_figure(read_pairs(pairs), title), out))


@plot_app.command("scaling")
def scaling(out: Out = ..., topo: o.Topo = None,
            gpus: Annotated[str, typer.Option("--gpus", help="GPU counts, comma-separated (8,16,32)")] = "8",
            algos: Annotated[str, typer.Option("--algos", help="algorithms, comma-separated")] = "ring,usp,mesh",
            model: o.Model = None, seq_len: o.SeqLen = None, batch: o.Batch = None, heads: o.Heads = None,
            kv_heads: o.KvHeads = None, head_dim: o.HeadDim = None, dtype: o.Dtype = None, mask: o.MaskOpt = None,
            layout: o.Layout = None, passes: o.Pass = None, valid_len: o.ValidLen = None,
            prefix_len: o.PrefixLen = None, doc_layout: o.DocLayout = None) -> None:
    """Predicted time and bytes received per GPU against the GPU count, per algorithm (default knobs)."""
    from meshplan.core.errors import UserError
    from meshplan.show.plot import check_out, save, scaling_figure
    from meshplan.show.plot_data import parse_list, scaling_data

    check_out(out)
    if topo is None:
        raise UserError("--topo", "plot scaling needs a topology", "give --topo NAME_OR_FILE (e.g. --topo h100x32)")
    counts = []
    for item in parse_list(gpus, "--gpus"):
        if not item.isdigit() or int(item) < 1:
            raise UserError("--gpus", f"cannot read {item!r} as a GPU count", "write e.g. --gpus 8,16,32")
        counts.append(int(item))
    wl = o.workload(model, seq_len, batch, heads, kv_heads, head_dim, dtype, mask, layout, passes, valid_len,
                    prefix_len, doc_layout)
    data = scaling_data(topo, sorted(set(counts)), parse_list(algos, "--algos"), wl)
    for line in data.skipped:
        sys.stderr.write(f"skipped: {line}\n")
    _written(save(scaling_figure(data, f"{topo}: {wl.describe()}"), out))
