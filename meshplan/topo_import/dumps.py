"""Read what a node says about itself: ``nvidia-smi topo -m`` text and NCCL's topology XML dump.

Both become a :class:`NodeDump`: per GPU pair the NVLink count and the PCIe path class, per GPU its NUMA
node, per NIC the path class from every GPU. :mod:`meshplan.topo_import.importer` turns that into a topology file.
Path classes are nvidia-smi's (its legend), nearest first: PIX (at most one PCIe bridge), PXB (several
bridges, no host bridge), PHB (through a host bridge, the CPU), NODE (across host bridges of one NUMA node),
SYS (across the SMP interconnect between NUMA nodes: QPI/UPI/xGMI). In the NCCL dump (NCCL_TOPO_DUMP_FILE)
the same classes follow from the ``<cpu>``/``<pci>`` nesting. Bad input raises a one-line UserError that
says what was expected; DTDs and entities are refused before parsing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from meshplan.core.errors import UserError

PATHS = ("PIX", "PXB", "PHB", "NODE", "SYS")    # nearest first
CELL_CHOICES = "X, NV#, PIX, PXB, PHB, NODE or SYS"
_SMI_FIX = "pass the unedited output of `nvidia-smi topo -m` saved to a file"
_XML_FIX = "pass the file NCCL writes with NCCL_TOPO_DUMP_FILE=FILE"


@dataclass(frozen=True)
class NicDump:
    """One NIC port (an RDMA device such as ``mlx5_0``)."""

    name: str
    path: tuple[str, ...]               # [G] path class from each GPU
    speed_Mbps: float | None = None     # NCCL's <net speed=..> (Mb/s); nvidia-smi does not say


@dataclass(frozen=True)
class NodeDump:
    """One node as a dump describes it."""

    source: str                             # file name(s), for comments
    nvlinks: tuple[tuple[int, ...], ...]    # [G, G] NVLinks between each pair (0 on the diagonal)
    path: tuple[tuple[str, ...], ...]       # [G, G] PCIe path class; "" on the diagonal and where NVLink hides it
    numa: tuple[int | None, ...]            # [G] NUMA node of each GPU
    nics: tuple[NicDump, ...]
    sm: int | None = None                   # compute capability x 10 (NCCL's <gpu sm=..>)
    pcie_gen: int | None = None             # PCIe generation of the GPUs' links (NCCL's link_speed)
    xml: str = ""                           # the NCCL dump's file name: sm, pcie_gen and NIC speeds come from it

    @property
    def gpus(self) -> int:
        return len(self.numa)


# ------------------------------------------------------------------------------------------ nvidia-smi
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_LABEL = re.compile(r"(GPU|NIC)(\d+)")
_CELL = re.compile(r"X|NV(\d+)|PIX|PXB|PHB|NODE|SYS")


def _cells(line: str) -> list[str]:
    """Tab-separated cells as nvidia-smi writes them; runs of 2+ spaces where tabs were expanded."""
    if "\t" in line:
        return [c.strip() for c in line.split("\t")]
    return re.split(r"\s{2,}", line.strip())


def parse_nvidia_smi(text: str, source: str) -> NodeDump:
    """The matrix of ``nvidia-smi topo -m``: GPU rows, GPU and NIC columns, affinity columns, NIC legend."""
    field = f"--nvidia-smi {source}"
    lines = [_ANSI.sub("", ln) for ln in text.splitlines()]
    head = next((k for k, ln in enumerate(lines) if _is_header([c for c in _cells(ln) if c])), None)
    if head is None:
        raise UserError(field, "no `nvidia-smi topo -m` matrix: expected a header line of columns GPU0 GPU1 ... "
                        "followed by one row per GPU", _SMI_FIX)
    cols = [c for c in _cells(lines[head]) if c]
    n_gpu = _run_length(cols, 0, "GPU", field)
    n_nic = _run_length(cols, n_gpu, "NIC", field)
    extra = cols[n_gpu + n_nic:]
    if any(_LABEL.fullmatch(c) for c in extra):
        raise UserError(field, f"header: expected GPU0..GPU{n_gpu - 1}, then NIC columns, then the affinity "
                        f"columns, found {' '.join(cols)}", _SMI_FIX)
    rows = []
    for ln in lines[head + 1:]:
        cells = _cells(ln)
        if not cells or not _LABEL.fullmatch(cells[0]):
            break
        rows.append(cells)
    gpu_rows = [r for r in rows if r[0].startswith("GPU")]
    if [r[0] for r in gpu_rows] != [f"GPU{i}" for i in range(n_gpu)]:
        raise UserError(field, f"expected rows GPU0..GPU{n_gpu - 1} (one per GPU column), found "
                        f"{', '.join(r[0] for r in gpu_rows) or 'none'}", _SMI_FIX)
    labels = cols[:n_gpu + n_nic]
    matrix = [_row_cells(r, labels, i, field) for i, r in enumerate(gpu_rows)]
    nvlinks, path = _gpu_pairs(matrix, n_gpu, field)
    numa = tuple(_numa(r[1 + len(labels):], extra) for r in gpu_rows)
    names = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, flags=re.M))
    nics = tuple(NicDump(names.get(f"NIC{j}", f"NIC{j}"), tuple(m[n_gpu + j] for m in matrix)) for j in range(n_nic))
    return NodeDump(source, nvlinks, path, numa, nics)


def _is_header(cells: list[str]) -> bool:
    """The column line starts GPU0 GPU1 / GPU0 NIC0 / GPU0 CPU Affinity; GPU0's row starts GPU0 X."""
    return cells[:1] == ["GPU0"] and cells[1:2] != ["X"]


