"""``meshplan topo import``: sample dumps give the expected fabric, routes and rails; bad dumps exit 2 cleanly.

The samples under tests/data/topo/ are hand-written in the tools' formats (README.md there). Where the shipped
topology describes the same machine (dgx-h100, l20x8) the imported routes are compared with its routes.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from meshplan.cli.app import app
from meshplan.core.errors import UserError
from meshplan.model.topology import LINK_CLASSES, Topology
from meshplan.model.topology_spec import TopologySpec
from meshplan.topo_import.dumps import parse_nvidia_smi
from meshplan.topo_import.importer import ImportFlags, import_topology
from meshplan.topo_import.layout import node_layout, read_dumps
from meshplan.topo_import.yaml_text import dump_spec, validate

DATA = Path(__file__).resolve().parents[1] / "data" / "topo"
DGX_SMI, DGX_XML = str(DATA / "dgx-h100.nvidia-smi.txt"), str(DATA / "dgx-h100.nccl-topo.xml")
L20_SMI, L20_XML = str(DATA / "l20x8-pcie.nvidia-smi.txt"), str(DATA / "l20x8-pcie.nccl-topo.xml")
runner = CliRunner()


def imported(name: str = "t", **flags) -> Topology:
    return Topology(import_topology(ImportFlags(**flags), name).spec)


def classes(t: Topology, a: int, b: int) -> list[str]:
    return [LINK_CLASSES[c] for c in t.link_class[t.route(a, b)]]


def vertices(t: Topology, a: int, b: int) -> list[str]:
    return [t.link_name(x).split(" -> ")[0] for x in t.route(a, b)] + [t.device_vertex[b]]


def one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    err = result.stderr.strip()
    assert err.count("\n") == 0 and err.startswith("error:") and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


def smi_text(cells: list[list[str]]) -> str:
    """A tab-separated `nvidia-smi topo -m` matrix of GPUs only, from its GPU x GPU cells."""
    n = len(cells)
    lines = ["\t" + "\t".join([f"GPU{i}" for i in range(n)] + ["CPU Affinity", "NUMA Affinity"])]
    lines += ["\t".join([f"GPU{i}"] + row + ["0-7", "0"]) for i, row in enumerate(cells)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ DGX-like node
def test_dgx_nvidia_smi_gives_an_nvswitch_node_with_rails():
    t = imported(nvidia_smi=DGX_SMI, gpu_model="H100-SXM", nic_GBps=45.0)
    assert t.spec.node.fabric.kind == "nvswitch" and t.spec.node.gpus == 8
    assert t.spec.node.fabric.port.bytes_per_s == pytest.approx(18 * 20.6e9, rel=1e-12)   # NV18 x NCCL SM90 rate
    for a in range(8):
        for b in range(8):
            if a != b:
                assert classes(t, a, b) == ["nvlink", "nvlink"]
    lat, bw = t.pair_stats(*np.nonzero(~np.eye(8, dtype=bool)))
    assert np.all(bw == pytest.approx(370.8e9, rel=1e-12))
    lay = node_layout(*read_dumps(DGX_SMI, None))
    assert [n.name for n in lay.rails] == [f"mlx5_{k}" for k in range(8)] and lay.rail_path == "PXB"
    assert lay.left_out == ("mlx5_8", "mlx5_9")                      # the storage ports are nearest to no GPU
    t16 = Topology(t.spec, 16)
    for k in range(8):                                               # GPU k leaves the node through its rail NIC k
        assert vertices(t16, k, 8 + k)[:2] == [f"n0/gpu{k}", f"n0/nic{k}"]
        assert classes(t16, k, 8 + k) == ["pcie", "net", "net", "net", "net", "pcie"]


def test_dgx_xml_agrees_with_nvidia_smi_and_with_the_shipped_dgx_h100():
    smi, xml = node_layout(*read_dumps(DGX_SMI, None)), node_layout(*read_dumps(None, DGX_XML))
    both = node_layout(*read_dumps(DGX_SMI, DGX_XML))
    for lay in (xml, both):
        assert (lay.nvlinks, lay.rail_path[:1], [n.name for n in lay.rails]) == (18, "P", [n.name for n in smi.rails])
    ours = imported(nvidia_smi=DGX_SMI, nccl_xml=DGX_XML, gpu_model="H100-SXM", nodes=2)   # NIC speed from the XML
    shipped = Topology.load("dgx-h100", 16)
    assert ours.n_devices == 16 and ours.spec.node.fabric == shipped.spec.node.fabric
    src, dst = np.meshgrid(np.arange(16), np.arange(16))
    for got, want in zip(ours.pair_stats(src, dst), shipped.pair_stats(src, dst)):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    for a, b in ((0, 1), (0, 7), (0, 8), (3, 12)):
        assert vertices(ours, a, b) == vertices(shipped, a, b)
    assert ours.spec.overlap_kappa == shipped.spec.overlap_kappa


@pytest.mark.parametrize("cross", ["spine", "pxn"])
def test_rail_flags_give_the_shipped_rail_fabric(cross):
    """--network rail with the shipped file's spine numbers routes 32 GPUs exactly as dgx-h100-rail (cross-rail
    through the spine, or PXN: an NVLink hop to the destination's rail first)."""
    spine = dict(spine_oversubscription=2.0, spine_latency_us=1.0) if cross == "spine" else {}
    ours = imported(nvidia_smi=DGX_SMI, nccl_xml=DGX_XML, gpu_model="H100-SXM", nodes=4, network="rail",
                    cross_rail=cross, **spine)
    spec = Topology.load("dgx-h100-rail").file_spec
    shipped = Topology(spec.model_copy(update={"network": spec.network.model_copy(update={"cross_rail": cross})}), 32)
    assert (ours.spec.network == shipped.spec.network) == (cross == "spine")     # PXN: no spine numbers
    assert (ours.spec.network.kind, ours.spec.network.cross_rail) == ("rail", cross)
    src, dst = np.meshgrid(np.arange(32), np.arange(32))
    for got, want in zip(ours.pair_stats(src, dst), shipped.pair_stats(src, dst)):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    for a, b in ((0, 8), (0, 9), (3, 30)):
        assert vertices(ours, a, b) == vertices(shipped, a, b)
    assert ("n0/gpu1" in vertices(ours, 0, 9)) == (cross == "pxn")


