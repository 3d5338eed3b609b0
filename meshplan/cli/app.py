"""The ``meshplan`` command line (docs/formats.md, CLI contract).

Human tables on stdout by default, JSON on stdout with ``--json``; progress, logs and warnings on stderr.
Bad input: one line on stderr naming the field and the fix, exit status 2, nothing written.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from meshplan.show.console import out_console

try:  # typer >= 0.20 vendors click; older typer uses the click package
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover
    import click.exceptions as _cx

from meshplan.cli import options as o
from meshplan.cli import search_flags as sf
from meshplan.cli import sensitivity as sv


class _Group(TyperGroup):
    """Runs a command; user errors become one line on stderr and exit status 2 (no traceback, no panel)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        from meshplan.core.errors import UserError
        try:
            rv = super().main(args=args, prog_name=prog_name or "meshplan", complete_var=complete_var,
                              standalone_mode=False, **extra)
        except UserError as err:
            return self._fail(f"error: {err}", 2)
        except _cx.UsageError as err:
            if not err.format_message().strip():  # no arguments: the help was printed
                return self._fail("", 0)
            path = err.ctx.command_path if err.ctx else "meshplan"
            return self._fail(f"error: {err.format_message()} (see {path} --help)", 2)
        except typer.Abort:
            return self._fail("aborted", 130)
        except _cx.ClickException as err:
            return self._fail(f"error: {err.format_message()}", 2)
        code = rv if isinstance(rv, int) else 0
        if code == 130:                           # Ctrl-C: typer returns 130 without a word
            return self._fail("aborted", 130)
        if standalone_mode:
            sys.exit(code)
        return code

    @staticmethod
    def _fail(message: str, code: int):
        if message:
            sys.stderr.write(" ".join(message.split()) + "\n")
        sys.exit(code)


def _flag_type_hidden() -> None:
    """Help shows no ``<bool>`` beside an on/off flag (typer labels every option with its type)."""
    import typer.core as tc
    show = getattr(tc.TyperOption, "display_type_rich", None)
    if show is None or getattr(show, "_meshplan", False):
        return

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) else show(self, ctx)
    display_type_rich._meshplan = True
    tc.TyperOption.display_type_rich = display_type_rich


_flag_type_hidden()
app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan, simulate and run distributed attention for long-context LLMs.")
topo_app = typer.Typer(no_args_is_help=True, help="Inspect topologies.")
app.add_typer(topo_app, name="topo")
from meshplan.cli.plot import plot_app  # noqa: E402  (typer only; matplotlib loads inside the commands)

app.add_typer(plot_app, name="plot")


def _err_console():
    from rich.console import Console
    return Console(stderr=True)


def _emit(body, as_json: bool, human) -> None:
    if as_json:
        sys.stdout.write(json.dumps(body, indent=1) + "\n")
    else:
        human(out_console())