def _run_length(cols: list[str], start: int, kind: str, field: str) -> int:
    """How many columns kind0, kind1, ... follow from ``start`` (they must be numbered in order)."""
    k = 0
    while start + k < len(cols) and cols[start + k].startswith(kind) and _LABEL.fullmatch(cols[start + k]):
        if cols[start + k] != f"{kind}{k}":
            raise UserError(field, f"header: expected column {kind}{k}, found {cols[start + k]}", _SMI_FIX)
        k += 1
    return k


def _row_cells(row: list[str], labels: list[str], i: int, field: str) -> list[str]:
    """The matrix cells of GPU row ``i``, each checked against nvidia-smi's legend."""
    cells = row[1:1 + len(labels)]
    if len(cells) < len(labels):
        raise UserError(field, f"row {row[0]} has {len(cells)} cells, expected {len(labels)} (one per column "
                        f"{labels[0]}..{labels[-1]})", _SMI_FIX)
    for col, cell in zip(labels, cells):
        self_cell = col == f"GPU{i}"
        if not _CELL.fullmatch(cell) or (cell == "X") != self_cell or (col[:3] == "NIC" and cell.startswith("NV")):
            want = "X (self)" if self_cell else ("PIX, PXB, PHB, NODE or SYS" if col[:3] == "NIC"
                                                else "NV#, PIX, PXB, PHB, NODE or SYS")
            raise UserError(field, f"row {row[0]}, column {col}: expected {want}, found {cell!r}", _SMI_FIX)
    return cells


def _gpu_pairs(matrix: list[list[str]], n: int, field: str):
    """[G, G] NVLink counts and path classes of the GPU block; it must be symmetric."""
    nvlinks = [[0] * n for _ in range(n)]
    path = [[""] * n for _ in range(n)]
    for a in range(n):
        for b in range(n):
            cell = matrix[a][b]
            if cell != matrix[b][a]:
                raise UserError(field, f"GPU{a}-GPU{b} is {cell} but GPU{b}-GPU{a} is {matrix[b][a]}: expected a "
                                "symmetric GPU matrix", _SMI_FIX)
            if cell.startswith("NV"):
                nvlinks[a][b] = int(cell[2:])
            elif cell != "X":
                path[a][b] = cell
    return tuple(map(tuple, nvlinks)), tuple(map(tuple, path))