def test_rail_flags_are_checked():
    base = ["topo", "import", "--nvidia-smi", DGX_SMI, "--gpu-model", "H100-SXM", "--nic-GBps", "45", "--out"]
    r = runner.invoke(app, base + ["x.yaml", "--cross-rail", "pxn"])
    one_line_error(r, "--cross-rail", "add --network rail")
    r = runner.invoke(app, base + ["x.yaml", "--network", "rail"])
    one_line_error(r, "--network", "--nodes N")
    r = runner.invoke(app, base + ["x.yaml", "--network", "ring"])
    one_line_error(r, "--network", "nonblocking, rail")
    r = runner.invoke(app, base + ["x.yaml", "--nodes", "2", "--network", "rail", "--cross-rail", "pxn",
                                   "--spine-oversubscription", "2"])
    one_line_error(r, "--spine-oversubscription", "PXN never touches it")
    pcie = ["topo", "import", "--nvidia-smi", L20_SMI, "--nccl-xml", L20_XML, "--gpu-model", "L20", "--nodes", "2",
            "--network", "rail", "--cross-rail", "pxn", "--out", "x.yaml"]
    one_line_error(runner.invoke(app, pcie), "--cross-rail", "over NVLink", "--cross-rail spine")
    assert not Path("x.yaml").exists()


# ------------------------------------------------------------------------------------------ PCIe box
@pytest.mark.parametrize("dump", [{"nvidia_smi": L20_SMI}, {"nccl_xml": L20_XML}, {"nvidia_smi": L20_SMI,
                                                                                     "nccl_xml": L20_XML}])
