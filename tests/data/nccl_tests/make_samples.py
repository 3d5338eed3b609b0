"""Write the synthetic nccl-tests outputs of this folder: ``python tests/data/nccl_tests/make_samples.py``.

Each file is laid out as nccl-tests 2.x prints it (``src/common.cu``: version and test lines, one ``#  Rank``
line per rank, the column header, one row per size from 8 B to 1 GiB by factors of 2, the trailer), but its
times are made here from known parameters, not measured: ``t = alpha + bytes / rate``, times a seeded noise
uniform in ±0.5 %. What ``bytes`` and ``rate`` are (per the physics of each test, written out independently of
``meshplan/truth/nccl_tests.py`` so the fit is checked against it):

* one host: ``rate`` is a GPU's port and ``bytes`` what a rank moves through it — sendrecv S, all_gather and
  alltoall S (n − 1)/n (nccl-tests' bus bandwidth, doc/PERFORMANCE.md);
* two hosts: sendrecv — ``rate`` one cross-node flow, ``bytes`` S; all_gather — ``rate`` the node's outbound
  rate (all NICs), ``bytes`` the S (n − 1)/n NCCL's rings push over each node boundary; alltoall — ``rate``
  the node's outbound rate, ``bytes`` what its g ranks send elsewhere, g · S (n − g)/n.

``algbw`` = S / t and ``busbw`` = algbw · factor are computed as nccl-tests computes them. Variety, as real
files have: ``all_gather_perf-1x8.txt`` is in the older layout (no ``Collective test starting`` line, no
redop/root columns); the two-host alltoall has ``NCCL INFO`` lines among its rows.
"""

from __future__ import annotations

import random
from pathlib import Path

HERE = Path(__file__).parent
GPU = "NVIDIA H100 80GB HBM3"
BUS = ["0000:18:00", "0000:2a:00", "0000:3a:00", "0000:5d:00", "0000:9a:00", "0000:ab:00", "0000:ba:00",
       "0000:db:00"]
SIZES = [8 << k for k in range(28)]         # -b 8 -e 1G -f 2
NOISE = 0.005
# file: (test, hosts, ranks per host, alpha s, rate bytes/s)
SAMPLES = {
    "sendrecv_perf-1x8.txt": ("sendrecv", 1, 8, 8e-6, 365e9),       # NVSwitch port (CHARM+: 365.1 GB/s P2P)
    "all_gather_perf-1x8.txt": ("all_gather", 1, 8, 12e-6, 355e9),
    "alltoall_perf-1x8.txt": ("alltoall", 1, 8, 15e-6, 340e9),
    "sendrecv_perf-2x8.txt": ("sendrecv", 2, 8, 14e-6, 45e9),        # one 400 Gb/s NIC's flow
    "all_gather_perf-2x8.txt": ("all_gather", 2, 8, 25e-6, 360e9),   # 8 NICs of a node together
    "alltoall_perf-2x8.txt": ("alltoall", 2, 8, 30e-6, 330e9),
}


def _num(x: float, width: int) -> str:
    """nccl-tests' getFloatStr: 2 decimals, fewer if the width needs it, else exponent form."""
    for fmt in (f"%{width}.2f", f"%{width}.1f", f"%{width}.0f"):
        if len(fmt % x) <= width:
            return fmt % x
    return f"%{width}.1e" % x


def wire(test: str, hosts: int, g: int, size: int) -> float:
    """The bytes the rate moves (module docstring)."""
    n = hosts * g
    if test == "sendrecv":
        return float(size)
    if test == "alltoall" and hosts > 1:
        return g * size * (n - g) / n
    return size * (n - 1) / n


def rows(name: str) -> list[tuple[int, int, float]]:
    """(S, count, out-of-place time us) per size, and the noise is seeded by the file name."""
    test, hosts, g, alpha, rate = SAMPLES[name]
    n, rng = hosts * g, random.Random(name)
    out = []
    for b in SIZES:
        elems = b // 4                                      # float
        per = elems if test == "sendrecv" else elems // n   # the count nccl-tests prints
        size = 4 * (per if test == "sendrecv" else per * n)
        t = 0.15e-6 if size == 0 else alpha + wire(test, hosts, g, size) / rate
        out.append((size, per, t * 1e6 * (1 + NOISE * rng.uniform(-1, 1))))
    return out


def render(name: str) -> str:
    """The file's text."""
    test, hosts, g, _, _ = SAMPLES[name]
    n, old = hosts * g, name.startswith("all_gather") and hosts == 1
    factor = 1.0 if test == "sendrecv" else (n - 1) / n
    lines = ["mpirun: launching 1 job" if hosts == 1 else "Warning: Permanently added 'node-b' to known hosts."]
    if not old:
        lines += ["# nccl-tests version 2.13.9 nccl-headers=21903 nccl-library=21903",
                  f"# Collective test starting: {test}_perf"]
    lines += ["# nThread 1 nGpus 1 minBytes 8 maxBytes 1073741824 step: 2(factor) warmup iters: 5 iters: 20 agg "
              "iters: 1 validation: 1 graph: 0", "#", "# Using devices"]
    for r in range(n):
        host, dev = divmod(r, g)
        lines.append(f"#  Rank {r:2d} Group  0 Pid {41000 + r:6d} on {'node-' + 'ab'[host]:>10s} device {dev:2d} "
                     f"[{BUS[dev]}] {GPU}")
    cols = "" if old else "   redop    root"
    lines += ["#", "#" + " " * 62 + "out-of-place                       in-place",
              f"#       size         count      type{cols}     time   algbw   busbw #wrong     time   algbw   busbw "
              "#wrong",
              f"#        (B)    (elements){' ' * (15 if old else 31)}(us)  (GB/s)  (GB/s)            (us)  (GB/s)  "
              "(GB/s)"]
    rng, busbws = random.Random(name + "/in-place"), []
    for k, (size, count, t_us) in enumerate(rows(name)):
        t_in = t_us * (1 + NOISE * rng.uniform(-1, 1))
        body = ""
        for t, wrong in ((t_us, "%6g" % 0), (t_in, "   N/A" if test != "all_gather" else "%6g" % 0)):
            alg = size / 1e9 / (t * 1e-6)
            busbws.append(alg * factor)
            body += f"  {_num(t, 7)}  {_num(alg, 6)}  {_num(alg * factor, 6)}  {wrong}"
        head = f"{size:12d}  {count:12d}  {'float':>8s}" + ("" if old else f"  {'none':>6s}  {-1:6d}")
        lines.append(head + body)
        if test == "alltoall" and hosts > 1 and k in (3, 11):
            lines.append(f"node-a:{41000 + k}:{41100 + k} [0] NCCL INFO Channel 0{k % 8}/0 : 0[0] -> 8[0] [send] "
                         "via NET/IB/0(0)/GDRDMA")
    lines += ["# Out of bounds values : 0 OK", f"# Avg bus bandwidth    : {sum(busbws) / len(busbws):.4g} ", "#"]
    if not old:
        lines.append(f"# Collective test concluded: {test}_perf")
    return "\n".join(lines) + "\n"


def main() -> None:
    for name in SAMPLES:
        (HERE / name).write_text(render(name))


if __name__ == "__main__":
    main()
