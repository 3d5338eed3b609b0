"""``meshplan topo import``: a topology file from ``nvidia-smi topo -m`` output and/or NCCL's topology dump.

What the dumps say (:mod:`meshplan.topo_import.dumps`, shaped by :mod:`meshplan.topo_import.layout`: GPUs per node,
NVLinks per pair, PCIe switches and sockets, NIC rails) becomes the node template of
:mod:`meshplan.model.topology_spec`; what they do not say (usable bandwidths, latencies, the device's peaks)
comes from flags, from the cited defaults in ``meshplan/data/topo_import.yaml``, and for the device from a
shipped topology. Every number written has a comment saying where it came from (:mod:`meshplan.topo_import.yaml_text`).
The text is validated and built into a Topology before it is written, atomically.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from meshplan.core.errors import UserError
from meshplan.model.topology_spec import TopologySpec
from meshplan.topo_import.dumps import NodeDump
from meshplan.topo_import.layout import Layout, node_layout, read_dumps
from meshplan.topo_import.yaml_text import S, comments, render, validate


@dataclass(frozen=True)
class ImportFlags:
    """The command's inputs (human units: GB/s per direction, microseconds)."""

    nvidia_smi: str | None = None
    nccl_xml: str | None = None
    nodes: int = 1
    gpu_model: str | None = None
    device_from: str | None = None
    nvlink_GBps: float | None = None         # usable per NVLink and direction
    pcie_GBps: float | None = None           # usable GPU PCIe link (and switch uplink)
    socket_GBps: float | None = None
    nic_GBps: float | None = None            # usable per NIC port
    nic_latency_us: float | None = None
    per_flow_GBps: float | None = None
    node_aggregate_GBps: float | None = None
    network_latency_us: float | None = None
    p2p_overhead_us: float | None = None
    network: str = "nonblocking"             # or rail (NIC k of every node on leaf k)
    cross_rail: str | None = None            # rail: spine | pxn
    spine_oversubscription: float | None = None
    spine_latency_us: float | None = None


@dataclass(frozen=True)
class Imported:
    """An imported topology: its file text and validated spec."""

    text: str                       # the YAML file
    spec: TopologySpec
    notes: tuple[str, ...]          # what the user should know (also in the file's header)


# ------------------------------------------------------------------------------------------ the file
def import_topology(flags: ImportFlags, name: str) -> Imported:
    """Read the dumps, derive the layout, fill in the numbers with their sources, validate.

    Raises:
        UserError: a malformed dump, a node the format cannot express, or a number nobody gave.
    """
    dump, field = read_dumps(flags.nvidia_smi, flags.nccl_xml)
    lay = node_layout(dump, field)
    dflt = _defaults()
    model = _model(flags.gpu_model, dump)
    device = _device(flags, model)
    fabric = _fabric(lay, dump, flags, model, dflt)
    notes = list(lay.notes)
    nics = _nics(lay, dump, flags, dflt, lambda: _pcie_rate(flags, dump, model, dflt), notes)
    if flags.cross_rail == "pxn" and not lay.nvlinks:
        raise UserError("--cross-rail", f"PXN relays cross-rail traffic over NVLink; {dump.source} shows none",
                        "use --cross-rail spine")
    if flags.nodes > 1 and nics is None:
        raise UserError("--nodes", f"{flags.nodes} nodes need NICs; {dump.source} lists none", "import a dump "
                        "that lists the node's NICs, or --nodes 1")
    kappa = ("nvlink", "pcie", "net") if lay.nvlinks else ("pcie", "socket", "net")
    node = {"gpus": S(dump.gpus, f"{dump.source}: GPU0..GPU{dump.gpus - 1}"), "device": device,
            "fabric": fabric}
    if nics is not None:
        node["nics"] = nics
    tree = {"name": S(name, "flag --name (default: the --out file's name)"),
            "description": S(_describe(dump, lay, nics), "by meshplan topo import"),
            "nodes": S(flags.nodes, "flag --nodes (default 1; --gpus N scales it)"), "node": node,
            "network": _network(flags, dflt),
            "p2p_overhead_us": _pick(flags.p2p_overhead_us, "--p2p-overhead-us", dflt["p2p_overhead_us"]),
            "overlap_kappa": {c: _cited(dflt["overlap_kappa"][c]) for c in kappa}}
    if lay.left_out:
        notes.append(f"NICs nearest to no GPU left out: {', '.join(lay.left_out)}")
    head = [f"{name}: imported by `meshplan topo import` from {dump.source}. Every number says where it came "
            "from: the dump, a flag, or a cited default (meshplan/data/topo_import.yaml)."] + notes
    text = render(tree, head)
    return Imported(text, validate(text), tuple(notes))


