"""``meshplan topo import``: the typer command; the work is :func:`meshplan.topo_import.importer.import_topology`.

Prints what was written as ``topo show`` does (a table, or ``--json``), notes on stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from meshplan.cli import options as o
from meshplan.show.console import out_console

_NET = "Network (the dumps do not see it)"


def _choice(*values: str):
    def check(value: str | None) -> str | None:
        if value is not None and value not in values:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(values)}")
        return value
    return check


def _positive(value: float | None) -> float | None:
    if value is not None and value <= 0:
        raise typer.BadParameter(f"{value} is not > 0")
    return value


def _opt(flag: str, help: str, positive: bool = True):
    if positive:
        return typer.Option(flag, help=f"{help} (> 0)", callback=_positive, rich_help_panel="Numbers the dumps lack")
    return typer.Option(flag, help=help, min=0.0, rich_help_panel="Numbers the dumps lack")


NvidiaSmi = Annotated[Optional[str], typer.Option("--nvidia-smi", help="`nvidia-smi topo -m` output saved to a file")]
NcclXml = Annotated[Optional[str], typer.Option("--nccl-xml", help="NCCL's topology dump (NCCL_TOPO_DUMP_FILE=FILE)")]
OutYaml = Annotated[str, typer.Option("--out", help="the topology YAML to write (atomically)")]
Force = Annotated[bool, typer.Option("--force", help="replace --out if it exists")]
Nodes = Annotated[int, typer.Option("--nodes", min=1, help="node count of the cluster")]
GpuModel = Annotated[Optional[str], typer.Option("--gpu-model", help="H100-SXM, H200-SXM, H20, A100-SXM, L20: device "
                                                 "block and default rates")]
DeviceFrom = Annotated[Optional[str], typer.Option("--device-from", help="copy the device block of this topology "
                                                   "(path or shipped name)")]
Name = Annotated[Optional[str], typer.Option("--name", help="topology name (default: --out's stem)")]
Network = Annotated[str, typer.Option("--network", help="nonblocking | rail (NIC k of every node on leaf k)",
                                      callback=_choice("nonblocking", "rail"), rich_help_panel=_NET)]
CrossRail = Annotated[Optional[str], typer.Option("--cross-rail", help="rail: spine | pxn (an NVLink hop to the "
                                                  "destination's rail first)", callback=_choice("spine", "pxn"),
                                                  rich_help_panel=_NET)]
SpineOversubscription = Annotated[Optional[float], typer.Option(
    "--spine-oversubscription", min=1.0, help="rail: leaf downlink / uplink (1: non-blocking)", rich_help_panel=_NET)]
SpineLatency = Annotated[Optional[float], typer.Option(
    "--spine-latency-us", min=0.0, help="rail: extra latency through the spine", rich_help_panel=_NET)]
Rate = Optional[float]


def topo_import(
        nvidia_smi: NvidiaSmi = None, nccl_xml: NcclXml = None, out: OutYaml = ..., force: Force = False,
        nodes: Nodes = 1, gpu_model: GpuModel = None, device_from: DeviceFrom = None, name: Name = None,
        nvlink_gbps: Annotated[Rate, _opt("--nvlink-GBps", "usable GB/s per NVLink and direction")] = None,
        pcie_gbps: Annotated[Rate, _opt("--pcie-GBps", "usable GB/s of a GPU's PCIe link")] = None,
        socket_gbps: Annotated[Rate, _opt("--socket-GBps", "usable GB/s between sockets")] = None,
        nic_gbps: Annotated[Rate, _opt("--nic-GBps", "usable GB/s per NIC port")] = None,
        nic_latency_us: Annotated[Rate, _opt("--nic-latency-us", "NIC port latency", False)] = None,
        per_flow_gbps: Annotated[Rate, _opt("--per-flow-GBps", "most one flow reaches on a NIC")] = None,
        node_aggregate_gbps: Annotated[Rate, _opt("--node-aggregate-GBps", "all of a node's NICs together")] = None,
        network_latency_us: Annotated[Rate, _opt("--network-latency-us", "switch traversal", False)] = None,
        p2p_overhead_us: Annotated[Rate, _opt("--p2p-overhead-us", "software cost per message", False)] = None,
        network: Network = "nonblocking", cross_rail: CrossRail = None,
        spine_oversubscription: SpineOversubscription = None, spine_latency_us: SpineLatency = None,
        as_json: o.Json = False) -> None:
    """Build a topology YAML from `nvidia-smi topo -m` and/or an NCCL topology dump, plus flags."""
    from meshplan.core.errors import UserError
    from meshplan.topo_import.importer import ImportFlags, import_topology, write_topology

    if not out.endswith((".yaml", ".yml")):
        raise UserError("--out", f"{out!r} is not a .yaml file name", "give --out NAME.yaml")
    if Path(out).exists() and not force:
        raise UserError("--out", f"{out} exists", "pass --force to replace it, or choose another --out")
    flags = ImportFlags(nvidia_smi=nvidia_smi, nccl_xml=nccl_xml, nodes=nodes, gpu_model=gpu_model,
                        device_from=device_from, nvlink_GBps=nvlink_gbps, pcie_GBps=pcie_gbps, socket_GBps=socket_gbps,
                        nic_GBps=nic_gbps, nic_latency_us=nic_latency_us, per_flow_GBps=per_flow_gbps,
                        node_aggregate_GBps=node_aggregate_gbps, network_latency_us=network_latency_us,
                        p2p_overhead_us=p2p_overhead_us, network=network, cross_rail=cross_rail,
                        spine_oversubscription=spine_oversubscription, spine_latency_us=spine_latency_us)
    result = import_topology(flags, name or Path(out).stem)
    path = write_topology(result, out, force)
    from meshplan.cli.simulate import topology_info
    info = topology_info(str(path), None)
    for note in result.notes:
        sys.stderr.write(f"note: {note}\n")
    if as_json:
        sys.stdout.write(json.dumps({"out": str(path), "notes": list(result.notes), "topology": info}, indent=1) + "\n")
        return

    from meshplan.show.tables import print_topology
    console = out_console()
    console.print(f"wrote {path}")
    print_topology(info, console)
