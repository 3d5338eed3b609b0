"""Will a run fit this host? The memory the run's ranks will hold against the memory the host has, before any
rank starts (``meshplan run``). And will a search (:func:`check_search_fits`)?

A run that does not fit is ended by the kernel's out-of-memory killer minutes later with no reason given (16
CPU ranks of a 1M-token plan on a 24 GB host). So before spawning, ``meshplan run`` adds up what each rank holds:

* the schedule's tensors and the kernels' workspace at their peak: the memory model (:mod:`meshplan.cost.memory`,
  timed by simulating the schedule on the device the ranks run on — ``cpu-local`` for CPU ranks, the schedule's
  topology for GPUs);
* what the executor holds beside them (:func:`executor_bytes`): every rank draws the whole sequence's inputs
  (Q, K, V, dO in the input dtype, identical from one seed) and converts its results to float32 for the
  numerics check, which rank 0 gathers and assembles for the whole sequence (float32, twice while they arrive);
* on CPU, each rank's process (``base_bytes``: this process's resident set, the interpreter, torch and the
  schedule, which every spawned rank loads too);

and refuses unless the ranks on this host take at most ``HOST_SHARE`` of its available memory (``MemAvailable``;
GPU ranks: of each local device's free memory, for the tensors, workspace and inputs). A refusal names the
numbers and, for masks a sequence length can scale (full, causal, window), the longest power-of-two fraction of
``--seq-len`` whose run fits by the same sum, as the ``meshplan simulate`` command that writes it (planned and
checked here).
"""

from __future__ import annotations

import functools

from meshplan.core.errors import UserError
from meshplan.core.units import fmt_bytes

HOST_SHARE = 0.9          # of the available memory, what a run may take (the page cache, this process, noise)
MAX_HALVINGS = 10
#: a smaller plan suggested for CPU ranks also runs an iteration in at most this long by the prediction on this host:
#: ``meshplan run`` does 2 warm-up and 5 timed iterations by default, after starting every rank (16 ranks of 8K
#: tokens on 2 cores: 11 s an iteration predicted, 9.6 s measured, 196 s in all with the ranks' start)
SUGGEST_ITERATION_MAX_S = 5.0


def rank_peak_bytes(sched, topo) -> float:
    """The memory model's peak of the busiest rank (bytes), over the passes, simulated on ``topo``."""
    return _on(sched, topo)[0]


def _on(sched, topo) -> tuple[float, float]:
    """(:func:`rank_peak_bytes`, the seconds an iteration takes) of ``sched`` by one simulation on ``topo``."""
    from meshplan.cost.memory import model_peak_bytes
    from meshplan.cost.simulate import simulate

    sim = simulate(sched, topo)
    peaks = []
    for p in sched.passes:
        off = sim.pass_offset[p]
        peaks.append(model_peak_bytes(sched, topo.memory_model, p, sim.start - off, sim.end - off))
    return max(peaks, default=0.0), sum(sim.pass_makespan.values())


@functools.cache
def cpu_max_ranks() -> int:
    """The most CPU ranks ``meshplan run`` spawns on one host (``cpu-local``'s ``max_ranks``)."""
    from meshplan.model.topo_files import find_topology, parse_topology
    path, text = find_topology("cpu-local")
    return int(parse_topology(text, path).node.max_ranks)


def cpu_ranks_error(name: str, n_ranks: int) -> UserError:
    """Why a schedule of ``n_ranks`` cannot run as CPU ranks spawned here, and where it can."""
    most = cpu_max_ranks()
    return UserError(name, f"has {n_ranks} ranks; this host spawns at most {most} CPU ranks (cpu-local)",
                     f"run it on its cluster, one rank per GPU under torchrun (torchrun --nnodes N --nproc-per-node G "
                     f"-m meshplan run {name}; docs/running.md), or plan {most} ranks or fewer for a CPU run")


def run_topology(sched, gpu: bool):
    """The topology whose device the ranks run on: ``cpu-local`` with the schedule's ranks for CPU ranks, else the
    schedule's own.

    Raises:
        UserError: more CPU ranks than this host spawns (:func:`cpu_ranks_error`)."""
    from meshplan.model.topology import Topology
    if not gpu:
        if sched.n_ranks > cpu_max_ranks():
            raise cpu_ranks_error("the schedule", sched.n_ranks)
        return Topology.load("cpu-local", sched.n_ranks)
    return Topology.load(sched.topology.get("name"), sched.topology.get("devices"))