@app.command()
def search(gpus: o.GpusNeeded = None, topo: o.TopoNeeded = None, model: o.Model = None, seq_len: o.SeqLen = None,
           batch: o.Batch = None, heads: o.Heads = None, kv_heads: o.KvHeads = None, head_dim: o.HeadDim = None,
           dtype: o.Dtype = None, mask: o.MaskOpt = None, layout: o.Layout = None, passes: o.Pass = None,
           valid_len: o.ValidLen = None, prefix_len: o.PrefixLen = None,
           doc_layout: o.DocLayout = None, tile: o.Tile = None, mapping: o.Mapping = None,
           partial_dtype: o.PartialDtype = None, dkv_dtype: o.DkvDtype = None, ulysses_degree: o.UlyssesDegree = None,
           inner_ring: o.InnerRing = None, team_size: o.TeamSize = None, domains: o.Domains = None,
           knob: o.KnobKV = None,
           algos: sf.Algos = None, top: sf.Top = 10, wide: sf.Wide = False, write: sf.Write = 1,
           out: sf.Out = "schedules", scheduler: sf.Scheduler = "greedy", ilp_time_limit_s: sf.IlpTimeLimit = 10.0,
           ilp_workers: sf.IlpWorkers = 0, map_search: sf.MapSearch = 0, memory_limit: sf.MemoryLimit = None,
           prune_slack: sf.PruneSlack = 0.01,
           tp: o.Tp = 1, dp: o.Dp = 1, rank_order: o.RankOrder = "tp-cp-dp",
           sensitivity: sv.Sensitivity = None, sensitivity_samples: sv.Samples = None, sensitivity_top: sv.Top = None,
           sensitivity_seed: sv.Seed = None, pick: sv.Pick = "nominal",
           doc_lengths: o.DocLengths = None, batches: o.Batches = None, as_json: o.Json = False) -> None:
    """Rank every algorithm, layout and knob setting for a workload on a cluster; write the best schedules.

    With --tp/--dp, --gpus is the CP group size and the best plans are re-ranked by the whole job's time.
    With --doc-lengths, rank fixed methods against per-batch planning over packs drawn from a histogram."""
    from meshplan.search.pipeline import JobRerank, SearchRequest, Sensitivity, no_candidate_error, run_pipeline
    from meshplan.search.sensitivity import check_args
    from meshplan.show.search_table import print_search

    sf.check_search_flags(gpus, scheduler, ilp_time_limit_s, ilp_workers, write, top, map_search, prune_slack, out)
    if doc_lengths is not None or batches is not None:
        from meshplan.cli.batch import distribution_command
        distribution_command(gpus, topo, doc_lengths, batches, seq_len, model, batch, heads, kv_heads, head_dim,
                             dtype, passes, {"--mask": mask, "--layout": layout, "--valid-len": valid_len,
                                             "--prefix-len": prefix_len, "--algos": algos,
                                             "--sensitivity": sensitivity}, o.is_job(tp, dp, rank_order), as_json,
                             _emit)
        return
    sensitivity_samples, sensitivity_top, sensitivity_seed = check_args(
        sensitivity, sensitivity_samples, sensitivity_top, sensitivity_seed, pick, job=o.is_job(tp, dp, rank_order))
    topology = o.topology(topo, gpus, "search")
    base = o.workload(model, seq_len, batch, heads, kv_heads, head_dim, dtype, mask, layout, passes, valid_len,
                    prefix_len, doc_layout)
    job = None
    if o.is_job(tp, dp, rank_order):
        from meshplan.cli.job import job_setup
        shape, base, job_topo = job_setup(gpus, topo, base, tp, dp, rank_order, scheduler, map_search)
        job = JobRerank(shape, job_topo)
    names = tuple(a.strip() for a in algos.split(",")) if algos else None
    request = SearchRequest(
        base, topology, gpus, algos=names,
        filters=o.knobs(tile, mapping, partial_dtype, dkv_dtype, ulysses_degree, inner_ring, team_size, domains, knob),
        layout_pinned=layout is not None, memory_limit_bytes=sf.memory_limit_bytes(memory_limit),
        prune_slack=prune_slack, write=write, out_dir=out, top=top, map_search=map_search, scheduler=scheduler,
        ilp_time_limit_s=ilp_time_limit_s, ilp_workers=ilp_workers, job=job,
        sensitivity=None if sensitivity is None else Sensitivity(sensitivity, sensitivity_samples, sensitivity_top,
                                                                 sensitivity_seed, pick))
    with _progress() as bar:
        task = bar.add_task("simulating", total=None)
        report = run_pipeline(request, lambda k, n, label: bar.update(task, total=n, completed=k, description=label))
    if not report.result.candidates:
        raise no_candidate_error(report.result, names)
    body = report.json()
    _emit(body, as_json, lambda c: (print_search(body, c, top, wide), sv.print_sensitivity(body, c)))


def _progress():
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=_err_console(),
                    transient=True, disable=not sys.stderr.isatty())


