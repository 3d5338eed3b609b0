"""Shared fixtures: tiny hand-computable topologies and workloads."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).parent / "data"


def unit_topology(gpus: int, *, port_Bps: float = 16.0, kappa: float = 0.0, kind: str = "nvswitch",
                  shared_Bps: float = 16.0, cores: int = 1, transfer_kappa: float = 0.0,
                  transfer_cpu_s_per_byte: float = 0.0):
    """A toy cluster: blocks of the ``unit_workload`` take 1 s; links carry ``port_Bps`` bytes/s; on ``loopback``
    ranks share ``cores`` and a byte moved takes ``transfer_cpu_s_per_byte`` core-seconds of them."""
    from meshplan.model.topology import Topology
    from meshplan.model.topology_spec import TopologySpec

    device = {"model": "unit", "peak_bf16_tflops": 64e-12, "peak_fp32_tflops": 64e-12, "memory_GB": 1,
              "hbm_GBps": 1e9, "kernel": str(DATA / "kernel-flat.yaml")}
    link = {"usable_GBps": port_Bps * 1e-9, "latency_us": 0}
    if kind == "nvswitch":
        node = {"gpus": gpus, "device": device, "fabric": {"kind": "nvswitch", "port": link}}
    else:
        node = {"max_ranks": 8, "device": device, "compute_pool": {"cores": cores},
                "fabric": {"kind": "loopback", "link": link, "shared_GBps": shared_Bps * 1e-9}}
    spec = TopologySpec.model_validate({"name": f"unit-{kind}", "nodes": 1, "node": node, "p2p_overhead_us": 0,
                                        "overlap_kappa": {"nvlink": kappa, "loopback": kappa},
                                        "transfer_kappa": {"nvlink": transfer_kappa, "loopback": transfer_kappa},
                                        "transfer_cpu_us_per_MB": {"loopback": transfer_cpu_s_per_byte * 1e12}})
    return Topology(spec, gpus)


def unit_workload(n: int, passes: str = "fwd", mask: str = "full", layout: str = "contiguous"):
    """B = H = Hkv = D = 1, S = 4N tokens, bf16: a full block has 16 pairs = 64 FLOP; a KV chunk is 16 B."""
    from meshplan.model.workload import Mask, Workload

    return Workload(batch=1, seq_len=4 * n, n_heads=1, n_kv_heads=1, head_dim=1, dtype="bf16",
                    mask=Mask.parse(mask), layout=layout, passes=passes)
