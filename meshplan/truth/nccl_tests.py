"""Reading nccl-tests output (NVIDIA/nccl-tests ``sendrecv_perf``, ``alltoall_perf``, ``all_gather_perf``) and
fitting alpha and bandwidth from it. No torch here.

The format (nccl-tests ``src/common.cu``, 2.x): ``#`` lines first — ``# Collective test starting: NAME_perf``
(2.13 on), one ``#  Rank R Group G Pid P on HOST device D [BUS] GPU NAME`` line per rank — then the column header
``#  size  count  type  redop  root  time  algbw  busbw  #wrong  time  algbw  busbw  #wrong`` (out-of-place, then
in-place; older versions lack redop and root, which their header says), a units line, a row per size and
``# Avg bus bandwidth : X`` after the last row. Times in microseconds, bandwidths in GB/s (1e9 B/s). Lines that
are not rows (launcher or ``NCCL INFO`` noise) are skipped; the out-of-place time is fitted.

Bytes each rank moves over its bottleneck link, per nccl-tests' bus-bandwidth definitions (``doc/PERFORMANCE.md``:
``algbw = S / t``, ``busbw = algbw · factor``, ``S`` the row's size):

=============  ===========  =========================================================================
collective     factor       S, and what a rank moves
=============  ===========  =========================================================================
sendrecv       1            S sent to rank + 1 and S received from rank − 1
all_gather     (n − 1)/n    S the gathered size: a rank receives (in NCCL's ring, forwards) S (n − 1)/n
alltoall       (n − 1)/n    S a rank's send buffer: S/n to each of the n − 1 others
=============  ===========  =========================================================================

so the fit is ``t(S) = alpha + factor · S / busbw`` (:func:`meshplan.truth.fit.fit_alpha_beta`): the bandwidth from
the rows of ≥ 64 MiB on the wire (≥ 1 MiB when fewer than two are), alpha from those of ≤ 64 KiB
(docs/cost-model.md, Calibration). busbw is the rate of a GPU's port inside a node; between nodes
:func:`cross_node_rate` says what it measures.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshplan.core.errors import UserError
from meshplan.truth import fit

SUPPORTED = ("sendrecv", "all_gather", "alltoall")
EXPECTED = "expected the output of nccl-tests' sendrecv_perf, alltoall_perf or all_gather_perf"
BW_MIN_BYTES = 64 * 2**20           # docs/cost-model.md: bandwidth from messages >= 64 MB
_TESTS = re.compile(r"all_reduce|all_gather|reduce_scatter|alltoallv|alltoall|sendrecv|broadcast|reduce|gather|"
                    r"scatter|hypercube")
_RANK = re.compile(r"#\s*Rank\s+(\d+)\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+\s+\[[^\]]*\]\s*(.*)")
_STARTING = re.compile(r"#\s*Collective test starting:\s*(\S+)")
_COLUMNS = "'#  size  count  type  ...  time  algbw  busbw' column header"


def busbw_factor(collective: str, ranks: int) -> float:
    """nccl-tests' busbw / algbw (doc/PERFORMANCE.md): 1 for sendrecv, (n − 1)/n for all_gather and alltoall."""
    return 1.0 if collective == "sendrecv" else (ranks - 1) / ranks


@dataclass(frozen=True)
class NcclTestsRun:
    """One nccl-tests output: the test, its ranks and hosts, and the out-of-place rows of size > 0."""

    source: str
    collective: str
    ranks: int
    hosts: int
    gpu: str
    size_bytes: np.ndarray          # [rows] the row's S
    time_s: np.ndarray              # [rows] out-of-place time

    @property
    def ranks_per_host(self) -> int:
        return self.ranks // self.hosts


@dataclass(frozen=True)
class CollectiveFit:
    """``t(S) = alpha_s + factor · S / busbw_bytes_per_s`` fitted to one run."""

    run: NcclTestsRun
    alpha_s: float
    busbw_bytes_per_s: float
    max_error: float                # max |fit − measured| / measured over the rows of ≥ 1 MiB on the wire