def _network(flags: ImportFlags, dflt: dict) -> dict:
    """The network block: non-blocking (the dumps say nothing of the network), or rail-optimised from the flags."""
    rail_flags = {"--cross-rail": flags.cross_rail, "--spine-oversubscription": flags.spine_oversubscription,
                  "--spine-latency-us": flags.spine_latency_us}
    given = [f for f, v in rail_flags.items() if v is not None]
    if flags.network != "rail":
        if given:
            raise UserError(given[0], "applies to rail-optimised networks only", "add --network rail, or drop it")
        return {"kind": S("nonblocking", "flag --network (default): a non-blocking switch"),
                "latency_us": _pick(flags.network_latency_us, "--network-latency-us", dflt["latency_us"]["network"])}
    if flags.nodes < 2:
        raise UserError("--network", "a rail-optimised network joins nodes; --nodes is 1", "add --nodes N (N ≥ 2)")
    if flags.cross_rail == "pxn":
        spine = [f for f in ("--spine-oversubscription", "--spine-latency-us") if rail_flags[f] is not None]
        if spine:
            raise UserError(spine[0], "applies to cross-rail traffic through the spine; PXN never touches it",
                            "drop it, or use --cross-rail spine")
    return {"kind": S("rail", "flag --network: NIC k of every node on leaf switch k"),
            "latency_us": _pick(flags.network_latency_us, "--network-latency-us", dflt["latency_us"]["network"]),
            "cross_rail": S(flags.cross_rail or "spine", "flag --cross-rail" if flags.cross_rail else
                            "default: cross-rail traffic through the spine (pxn: an NVLink hop to the right rail)"),
            "spine_oversubscription": S(flags.spine_oversubscription or 1.0, "flag --spine-oversubscription"
                                        if flags.spine_oversubscription else "default: a non-blocking spine"),
            "spine_latency_us": S(flags.spine_latency_us or 0.0, "flag --spine-latency-us"
                                  if flags.spine_latency_us is not None else "default: no extra spine latency")}


def _describe(d: NodeDump, lay: Layout, nics: dict | None) -> str:
    fabric = (f"NVSwitch (NV{lay.nvlinks} every pair)" if lay.nvlinks else
              f"PCIe, {lay.sockets} socket(s) x {lay.switches_per_socket} switch(es)")
    rails = f", {len(lay.rails)} rail NIC(s)" if nics is not None else ""
    return f"imported from {d.source}: {d.gpus} GPUs on {fabric}{rails}"