@app.command()
def simulate(schedule: Annotated[Optional[str], typer.Argument(help="a schedule file (or use --algo)")] = None,
             algo: Annotated[Optional[str], typer.Option("--algo", help="algorithm name")] = None,
             gpus: o.GpusToPlan = None, topo: o.TopoToPlan = None, model: o.Model = None, seq_len: o.SeqLen = None,
             batch: o.Batch = None, heads: o.Heads = None, kv_heads: o.KvHeads = None, head_dim: o.HeadDim = None,
             dtype: o.Dtype = None, mask: o.MaskOpt = None, layout: o.Layout = None, passes: o.Pass = None,
             valid_len: o.ValidLen = None, prefix_len: o.PrefixLen = None,
             doc_layout: o.DocLayout = None, tile: o.Tile = None, mapping: o.Mapping = None,
             partial_dtype: o.PartialDtype = None, dkv_dtype: o.DkvDtype = None,
             ulysses_degree: o.UlyssesDegree = None, inner_ring: o.InnerRing = None, team_size: o.TeamSize = None,
             domains: o.Domains = None, knob: o.KnobKV = None,
             tp: o.Tp = 1, dp: o.Dp = 1, rank_order: o.RankOrder = "tp-cp-dp",
             out: Annotated[Optional[str], typer.Option("--out", help="write the schedule (.json or .json.gz)")] = None,
             trace: Annotated[Optional[str], typer.Option("--trace", help="write a Chrome/Perfetto trace")] = None,
             as_json: o.Json = False) -> None:
    """Predict one algorithm's time on a cluster (by name), or a schedule file's.

    With --tp/--dp, --gpus is the CP group size and every CP group of the job is simulated at once."""
    from meshplan.cli.simulate import simulate_file, simulate_named
    from meshplan.core.errors import UserError
    if schedule is not None:
        if o.is_job(tp, dp, rank_order):
            raise UserError("--tp", "--tp, --dp and --rank-order plan a job with --algo, not a schedule file",
                            "drop them, or give --algo NAME")
        planning = {"--algo": algo, "--gpus": gpus, "--model": model, "--seq-len": seq_len, "--batch": batch,
                    "--heads": heads, "--kv-heads": kv_heads, "--head-dim": head_dim, "--dtype": dtype, "--mask": mask,
                    "--layout": layout, "--pass": passes, "--valid-len": valid_len, "--prefix-len": prefix_len,
                    "--doc-layout": doc_layout, "--tile": tile, "--mapping": mapping, "--partial-dtype": partial_dtype,
                    "--dkv-dtype": dkv_dtype, "--ulysses-degree": ulysses_degree, "--inner-ring": inner_ring,
                    "--team-size": team_size, "--domains": domains, "--knob": knob or None, "--out": out}
        given = next((flag for flag, value in planning.items() if value is not None), None)
        if given is not None:
            raise UserError(given, f"{given} plans a schedule by name, and {schedule} carries its own plan",
                            f"drop {given} to simulate the file (with --topo to take another cluster), or drop the "
                            "file to plan one with --algo")
        simulate_file(schedule, topo, trace, as_json, _emit)
        return
    wl = o.workload(model, seq_len, batch, heads, kv_heads, head_dim, dtype, mask, layout, passes, valid_len,
                    prefix_len, doc_layout)
    kn = o.knobs(tile, mapping, partial_dtype, dkv_dtype, ulysses_degree, inner_ring, team_size, domains, knob)
    if o.is_job(tp, dp, rank_order):
        from meshplan.cli.job import simulate_job
        simulate_job(algo, gpus, topo, wl, kn, tp, dp, rank_order, out, trace, as_json, _emit)
        return
    simulate_named(algo, gpus, topo, wl, kn, out, trace, as_json, _emit)