def executor_bytes(w, n_ranks: int, gathers: bool) -> tuple[float, float]:
    """(bytes every rank holds, bytes rank 0 holds besides) of the executor's own, beside the schedule's tensors
    (module docstring): the inputs [B, S, H or Hkv, D] x (Q, dO, K, V) in the input dtype, per rank, with its
    share of the results in float32 and (sampled check) the float64 dK, dV it checks at its keys (four arrays);
    when rank 0 ``gathers`` every result (the full check, ``--dump``), the results (O, dQ, dK, dV float32 and
    LSE) three times on it while they arrive (pickled, unpickled, assembled), the masked dO and six float64
    [B, S, Hkv, D] arrays of the check. Measured on 16 CPU ranks of 8K tokens gathering: rank 0 peaked at 2.4 GB
    where this and the memory model gave 2.1 GB."""
    from meshplan.core.units import DTYPE_BYTES

    tokens = w.batch * w.seq_len * w.head_dim
    inputs = tokens * (2 * w.n_heads + 2 * w.n_kv_heads) * DTYPE_BYTES[w.dtype]
    results = tokens * (2 * w.n_heads + 2 * w.n_kv_heads) * 4 + w.batch * w.n_heads * w.seq_len * 4
    dkv64 = tokens * w.n_kv_heads * 8
    each = inputs + (results + 4 * dkv64) / n_ranks
    first = 3 * results + tokens * w.n_heads * DTYPE_BYTES[w.dtype] + 6 * dkv64 if gathers else 0.0
    return float(each), float(first)


def host_need_bytes(sched, host, peak: float, gathers: bool) -> float:
    """Bytes the run takes of what ``host`` offers (GPU: one device's; CPU: the host's, all local ranks)."""
    each, first = executor_bytes(sched.workload, sched.n_ranks, gathers)
    if host.gpu:
        return peak + each
    return host.local_ranks * (peak + each + host.base_bytes) + first


def check_fits(sched, host, name: str, gathers: bool = False) -> None:
    """Refuse (UserError, before anything starts) a run whose predicted memory exceeds the host's
    (``host``: a :class:`meshplan.executor.host.HostMemory`).

    Raises:
        UserError: one line with the numbers and a smaller workload that fits (see the module docstring).
    ``gathers``: rank 0 gathers every result (the full numerics check, or ``--dump``).
    """
    topo = run_topology(sched, host.gpu)
    peak = rank_peak_bytes(sched, topo)
    need = host_need_bytes(sched, host, peak, gathers)
    if need <= HOST_SHARE * host.available_bytes:
        return
    each, first = executor_bytes(sched.workload, sched.n_ranks, gathers)
    where = "the least free GPU has" if host.gpu else "this host has"
    parts = f"{fmt_bytes(peak)} of tensors and workspace by the memory model, {fmt_bytes(each)} of inputs and results"
    if not host.gpu:
        parts += f", {fmt_bytes(host.base_bytes)} of process each"
        parts += f"; rank 0 {fmt_bytes(first)} more to gather the results" if first else ""
    who = "each GPU rank needs" if host.gpu else f"{host.local_ranks} rank{'s' if host.local_ranks > 1 else ''} need"
    raise UserError(name, f"{who} {fmt_bytes(need)} ({parts}), {where} {fmt_bytes(host.available_bytes)} "
                    "available; nothing was started",
                    _smaller(sched, topo, host, gathers) or "run it on a host with more memory, or plan it for fewer "
                    "tokens")


def _smaller(sched, topo, host, gathers: bool) -> str | None:
    """The ``simulate`` command of the longest power-of-two fraction of the sequence whose plan fits — and on CPU
    ranks runs an iteration within :data:`SUGGEST_ITERATION_MAX_S` by its prediction on ``topo`` (16 ranks of 16K
    tokens fit 24 GB but take ~45 s an iteration on 2 cores) — or None."""
    from meshplan.algorithms.base import knob_arg
    from meshplan.model.topology import Topology
    from meshplan.search.candidate import predict

    w = sched.workload
    if w.mask.kind == "docs" or w.prefix_len or w.valid_len is not None:
        return None
    try:
        planned_on = Topology.load(sched.topology.get("name"), sched.topology.get("devices"))
    except UserError:
        return None
    seq = w.seq_len
    for _ in range(MAX_HALVINGS):
        seq //= 2
        try:
            cand = predict(sched.algorithm, w.with_(seq_len=seq), planned_on, sched.n_ranks, dict(sched.knobs))
        except UserError:
            return None
        peak, each_s = _on(cand.schedule, topo)             # the same ranks and run topology as the refused plan
        need = host_need_bytes(cand.schedule, host, peak, gathers)
        if need > HOST_SHARE * host.available_bytes:
            continue
        if host.gpu or each_s <= SUGGEST_ITERATION_MAX_S:
            knobs = " ".join(knob_arg(k, v) for k, v in sched.knobs.items() if v is not None)
            flags = f"{w.with_(seq_len=seq).cli_flags()}{' ' + knobs if knobs else ''}"
            took = "" if host.gpu else f", ~{each_s:.2g} s an iteration here"
            return (f"plan {seq} tokens instead ({fmt_bytes(need)}{took}): meshplan simulate "
                    f"--algo {sched.algorithm} --gpus {sched.n_ranks} --topo {planned_on.name} {flags} --out "
                    "smaller.json && meshplan run smaller.json")
    return None