def _numa(tail: list[str], extra: list[str]) -> int | None:
    """The NUMA Affinity value of a row (empty cells dropped: nvidia-smi writes one before GPU NUMA ID)."""
    values = dict(zip(extra, [c for c in tail if c]))
    m = re.match(r"\d+", values.get("NUMA Affinity", ""))
    return int(m.group()) if m else None


# ------------------------------------------------------------------------------------------ NCCL XML
@dataclass(frozen=True)
class _Seen:
    """A <gpu> or <net> with where it sits: its socket (<cpu> index) and the PCIe bridges above it."""

    el: object
    socket: int
    numa: int
    bridges: tuple[str, ...]
    pci: object                 # the enclosing non-bridge <pci> element (or None)


def parse_nccl_xml(text: str, source: str) -> NodeDump:
    """NCCL's topology dump: <system><cpu><pci class=0x0604..>...<gpu><nvlink/></gpu>...<nic><net/></nic>."""
    import xml.etree.ElementTree as ET

    field = f"--nccl-xml {source}"
    if re.search(r"<!\s*(DOCTYPE|ENTITY)", text, flags=re.I):
        raise UserError(field, "has a DOCTYPE/ENTITY declaration: expected a plain NCCL topology dump (declarations "
                        "are refused, not read)", "remove the declaration, or dump the topology again")
    try:
        root = ET.fromstring(text)
    except ET.ParseError as err:
        line, col = err.position
        raise UserError(field, f"not well-formed XML (line {line}, column {col}): expected an NCCL topology dump",
                        _XML_FIX) from None
    if root.tag != "system" or root.find("cpu") is None:
        raise UserError(field, f"root <{root.tag}>: expected NCCL's <system> with <cpu> children", _XML_FIX)
    gpus, nets = [], []
    for s, cpu in enumerate(root.findall("cpu")):
        numa = _int(cpu.get("numaid"), s)
        _walk(cpu, s, numa, (), None, gpus, nets)
    if not gpus:
        raise UserError(field, "no <gpu> under <system><cpu>: expected an NCCL topology dump of a GPU node", _XML_FIX)
    devs = [_int(g.el.get("dev"), -1) for g in gpus]
    if sorted(devs) != list(range(len(gpus))):
        raise UserError(field, f"<gpu dev=..> values {sorted(devs)}: expected 0..{len(gpus) - 1}, one each", _XML_FIX)
    gpus = [g for _, g in sorted(zip(devs, gpus), key=lambda p: p[0])]
    n = len(gpus)
    path = tuple(tuple("" if a == b else _xml_path(gpus[a], gpus[b]) for b in range(n)) for a in range(n))
    nics = tuple(NicDump(w.el.get("name") or f"net{k}", tuple(_xml_path(g, w) for g in gpus),
                         _float(w.el.get("speed"))) for k, w in enumerate(nets))
    sms = {_int(g.el.get("sm"), 0) for g in gpus} - {0}
    gens = {_gen(g.pci.get("link_speed", "")) if g.pci is not None else None for g in gpus} - {None}
    return NodeDump(source, _xml_nvlinks(gpus), path, tuple(g.numa for g in gpus), nics,
                    sm=min(sms) if sms else None, pcie_gen=min(gens) if gens else None, xml=source)


def _walk(el, socket: int, numa: int, bridges: tuple[str, ...], pci, gpus: list, nets: list) -> None:
    for child in el:
        if child.tag == "pci":
            if child.get("class", "").lower().startswith("0x0604"):        # a PCI bridge: a switch (port)
                _walk(child, socket, numa, bridges + (child.get("busid", "").lower(),), None, gpus, nets)
            else:
                _walk(child, socket, numa, bridges, child, gpus, nets)
        elif child.tag == "gpu":
            gpus.append(_Seen(child, socket, numa, bridges, pci))
        elif child.tag == "nic":
            nets.extend(_Seen(net, socket, numa, bridges, pci) for net in child.iter("net"))
        else:
            _walk(child, socket, numa, bridges, pci, gpus, nets)