@app.command("plan-batch")
def plan_batch(cu_seqlens: Annotated[str, typer.Option("--cu-seqlens", help="the batch's document boundaries "
                                                       "0,E1,E2,...,S (FlashAttention's cu_seqlens)")],
               gpus: o.GpusNeeded = None, topo: o.TopoNeeded = None, model: o.Model = None, batch: o.Batch = None,
               heads: o.Heads = None, kv_heads: o.KvHeads = None, head_dim: o.HeadDim = None, dtype: o.Dtype = None,
               passes: o.Pass = None,
               no_cache: Annotated[bool, typer.Option("--no-cache", help="plan afresh (no cached plan)")] = False,
               simulate: Annotated[bool, typer.Option("--simulate", help="predict the plan with the simulator "
                                                      "(seconds at 64+ ranks), not the contended closed form")]
               = False,
               out: Annotated[Optional[str], typer.Option("--out", help="write the doc-place schedule (.json)")]
               = None, as_json: o.Json = False,
               seq_len: Annotated[Optional[str], typer.Option("--seq-len", hidden=True)] = None,
               mask: Annotated[Optional[str], typer.Option("--mask", hidden=True)] = None,
               layout: Annotated[Optional[str], typer.Option("--layout", hidden=True)] = None) -> None:
    """Plan one packed batch from its document boundaries: the doc-place plan and its predicted time.

    The same for per-document zigzag Ring and the best fixed method, beside it."""
    from meshplan.cli.batch import plan_batch_command
    plan_batch_command(gpus, topo, cu_seqlens, model, batch, heads, kv_heads, head_dim, dtype, passes, no_cache,
                       simulate, out, as_json, _emit, {"--seq-len": seq_len, "--mask": mask, "--layout": layout})


@app.command()
def run(schedule: Annotated[str, typer.Argument(help="a schedule file (.json or .json.gz)")],
        nproc: o.Nproc = None, backend: o.Backend = "auto", iters: o.Iters = 5, warmup: o.Warmup = 2,
        check: o.Check = None, serialize: o.Serialize = False, timeout_s: o.TimeoutS = 120.0,
        out: Annotated[Optional[str], typer.Option("--out", help="write the Measurement JSON")] = None,
        trace: Annotated[Optional[str], typer.Option("--trace", help="write a Chrome/Perfetto trace")] = None,
        dump: o.Dump = None, seed: o.Seed = 0, inputs: o.Inputs = None, as_json: o.Json = False) -> None:
    """Run a schedule on torch.distributed, check its numerics, measure every op."""
    from meshplan.cli.run import run_command
    raise typer.Exit(run_command(schedule, nproc, backend, iters, warmup, check, serialize, timeout_s, out, trace,
                                 dump, seed, inputs, as_json))


@app.command()
def compare(schedule: Annotated[str, typer.Argument(help="the schedule that was run")],
            measurement: Annotated[str, typer.Argument(help="its Measurement JSON (run --out)")],
            topo: o.Topo = None,
            trace: Annotated[Optional[str], typer.Option("--trace", help="write both timelines as one Chrome trace")]
            = None, as_json: o.Json = False) -> None:
    """Predicted against measured: per op kind, per step, end to end, peak memory.

    Exit 1 when the measurement implies more than the hardware can do."""
    from meshplan.cli.run import compare_command
    raise typer.Exit(compare_command(schedule, measurement, topo, as_json, trace))


@app.command()
def validate(schedule: Annotated[str, typer.Argument(help="a schedule file")],
             topo: o.Topo = None, as_json: o.Json = False) -> None:
    """The verifier: exit 0 valid, 1 invalid (violations listed), 2 unreadable or another schema version."""
    from meshplan.cli.simulate import validate_file
    raise typer.Exit(validate_file(schedule, topo, as_json))


@app.command()
def schema(as_json: Annotated[bool, typer.Option("--json", help="accepted for symmetry: the schema is JSON")]
           = False) -> None:
    """Print the JSON Schema of the Schedule file."""
    from meshplan.plan.json.io import schema as schedule_schema
    sys.stdout.write(json.dumps(schedule_schema(), indent=1) + "\n")


@topo_app.command("show")
def topo_show(topo: Annotated[str, typer.Argument(help="topology file or shipped name")],
              gpus: o.Gpus = None, as_json: o.Json = False) -> None:
    """Show a topology: devices, link classes with capacities and latencies, example routes."""
    from meshplan.cli.simulate import topology_info
    from meshplan.show.tables import print_topology
    info = topology_info(topo, gpus)
    _emit(info, as_json, lambda c: print_topology(info, c))