def _fabric(lay: Layout, d: NodeDump, flags: ImportFlags, model: dict | None, dflt: dict) -> dict:
    lat = dflt["latency_us"]
    if lay.nvlinks:
        per = _nvlink_rate(flags, d, model, dflt)
        return {"kind": S("nvswitch", f"{d.source}: every GPU pair NV{lay.nvlinks} (NVSwitch all-to-all)"),
                "port": {"usable_GBps": S(round(lay.nvlinks * per.value, 6), f"{lay.nvlinks} NVLinks ({d.source}) x "
                                          f"{per.value} GB/s per link ({per.note})"),
                         "latency_us": _cited(lat["nvlink"])}}
    pcie = _pcie_rate(flags, d, model, dflt)
    return {"kind": S("pcie", f"{d.source}: no NVLink between the GPUs"),
            "sockets": S(lay.sockets, f"{d.source}: GPU groups joined by PIX/PXB/PHB/NODE, SYS between"),
            "switches_per_socket": S(lay.switches_per_socket, f"{d.source}: GPU groups joined by PIX/PXB"),
            "gpu_link": {"usable_GBps": pcie, "latency_us": _cited(lat["pcie"])},
            "uplink": {"usable_GBps": S(pcie.value, "switch <-> root complex: as the GPU link"),
                       "latency_us": _cited(lat["pcie"])},
            "socket_link": {"usable_GBps": _pick(flags.socket_GBps, "--socket-GBps", dflt["socket_GBps"]),
                            "latency_us": _cited(lat["socket"])}}


def _nics(lay: Layout, d: NodeDump, flags: ImportFlags, dflt: dict, pcie, notes: list[str]) -> dict | None:
    if not lay.rails:
        return None
    names = ", ".join(n.name for n in lay.rails)
    speeds = {n.speed_Mbps for n in lay.rails}
    lat = _pick(flags.nic_latency_us, "--nic-latency-us", dflt["latency_us"]["nic_port"])
    if flags.nic_GBps is not None:
        port, usable = {"usable_GBps": S(flags.nic_GBps, "flag --nic-GBps")}, flags.nic_GBps
    elif None not in speeds and len(speeds) == 1:
        speed = speeds.pop()
        eff = _cited(dflt["nic_efficiency"])
        port = {"nominal_GBps": S(speed / 8000, f"{d.xml}: net speed {speed:g} Mb/s"), "efficiency": eff}
        usable = round(speed / 8000 * eff.value, 6)
    elif flags.nodes > 1:
        raise UserError("--nic-GBps", f"{d.source} does not give the speed of NICs {names}", "give --nic-GBps "
                        "(usable GB/s per NIC port, e.g. 45 for 400 Gb/s) or add --nccl-xml")
    else:
        notes.append(f"nics not written ({d.source} gives no NIC speed): give --nic-GBps for --gpus beyond one node")
        return None
    per = d.gpus // len(lay.rails)
    link = pcie()
    return {"count": S(len(lay.rails), f"{d.source}: {names}, each GPU's nearest NIC ({lay.rail_path} at "
                       f"worst), {per} GPU(s) per NIC"),
            "gpu_link": {"usable_GBps": S(link.value, f"the GPU's PCIe link ({link.note})"),
                         "latency_us": _cited(dflt["latency_us"]["nic_pcie"])},
            "port": {**port, "latency_us": lat},
            "per_flow_GBps": _pick(flags.per_flow_GBps, "--per-flow-GBps", {
                "value": usable, "source": "one flow can fill a NIC (assumed, as the shipped files)"}),
            "node_aggregate_GBps": _pick(flags.node_aggregate_GBps, "--node-aggregate-GBps",
                                         {"value": round(len(lay.rails) * usable, 6), "source": f"{len(lay.rails)} "
                                          f"NICs x {usable:g} GB/s (non-blocking rails, assumed)"})}


def _nvlink_rate(flags: ImportFlags, d: NodeDump, model: dict | None, dflt: dict) -> S:
    if flags.nvlink_GBps is not None:
        return S(flags.nvlink_GBps, "flag --nvlink-GBps")
    sm, where = (d.sm, d.xml) if d.sm else (model["sm"], f"--gpu-model {model['name']}") if model else (None, "")
    entry = dflt["nvlink_GBps_per_link"].get(sm)
    if entry is None:
        raise UserError("--nvlink-GBps", f"no NVLink rate known for {f'sm {sm}' if sm else 'this GPU'}",
                        "give --nvlink-GBps (usable GB/s per link and direction) or --gpu-model")
    return S(entry["value"], f"{entry['source']}; sm {sm} from {where}")