def test_pcie_box_gives_switches_and_two_sockets_like_l20x8(dump):
    t = imported(gpu_model="L20", **dump)
    fab = t.spec.node.fabric
    assert (fab.kind, fab.sockets, fab.switches_per_socket) == ("pcie", 2, 2)
    shipped = Topology.load("l20x8")
    assert t.domain_of_device.tolist() == shipped.domain_of_device.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    for a, b in ((0, 1), (0, 2), (0, 4), (0, 7), (5, 6)):
        assert vertices(t, a, b) == vertices(shipped, a, b), (a, b)
        assert classes(t, a, b) == classes(shipped, a, b)
    assert classes(t, 0, 1) == ["pcie", "pcie"]                                         # via the shared switch
    assert classes(t, 0, 7) == ["pcie", "pcie", "socket", "pcie", "pcie"]               # across the sockets
    assert t.route_bandwidth(0, 1) == shipped.route_bandwidth(0, 1) == pytest.approx(24e9)   # Gen4 x16 usable
    # l20x8 caps one cross-socket flow at CHARM+'s measured 14.7 GB/s; the import knows only the 22 GB/s UPI link
    assert t.route_bandwidth(0, 7) == pytest.approx(22e9) and shipped.route_bandwidth(0, 7) == pytest.approx(14.7e9)


def test_pcie_box_nics_follow_the_sockets():
    t = imported(nvidia_smi=L20_SMI, gpu_model="L20", nic_GBps=23.0, nodes=2)
    assert t.spec.node.nics.count == 2 and t.n_devices == 16
    for g in range(8):
        assert vertices(t, g, 8 + g)[1] == f"n0/nic{g // 4}"


# ------------------------------------------------------------------------------------------ the file
@pytest.mark.parametrize("flags", [dict(nvidia_smi=DGX_SMI, nccl_xml=DGX_XML, gpu_model="H100-SXM", nodes=2),
                                   dict(nvidia_smi=L20_SMI, device_from="l20x8", pcie_GBps=24.0)])
def test_written_file_loads_and_round_trips(tmp_path, flags):
    res = import_topology(ImportFlags(**flags), "rt")
    path = tmp_path / "rt.yaml"
    path.write_text(res.text)
    loaded = Topology.load(str(path))
    assert loaded.spec == res.spec
    again = TopologySpec.model_validate(yaml.safe_load(dump_spec(loaded.spec)))        # load -> dump -> load
    assert again == loaded.spec and Topology(again).content_hash == loaded.content_hash
    assert validate(dump_spec(again)) == again
    assert import_topology(ImportFlags(**flags), "rt").text == res.text                  # deterministic
    for line in res.text.splitlines():                                                    # a source per value
        if not line.startswith("#") and not line.rstrip().endswith(":"):
            assert re.search(r"\s#\s\S", line), line