def _xml_path(a: _Seen, b: _Seen) -> str:
    """nvidia-smi's class for two devices of the dump (NODE for any two root ports of one socket)."""
    if a.socket != b.socket:
        return "SYS"
    if a.bridges and b.bridges and a.bridges[-1] == b.bridges[-1]:
        return "PIX"
    if a.bridges and b.bridges and a.bridges[0] == b.bridges[0]:
        return "PXB"
    return "NODE"


def _xml_nvlinks(gpus: list[_Seen]) -> tuple[tuple[int, ...], ...]:
    """[G, G] NVLinks per pair: direct links, plus min(a's, b's) links when both reach the NVSwitch chips."""
    index = {g.pci.get("busid", "").lower(): k for k, g in enumerate(gpus) if g.pci is not None}
    n = len(gpus)
    direct, switch = [[0] * n for _ in range(n)], [0] * n
    for a, g in enumerate(gpus):
        for link in g.el.iter("nvlink"):
            count, tclass = _int(link.get("count"), 0), link.get("tclass", "").lower()
            if tclass == "0x068000":                                         # NVSwitch (PCI class "bridge, other")
                switch[a] += count
            elif tclass.startswith("0x03") and link.get("target", "").lower() in index:
                direct[a][index[link.get("target", "").lower()]] += count    # another GPU (3D controller)
    return tuple(tuple(0 if a == b else direct[a][b] + min(switch[a], switch[b]) for b in range(n))
                 for a in range(n))


def _int(s: str | None, default: int) -> int:
    return int(s) if s is not None and s.strip().lstrip("-").isdigit() else default


def _float(s: str | None) -> float | None:
    try:
        return float(s) if s is not None and float(s) > 0 else None
    except ValueError:
        return None


def _gen(link_speed: str) -> int | None:
    """PCIe generation from NCCL's ``link_speed`` ("32.0 GT/s PCIe" -> 5)."""
    m = re.match(r"\s*([\d.]+)\s*GT/s", link_speed)
    return {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}.get(float(m.group(1))) if m else None


# ------------------------------------------------------------------------------------------ both
def merge(smi: NodeDump, xml: NodeDump) -> NodeDump:
    """nvidia-smi's matrix, with what only NCCL knows (PCIe paths under NVLink, sm, PCIe gen, NIC speeds)."""
    field = f"--nccl-xml {xml.source}"
    if smi.gpus != xml.gpus:
        raise UserError(field, f"lists {xml.gpus} GPUs but {smi.source} lists {smi.gpus}: expected dumps of "
                        "one node", "give the two dumps of the same machine")
    for a in range(smi.gpus):
        for b in range(smi.gpus):
            if smi.nvlinks[a][b] != xml.nvlinks[a][b]:
                says = f"NV{smi.nvlinks[a][b]}" if smi.nvlinks[a][b] else "no NVLink"
                raise UserError(field, f"gives GPU{a}-GPU{b} {xml.nvlinks[a][b]} NVLinks but {smi.source} says "
                                f"{says}: expected dumps of one node", "give the two dumps of the same machine")
    path = tuple(tuple(p or q for p, q in zip(ps, qs)) for ps, qs in zip(smi.path, xml.path))
    numa = tuple(m if m is not None else x for m, x in zip(smi.numa, xml.numa))
    speeds = {nic.name: nic.speed_Mbps for nic in xml.nics}
    nics = tuple(replace(nic, speed_Mbps=speeds.get(nic.name)) for nic in smi.nics) or xml.nics
    return NodeDump(f"{smi.source}, {xml.source}", smi.nvlinks, path, numa, nics, xml.sm, xml.pcie_gen, xml.source)
