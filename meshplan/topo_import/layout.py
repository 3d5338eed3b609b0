"""How a node's dumps map onto the topology format: NVLink count, PCIe switches and sockets, NIC rails.

The format's limits (a dump that does not fit is refused with one line saying what was expected):
- NVLink: every GPU pair NV# with one # -> an NVSwitch all-to-all of # links per GPU (a direct all-to-all
  mesh is modelled the same way: each pair's rate is right, the shared port is not); NVLink between some
  pairs only is refused.
- PCIe: GPUs with a PIX/PXB path share a switch; PIX/PXB/PHB/NODE share a socket (NUMA domain); SYS
  crosses sockets. Both must be contiguous, equal blocks of GPUs (socket-major, switch-major numbering).
- NICs: each GPU takes its nearest NIC (the first of equals); those NICs are the rails, each serving a
  contiguous equal block of GPUs; NICs nearest to no GPU (storage, management) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshplan.core.errors import UserError
from meshplan.topo_import.dumps import PATHS, NicDump, NodeDump, merge, parse_nccl_xml, parse_nvidia_smi

_BY_HAND = "write that part of the topology file by hand (see meshplan/topologies/l20x8.yaml)"


@dataclass(frozen=True)
class Layout:
    """The node's shape in the format's terms."""

    nvlinks: int                    # per GPU pair; 0: PCIe only
    sockets: int
    switches_per_socket: int
    rails: tuple[NicDump, ...]      # GPU block k (of gpus // len(rails)) uses rails[k]
    rail_path: str                  # the farthest path class from a GPU to its NIC
    left_out: tuple[str, ...]       # NICs nearest to no GPU
    notes: tuple[str, ...] = ()


def read_dumps(nvidia_smi: str | None, nccl_xml: str | None) -> tuple[NodeDump, str]:
    """The node from one or both dumps (cross-checked), and the flags that named them (for errors)."""
    if not nvidia_smi and not nccl_xml:
        raise UserError("--nvidia-smi", "no dump given", "give --nvidia-smi FILE (nvidia-smi topo -m > FILE) "
                        "and/or --nccl-xml FILE (NCCL_TOPO_DUMP_FILE=FILE)")
    smi = parse_nvidia_smi(_read(nvidia_smi, "--nvidia-smi"), Path(nvidia_smi).name) if nvidia_smi else None
    xml = parse_nccl_xml(_read(nccl_xml, "--nccl-xml"), Path(nccl_xml).name) if nccl_xml else None
    field = " ".join(f"{flag} {Path(p).name}" for flag, p in (("--nvidia-smi", nvidia_smi), ("--nccl-xml", nccl_xml))
                     if p)
    return (merge(smi, xml) if smi and xml else smi or xml), field


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise UserError(flag, f"cannot read {path}: {err.strerror}", "give the path of the saved dump") from None


# ------------------------------------------------------------------------------------------ layout
def node_layout(d: NodeDump, field: str) -> Layout:
    """NVLink count, PCIe nesting and rails of a dump, or a UserError saying what the format needs."""
    nv = _nvlink_count(d, field)
    sockets = switches = 1
    if not nv and d.gpus > 1:
        switch = _blocks(d, PATHS[:2], "PCIe switch", field)
        socket = _blocks(d, PATHS[:4], "socket (NUMA domain)", field)
        per_switch, per_socket = switch.count(0), socket.count(0)
        if per_socket % per_switch or any(socket[g] != socket[g - 1] for g in range(1, d.gpus)
                                          if switch[g] == switch[g - 1]):
            raise UserError(field, f"PCIe switches of {per_switch} GPUs do not nest in sockets of {per_socket}: "
                            "expected every switch under one socket", _BY_HAND)
        sockets, switches = socket[-1] + 1, per_socket // per_switch
    numa = set(d.numa)
    notes = () if None in numa or nv or len(numa) == sockets else (
        f"NUMA Affinity gives {len(numa)} domain(s), the PCIe paths {sockets} socket(s): the paths were used",)
    return Layout(nv, sockets, switches, *_rails(d, field), notes=notes)


def _nvlink_count(d: NodeDump, field: str) -> int:
    pairs = {(d.nvlinks[a][b], a, b) for a in range(d.gpus) for b in range(a + 1, d.gpus)}
    counts = {c for c, _, _ in pairs}
    if len(counts) <= 1:
        return counts.pop() if counts else 0
    (hi, a, b), (lo, c, e) = max(pairs), min(pairs)
    raise UserError(field, f"GPU{a}-GPU{b} has {hi} NVLinks but GPU{c}-GPU{e} {lo}: the format models NVLink as an "
                    "NVSwitch all-to-all, expected the same NV# for every GPU pair", _BY_HAND)


def _blocks(d: NodeDump, close: tuple[str, ...], what: str, field: str) -> list[int]:
    """Group of each GPU (GPUs joined by a path in ``close``), numbered in order; contiguous, equal blocks."""
    root = list(range(d.gpus))

    def find(g: int) -> int:
        while root[g] != g:
            g = root[g]
        return g

    for a in range(d.gpus):
        for b in range(a + 1, d.gpus):
            if d.path[a][b] in close:
                root[find(b)] = find(a)
    first: dict[int, int] = {}
    group = [first.setdefault(find(g), len(first)) for g in range(d.gpus)]
    sizes = [group.count(k) for k in range(len(first))]
    if any(group[g] < group[g - 1] for g in range(1, d.gpus)):
        k = next(group[g] for g in range(1, d.gpus) if group[g] < group[g - 1])
        members = ", ".join(f"GPU{g}" for g in range(d.gpus) if group[g] == k)
        raise UserError(field, f"{members} share a {what} but are not numbered together: expected GPU blocks in "
                        "order (socket-major, switch-major numbering)", _BY_HAND)
    if len(set(sizes)) > 1:
        raise UserError(field, f"each {what} holds {', '.join(map(str, sizes))} GPUs: the format expects the same "
                        "number under each", _BY_HAND)
    return group


def _rails(d: NodeDump, field: str) -> tuple[tuple[NicDump, ...], str, tuple[str, ...]]:
    if not d.nics:
        return (), "", ()
    best = [min(range(len(d.nics)), key=lambda k: (PATHS.index(d.nics[k].path[g]), k)) for g in range(d.gpus)]
    used = list(dict.fromkeys(best))
    per = d.gpus // len(used)
    if d.gpus % len(used) or best != [used[g // per] for g in range(d.gpus)]:
        pairs = ", ".join(f"GPU{g}->{d.nics[k].name}" for g, k in enumerate(best))
        raise UserError(field, f"nearest NICs {pairs}: expected each NIC to serve a contiguous, equal block of GPUs "
                        "(the format's rails)", _BY_HAND)
    far = max(PATHS.index(d.nics[best[g]].path[g]) for g in range(d.gpus))
    return tuple(d.nics[k] for k in used), PATHS[far], tuple(n.name for k, n in enumerate(d.nics) if k not in used)