#: A search holds N x N arrays per block (attention matrices per layout, the plans' block owners, block times at
#: kernel growths): peak resident bytes of ``meshplan search --topo h100x32.yaml`` (1M tokens, defaults) were
#: 1.91 GB at 1024 GPUs and 7.16 GB at 2048 — SEARCH_BASE_BYTES + 1670 bytes a block; with only the methods planned
#: in the zigzag layout alone (:data:`ZIGZAG_ONLY`) 1.42 GB at 2048 and 5.44 GB at 4096 — about 320 a block. Above
#: ``SEARCH_BUILD_MAX_RANKS`` every method is searched in zigzag alone and nothing is built: 2.21 GB at 2048 and
#: 9.14 GB at 4096 (2026-12-06; 7.3 GB once Mesh's geometry went by blocks of peers), 540 a block.
SEARCH_BASE_BYTES = 0.16e9
SEARCH_BYTES_PER_BLOCK = {"layouts": 1670.0, "zigzag": 320.0, "bounds": 540.0}
#: the methods a search plans in every layout (each layout's matrix and plans held at once)
EVERY_LAYOUT = ("ring", "pass-q", "mesh")
ZIGZAG_ONLY = ("usp", "ulysses", "startrail", "loongtrain", "merge", "rmplus", "charm")


def _bytes_per_block(n_ranks: int, algos) -> float:
    """The every-layout rate when ``algos`` (None: every method) names Ring, pass-Q or Mesh, else the zigzag one;
    above the search's build limit, where every method is searched in zigzag by its bounds, that rate."""
    from meshplan.algorithms.base import SEARCH_BUILD_MAX_RANKS

    every = algos is None or any(a in EVERY_LAYOUT for a in algos)
    if every and n_ranks > SEARCH_BUILD_MAX_RANKS:
        return SEARCH_BYTES_PER_BLOCK["bounds"]
    return SEARCH_BYTES_PER_BLOCK["layouts" if every else "zigzag"]


def search_bytes(n_ranks: int, algos) -> float:
    """Peak resident bytes a search over ``n_ranks`` ranks is expected to hold (:data:`SEARCH_BYTES_PER_BLOCK`)."""
    return SEARCH_BASE_BYTES + _bytes_per_block(n_ranks, algos) * float(n_ranks) ** 2


def check_search_fits(n_ranks: int, algos, available_bytes: float | None, flag: str = "--gpus") -> None:
    """Refuse (UserError, before anything is planned) a search whose N x N arrays would take more than
    :data:`HOST_SHARE` of the host's available memory — the kernel would otherwise end it minutes later, unexplained
    (8192 GPUs: ~36 GB). The fix names the largest power of two of GPUs whose search fits, and the zigzag-only
    methods where those fit at this size. Nothing is checked where the available memory cannot be read."""
    need = search_bytes(n_ranks, algos)
    if available_bytes is None or need <= HOST_SHARE * available_bytes:
        return
    rate = _bytes_per_block(n_ranks, algos)
    most = 1 << (n_ranks.bit_length() - 1)                  # the largest power of two that fits: a measured size
    while most >= 8 and search_bytes(most, algos) > HOST_SHARE * available_bytes:
        most //= 2
    fixes = [f"search at most {most} GPUs on this host"] if most >= 8 else []
    light = search_bytes(n_ranks, ZIGZAG_ONLY)
    if need > light and light <= HOST_SHARE * available_bytes:
        fixes.append(f"search only the methods planned in one layout: --algos {','.join(ZIGZAG_ONLY)} "
                     f"(about {fmt_bytes(light)})")
    fixes.append("or run it on a host with more memory")
    raise UserError(flag, f"a search over {n_ranks} GPUs holds about {fmt_bytes(need)} of N x N block arrays "
                    f"(attention matrices, plans' block owners: {rate:.0f} bytes a block, measured), this host has "
                    f"{fmt_bytes(available_bytes)} available; nothing was planned", "; ".join(fixes))