def _pcie_rate(flags: ImportFlags, d: NodeDump, model: dict | None, dflt: dict) -> S:
    if flags.pcie_GBps is not None:
        return S(flags.pcie_GBps, "flag --pcie-GBps")
    gen, where = ((d.pcie_gen, f"{d.xml} link_speed") if d.pcie_gen else
                  (model["pcie_gen"], f"--gpu-model {model['name']}: {model['source']}") if model else (None, ""))
    entry = dflt["pcie_x16_GBps"].get(gen)
    if entry is None:
        raise UserError("--pcie-GBps", f"no PCIe rate known for {f'Gen{gen}' if gen else 'this GPU'}",
                        "give --pcie-GBps (usable GB/s per direction) or --gpu-model, or add --nccl-xml")
    return S(entry["value"], f"PCIe Gen{gen} x16 from {where}; {entry['source']}")


def _device(flags: ImportFlags, model: dict | None) -> dict:
    """The device block of a topology (--device-from, or --gpu-model's shipped file) with that file's sources."""
    from meshplan.model.topology import Topology

    if flags.device_from and flags.gpu_model:
        raise UserError("--device-from", "--gpu-model and --device-from both say where the device comes from",
                        "give one of them")
    src = flags.device_from or (model["device_from"] if model else None)
    if src is None:
        raise UserError("--gpu-model", "the dumps do not give the device's peaks, memory and kernel table",
                        f"give --gpu-model ({', '.join(_defaults()['gpu_models'])}) or --device-from TOPO")
    try:
        topo = Topology.load(src)
    except UserError as err:
        raise UserError("--device-from" if flags.device_from else "--gpu-model", err.problem, err.fix) from None
    how = f"--device-from {flags.device_from}" if flags.device_from else f"--gpu-model {model['name']}"
    origin = Path(topo.source).name
    notes_of = comments(Path(topo.source).read_text())
    out = {}
    for key, value in topo.file_spec.node.device.model_dump(exclude_none=True).items():
        if key == "kernel" and Path(value).suffix in (".yaml", ".yml") and not Path(value).is_absolute():
            value = str((Path(topo.source).parent / value).resolve())      # a path: keep it valid from anywhere
        out[key] = S(value, f"{origin} ({how})" + (f": {notes_of[key]}" if key in notes_of else ""))
    return out


def _model(name: str | None, d: NodeDump) -> dict | None:
    if name is None:
        return None
    models = {k.lower(): (k, v) for k, v in _defaults()["gpu_models"].items()}
    if name.lower() not in models:
        choices = ", ".join(k for k, _ in models.values())
        raise UserError("--gpu-model", f"unknown model {name!r}", f"use one of {choices} or --device-from TOPO")
    key, model = models[name.lower()]
    if d.sm and d.sm != model["sm"]:
        raise UserError("--gpu-model", f"{key} is sm {model['sm']} but {d.xml} says sm {d.sm}",
                        "give the model of the GPUs the dump was taken on")
    return {**model, "name": key}


def _defaults() -> dict:
    import yaml

    return yaml.safe_load(resources.files("meshplan").joinpath("data/topo_import.yaml").read_text())


def _cited(entry: dict) -> S:
    return S(entry["value"], entry["source"])


def _pick(flag_value, flag: str, entry: dict) -> S:
    return S(flag_value, f"flag {flag}") if flag_value is not None else _cited(entry)


def write_topology(result: Imported, out: str | Path, force: bool) -> Path:
    """Write the file atomically; an existing file only with ``force``."""
    from meshplan.core.fileio import write_atomic

    out = Path(out)
    if out.exists() and not force:
        raise UserError("--out", f"{out} exists", "pass --force to replace it, or choose another --out")
    return write_atomic(out, result.text.encode())