@topo_app.command("list")
def topo_list(as_json: o.Json = False) -> None:
    """List the shipped topologies (--json: a JSON list of their names)."""
    from meshplan.model.topo_files import shipped_topologies
    names = list(shipped_topologies())
    sys.stdout.write((json.dumps(names, indent=1) if as_json else "\n".join(names)) + "\n")


from meshplan.cli.topo import topo_import  # noqa: E402  (typer only; the import itself loads inside)

topo_app.command("import")(topo_import)


@app.command()
def reproduce(table: Annotated[str, typer.Argument(help="charm-h100, charm-ablation or charm-memory")],
              data: Annotated[Optional[str], typer.Option("--data", help="a CSV with the same columns")] = None,
              fit: Annotated[bool, typer.Option("--fit", help="fit the parameters afresh (else: the shipped ones)")]
              = False, as_json: o.Json = False) -> None:
    """Predict a published table (CHARM+ paper) and print predicted, measured and the error per row."""
    from meshplan.cli.reproduce import reproduce_command
    reproduce_command(table, data, fit, as_json, _emit)


@app.command()
def calibrate(topo: Annotated[str, typer.Option("--topo", help="the topology to calibrate")] = "cpu-local",
              backend: o.Backend = "auto",
              quick: Annotated[bool, typer.Option("--quick", help="a small sweep: a few seconds")] = False,
              out: Annotated[str, typer.Option("--out", help="the calibration YAML to write")] = ...,
              from_nccl_tests: Annotated[Optional[list[str]], typer.Option(
                  "--from-nccl-tests", help="fit the link classes from nccl-tests output instead of measuring (no "
                  "torch): FILE or CLASS:FILE (CLASS intra, nvlink or net), comma-separated or repeated")] = None,
              memory_only: Annotated[bool, typer.Option(
                  "--memory-only", help="measure only the memory model and update it in --out (an existing "
                  "calibration file), keeping the rest")] = False,
              refit: Annotated[bool, typer.Option(
                  "--refit", help="measure nothing: fit every parameter again from --out's own raw measurements "
                  "(after meshplan's fits changed) and rewrite it")] = False,
              repeat: Annotated[int, typer.Option(
                  "--repeat", help="measure N times and merge (a timing's median over the runs; samples pooled): "
                  "one run's slow spell on a shared host moves nothing")] = 1,
              as_json: o.Json = False) -> None:
    """Measure this host's kernels, transfers, overlap and core sharing; write a calibration file.

    With --from-nccl-tests, fit the link classes from nccl-tests output instead."""
    from meshplan.cli import calibrate as cli_calibrate
    from meshplan.core.errors import UserError
    given = [flag for flag, on in (("--from-nccl-tests", bool(from_nccl_tests)), ("--memory-only", memory_only),
                                   ("--refit", refit)) if on]
    if len(given) > 1:
        raise UserError(given[1], f"cannot be combined with {given[0]}", "run them as two calls")
    if given and repeat != 1:
        raise UserError("--repeat", f"applies to a full calibration, not to {given[0]}", "drop --repeat")
    if refit:
        raise typer.Exit(cli_calibrate.calibrate_refit(topo, out, as_json))
    if from_nccl_tests:
        raise typer.Exit(cli_calibrate.calibrate_from_nccl_tests(topo, from_nccl_tests, out, as_json))
    if memory_only:
        raise typer.Exit(cli_calibrate.calibrate_memory_only(topo, backend, quick, out, as_json))
    raise typer.Exit(cli_calibrate.calibrate_command(topo, backend, quick, out, as_json, repeat))


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``meshplan`` console script."""
    from meshplan.core.heap import keep_freed_memory

    keep_freed_memory()                 # numpy temporaries reuse the heap's pages (meshplan.core.heap)
    typer.main.get_command(app).main(args=argv, prog_name="meshplan")


if __name__ == "__main__":
    main()