def read(path: str | Path) -> NcclTestsRun:
    """Parse an nccl-tests output file (see the module docstring).

    Raises:
        UserError: unreadable; not nccl-tests output; a test other than the three; cut short; columns whose
            numbers do not follow nccl-tests' definitions for its ranks.
    """
    p = Path(path)
    try:
        text = p.read_text(errors="replace")
    except OSError as err:
        raise UserError("--from-nccl-tests", f"cannot read {path}: {err.strerror}", "fix the path") from None
    return parse(text, p.name)


def parse(text: str, source: str) -> NcclTestsRun:
    """:func:`read` on a file's text; ``source`` names it in errors and tells the test when no line does."""
    ranks, named, columns, rows, done = [], None, None, [], False
    for k, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("#"):
            words = s[1:].split()
            if words[:3] == ["size", "count", "type"]:
                if columns is not None:
                    raise UserError(f"{source} line {k}", "a second column header", "give one test per file")
                columns = words
            elif (m := _RANK.match(s)) is not None:
                ranks.append(m.groups())
            elif (m := _STARTING.match(s)) is not None:
                named = m.group(1)
            elif words[:3] == ["Avg", "bus", "bandwidth"] and rows:
                done = True
        elif columns is not None and not done and re.match(r"\d+\s+\d+(\s|$)", s):
            rows.append((k, s.split()))
    if columns is None or not rows:
        raise UserError(source, f"not nccl-tests output (no {_COLUMNS} followed by rows)", EXPECTED)
    if not done:
        raise UserError(source, "no '# Avg bus bandwidth' line after the rows: the run did not finish or the "
                        "file is cut", "give the whole output of a finished run")
    collective = _collective(named, source)
    n, hosts, gpu = _ranks(ranks, source)
    size, time_us, alg, bus = _table(columns, rows, source)
    _check_columns(source, collective, n, size, time_us, alg, bus)
    keep = size > 0                 # nccl-tests prints S = 0 (nothing moved) when S < n elements
    return NcclTestsRun(source, collective, n, hosts, gpu, size[keep], time_us[keep] * 1e-6)


def _collective(named: str | None, source: str) -> str:
    found = {m.group(0) for m in (_TESTS.search(x) for x in (named or "", Path(source).name)) if m}
    if len(found) > 1:
        raise UserError(source, f"the file says {named} but its name says {Path(source).name}", "rename the file")
    if not found:
        raise UserError(source, "no '# Collective test starting:' line and the file name names no test",
                        "name the file after the test: sendrecv_perf.txt, alltoall_perf.txt, all_gather_perf.txt")
    test = found.pop()
    if test not in SUPPORTED:
        raise UserError(source, f"{test}_perf output is not supported", EXPECTED)
    return test


def _ranks(ranks: list[tuple[str, str, str]], source: str) -> tuple[int, int, str]:
    if not ranks:
        raise UserError(source, "no '# Rank R Group G Pid P on HOST device D [BUS] NAME' lines",
                        f"keep the lines nccl-tests prints before the results; {EXPECTED}")
    ids = [int(r) for r, _, _ in ranks]
    if len(set(ids)) != len(ids):
        raise UserError(source, f"rank {max(ids, key=ids.count)} is listed {max(map(ids.count, ids))} times: each "
                        "process ran a test of its own", "build nccl-tests with MPI=1 and rerun")
    return len(ids), len({h for _, h, _ in ranks}), ", ".join(sorted({g.strip() for _, _, g in ranks}))