def test_cli_writes_atomically_and_refuses_to_overwrite(tmp_path, monkeypatch):
    out = tmp_path / "dgx.yaml"
    args = ["topo", "import", "--nvidia-smi", DGX_SMI, "--gpu-model", "H100-SXM", "--out", str(out), "--json"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.stderr
    assert '"out"' in r.stdout and Topology.load(str(out)).spec.node.fabric.kind == "nvswitch"
    before = out.read_text()
    one_line_error(runner.invoke(app, args), "--out", "--force")
    assert out.read_text() == before
    import meshplan.core.fileio as fileio

    def fail(*_):
        raise OSError("disk full")
    monkeypatch.setattr(fileio.os, "replace", fail)                   # the rename fails: nothing half-written
    fresh = tmp_path / "fresh.yaml"
    r = runner.invoke(app, args[:-2] + [str(fresh)])
    one_line_error(r, "fresh.yaml", "cannot write it")                # one line, exit 2: no OSError traceback
    assert not fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dgx.yaml"]
    monkeypatch.undo()
    assert runner.invoke(app, args + ["--force", "--name", "other"]).exit_code == 0
    assert "name: other" in out.read_text()


# ------------------------------------------------------------------------------------------ bad input
def _without_one_cell(path: str) -> str:
    lines = Path(path).read_text().splitlines()
    row = lines[3].split("\t")
    del row[12]                                   # GPU2's NIC3 cell
    lines[3] = "\t".join(row)
    return "\n".join(lines) + "\n"


BAD = [
    ("--nvidia-smi", "garbage.txt", lambda: "Tue Mar 3 12:00:00 2026\nno devices were found\n",
     ["--nvidia-smi garbage.txt", "expected a header line of columns GPU0 GPU1"]),
    ("--nvidia-smi", "short.txt", lambda: _without_one_cell(DGX_SMI),
     ["row GPU2, column NIC9", "expected PIX, PXB, PHB, NODE or SYS", "0-55,112-167"]),
    ("--nccl-xml", "pom.xml", lambda: '<?xml version="1.0"?>\n<project><modelVersion>4.0.0</modelVersion></project>\n',
     ["--nccl-xml pom.xml", "root <project>", "expected NCCL's <system>"]),
    ("--nccl-xml", "dtd.xml", lambda: '<!DOCTYPE system [<!ENTITY e "x">]>\n' + Path(DGX_XML).read_text(),
     ["DOCTYPE", "expected a plain NCCL topology dump"]),
    ("--nccl-xml", "cut.xml", lambda: Path(DGX_XML).read_text()[:600], ["not well-formed XML", "line"]),
    ("--nccl-xml", "nogpu.xml", lambda: '<system version="1"><cpu numaid="0"/></system>', ["no <gpu>"]),
]


@pytest.mark.parametrize("flag, name, text, needles", BAD, ids=[b[1] for b in BAD])
def test_malformed_dumps_exit_2_with_one_line_and_write_nothing(tmp_path, flag, name, text, needles):
    dump = tmp_path / name
    dump.write_text(text())
    out = tmp_path / "out.yaml"
    one_line_error(runner.invoke(app, ["topo", "import", flag, str(dump), "--gpu-model", "H100-SXM",
                                       "--out", str(out)]), *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_nodes_the_format_cannot_express_are_refused(tmp_path):
    partial = [["X", "NV4", "SYS", "SYS"], ["NV4", "X", "SYS", "SYS"], ["SYS", "SYS", "X", "NV4"],
               ["SYS", "SYS", "NV4", "X"]]
    interleaved = [["X", "NODE", "PIX", "NODE"], ["NODE", "X", "NODE", "PIX"], ["PIX", "NODE", "X", "NODE"],
                   ["NODE", "PIX", "NODE", "X"]]
    asymmetric = [["X", "PIX"], ["NODE", "X"]]
    cases = [(partial, "the same NV# for every GPU pair"), (interleaved, "GPU0, GPU2 share a PCIe switch"),
             (asymmetric, "expected a symmetric GPU matrix")]
    for cells, needle in cases:
        path = tmp_path / "m.txt"
        path.write_text(smi_text(cells))
        with pytest.raises(UserError, match=re.escape(needle)):
            import_topology(ImportFlags(nvidia_smi=str(path), gpu_model="L20"), "x")


def test_flags_and_dumps_are_cross_checked():
    with pytest.raises(UserError, match="expected dumps of one node"):
        read_dumps(L20_SMI, DGX_XML)
    with pytest.raises(UserError, match="L20 is sm 89 but dgx-h100.nccl-topo.xml says sm 90"):
        import_topology(ImportFlags(nccl_xml=DGX_XML, gpu_model="L20"), "x")
    with pytest.raises(UserError, match="--gpu-model.*H100-SXM"):
        import_topology(ImportFlags(nvidia_smi=DGX_SMI), "x")
    with pytest.raises(UserError, match="--nic-GBps"):
        import_topology(ImportFlags(nvidia_smi=DGX_SMI, gpu_model="H100-SXM", nodes=2), "x")
    res = import_topology(ImportFlags(nvidia_smi=DGX_SMI, gpu_model="H100-SXM"), "x")   # one node: NICs optional
    assert res.spec.node.nics is None and any("--nic-GBps" in n for n in res.notes)


def test_terminal_escapes_and_expanded_tabs_parse_alike():
    dgx = read_dumps(DGX_SMI, None)[0]
    head, rest = Path(DGX_SMI).read_text().split("\n", 1)
    escaped = parse_nvidia_smi("\t\x1b[4m" + head.strip("\t") + "\x1b[0m\n" + rest, "esc.txt")   # a terminal's
    assert (escaped.nvlinks, escaped.path, escaped.numa, escaped.nics) == (dgx.nvlinks, dgx.path, dgx.numa, dgx.nics)
    spaced = read_dumps(L20_SMI, None)[0]                                        # tabs expanded to spaces
    tabbed = parse_nvidia_smi("\n".join(re.sub(r"\s{2,}", "\t", ln) for ln in Path(L20_SMI).read_text().splitlines()),
                              "tabs.txt")
    assert (spaced.path, spaced.numa, spaced.nics) == (tabbed.path, tabbed.numa, tabbed.nics)
    assert spaced.numa == (0, 0, 0, 0, 1, 1, 1, 1) and [n.name for n in spaced.nics] == ["mlx5_0", "mlx5_1"]