def _table(columns: list[str], rows: list, source: str) -> tuple[np.ndarray, ...]:
    want = {c: columns.index(c) for c in ("time", "algbw", "busbw") if c in columns}
    if len(want) < 3:
        raise UserError(source, f"the column header has no {', '.join({'time', 'algbw', 'busbw'} - set(want))}",
                        f"{EXPECTED}")
    out = []
    for k, tokens in rows:
        if len(tokens) < len(columns):
            raise UserError(f"{source} line {k}", f"{len(tokens)} fields, expected {len(columns)} "
                            f"({' '.join(columns)})", "the row is cut: give the whole output of a finished run")
        try:
            row = [float(tokens[0])] + [float(tokens[want[c]]) for c in ("time", "algbw", "busbw")]
        except ValueError:
            raise UserError(f"{source} line {k}", f"{' '.join(tokens[:8])} ...: expected numbers in size, time, "
                            "algbw and busbw", EXPECTED) from None
        if not all(0 <= x < 1e18 for x in row) or row[1] <= 0:      # NaN fails every comparison
            raise UserError(f"{source} line {k}", f"{' '.join(tokens[:8])} ...: size, time, algbw and busbw must be "
                            "finite, not negative, and the time positive", "give the output of a run that finished")
        out.append(row)
    return tuple(np.asarray(col, dtype=np.float64) for col in zip(*out))


def _check_columns(source: str, collective: str, n: int, size, time_us, alg, bus) -> None:
    """algbw = S / t and busbw = algbw · factor (to the printed 2 decimals) on rows of ≥ 1 GB/s."""
    big = alg >= 1.0
    if not big.any():
        return
    expect = size[big] / (time_us[big] * 1e3)
    off = np.abs(alg[big] - expect) > 0.01 * expect + 0.01
    if off.any():
        raise UserError(source, f"its algbw column is not size / time (the row of {int(size[big][off][0])} B)",
                        EXPECTED)
    f = busbw_factor(collective, n)
    ratio = bus[big] / alg[big]
    off = np.abs(bus[big] - f * alg[big]) > 0.005 * f * alg[big] + 0.011
    if off.any():
        raise UserError(source, f"busbw / algbw is {np.median(ratio):.3f} (first off: the row of "
                        f"{int(size[big][off][0])} B), but {collective} over the {n} ranks listed gives {f:.3f}",
                        f"the '# Rank' lines must list every rank; {EXPECTED}")


def fit_run(run: NcclTestsRun) -> CollectiveFit:
    """Alpha and busbw of ``run`` (the module docstring's form).

    Raises:
        UserError: the sizes do not reach both regimes (≤ 64 KiB and two of ≥ 1 MiB on the wire).
    """
    wire = run.size_bytes * busbw_factor(run.collective, run.ranks)
    big = np.unique(wire[wire >= BW_MIN_BYTES])
    large = BW_MIN_BYTES if len(big) >= 2 else fit.LARGE_MIN_BYTES
    try:
        alpha, bw = fit.fit_alpha_beta(wire, run.time_s, large_min_bytes=large)
    except ValueError as err:
        raise UserError(run.source, f"cannot fit alpha and bandwidth: {err} on the wire (its sizes: "
                        f"{run.size_bytes.min():.0f}..{run.size_bytes.max():.0f} B)",
                        "run the test from 8 B to 1 GB or more: -b 8 -e 1G -f 2") from None
    sel = wire >= fit.LARGE_MIN_BYTES
    err = np.abs((alpha + wire[sel] / bw) / run.time_s[sel] - 1.0)
    return CollectiveFit(run, alpha, bw, float(err.max()))


def cross_node_rate(f: CollectiveFit) -> float:
    """Bytes/s across a node boundary of a multi-node run (hosts > 1), from its busbw ``B`` (g ranks per node, n
    in all):

    * sendrecv: ``B``, one flow — per node boundary one pair of the rank ring crosses it (the per-flow cap);
    * all_gather: ``B``, the node's outbound rate — NCCL's rings cross each node boundary once per direction,
      and each carries S (n − 1)/n over all rings, so the node's NICs together move B;
    * alltoall: ``B · g (n − g) / (n − 1)`` out of the node — each of its g ranks sends S (n − g)/n to ranks
      elsewhere.

    The last two are a node aggregate (all NICs at once), the first a per-flow rate (docs/cost-model.md, Multi-node).
    """
    r, B = f.run, f.busbw_bytes_per_s
    if r.collective == "alltoall":
        g = r.ranks_per_host
        return B * g * (r.ranks - g) / (r.ranks - 1)
    return B
