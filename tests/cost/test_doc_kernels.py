"""Compute ops under a document mask against hand-computed prices: FlashAttention's tiles on a GPU table, one
kernel per segment on the CPU table, and masks without documents untouched."""

import pytest

from meshplan.cost.cost import CostModel
from meshplan.cost.doc_kernels import DocKernels
from meshplan.model.matrix import attn_matrix
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve


def _two_docs():
    """Two documents of 512 tokens cut per document over 2 ranks (contiguous): chunk i holds piece i of each, 256
    tokens; block (0, 0) is one causal square per document, block (1, 0) one full 256 x 256 rectangle each."""
    w = resolve(seq_len=1024, heads=4, kv_heads=4, head_dim=128, mask="docs:512,512", layout="contiguous",
                dtype="bf16")
    return w, attn_matrix(w, 2)


def test_varlen_blocks_are_their_tiles():
    w, m = _two_docs()
    topo = Topology.load("h100x8", gpus=2)
    cm = CostModel(topo)
    k = cm.kernel
    assert k.tile("fwd") == (128, 64)
    fixed, scaled = DocKernels(cm, m).block_parts("fwd")
    flop = 4.0 * w.batch * w.n_heads * w.head_dim / topo.peak_flops("bf16")
    # causal square of 256 at 128 x 64: row tile 0 sees 128 keys (2 tiles), row tile 1 all 256 (4): 6 tiles
    diag = 2 * 6 * 128 * 64 * flop / k.efficiency(512, 512, "fwd", True, 128, dtype="bf16")
    rect = 2 * 8 * 128 * 64 * flop / k.efficiency(512, 512, "fwd", False, 128, dtype="bf16")
    assert scaled[0] == pytest.approx(float(diag))
    assert scaled[2] == pytest.approx(float(rect))            # block (1, 0)
    assert scaled[1] == 0 and fixed[1] == 0                    # block (0, 1): nothing permitted
    assert fixed[0] == pytest.approx(k.launch_s + 2 * k.spec.segment_us * 1e-6)


def test_per_call_blocks_are_one_kernel_per_segment():
    w, m = _two_docs()
    topo = Topology.load("cpu-local", gpus=2)
    cm = CostModel(topo)
    k = cm.kernel
    assert k.spec.segments == "per_call"
    fixed, scaled = DocKernels(cm, m).block_parts("bwd")
    flop = 2.5 * 4.0 * w.batch * w.n_heads * w.head_dim / topo.peak_flops("bf16")
    diag = 2 * (256 * 257 // 2) * flop / k.efficiency(256, 256, "bwd", True, 128, dtype="bf16")
    assert scaled[0] == pytest.approx(float(diag))
    assert fixed[0] == pytest.approx(2 * (k.launch_s + k.spec.segment_us * 1e-6))


def test_masks_without_documents_keep_their_prices(monkeypatch):
    """A causal workload never reaches the document path: its op durations are those of the block shapes."""
    from meshplan.search.candidate import predict

    called = []
    monkeypatch.setattr(CostModel, "_doc_compute", lambda self, s, d: called.append(1))
    w = resolve(seq_len=8192, heads=8, kv_heads=8, mask="causal")
    cand = predict("ring", w, Topology.load("h100x8", gpus=4), 4, {})
    assert not called and cand.predicted.makespan_s > 0


def test_short_documents_cost_ring_more_than_their_pairs(monkeypatch):
    """Per-document zigzag Ring over 64 documents of 48 tokens: every piece (6 tokens) computes a whole tile, so
    Ring's compute priced per segment is about twice its block-shape price; Ulysses, which sees whole documents,
    barely moves (1.13x)."""
    from meshplan.search.candidate import predict

    w = resolve(seq_len=48 * 64, heads=8, kv_heads=8, mask="docs:" + ",".join(["48"] * 64), passes="fwd")
    topo = Topology.load("h100x8", gpus=4)
    import meshplan.cost.cost as cost_module

    ratio = {}
    for algo in ("ring", "ulysses"):
        new = predict(algo, w, topo, 4, {}).predicted.passes["fwd"].compute_s
        with monkeypatch.context() as patch:        # the block-shape price: no document pricing at all
            patch.setattr(cost_module, "priced_by_cover", lambda *a: False)
            old = predict(algo, w, topo, 4, {}).predicted.passes["fwd"].compute_s
        ratio[algo] = new / old
    assert ratio["ring"] > 1.5 * ratio["ulysses"]
    assert 1.0 <= ratio["ulysses"] < 1.3


def _shape(p):
    return (p.r1 - p.r0, p.c1 - p.c0, p.causal, p.anti)


@pytest.mark.parametrize("algo, layout, mask", [
    ("usp", "striped", "docs:300,41,500,77,130,20,900,80"), ("usp", "zigzag", "docs:300,41,500,77,130,20,900,80"),
    ("ulysses", "contiguous", "window:256"), ("usp", "striped", "window:300"), ("mesh", "zigzag", "window:200")])
def test_the_model_prices_the_cover_the_executor_runs(algo, layout, mask):
    """Every compute op over several chunks: the cover the model prices (:func:`op_cover`) is the one the executor
    decides on (position order, or block by block when that costs less): the same kernels, kernel for kernel (their
    shapes and kinds, which is what they are priced by; the executor's rows skip those no key is permitted to)."""
    from meshplan.cost.doc_kernels import op_cover
    from meshplan.executor.ops import OpRunner
    from meshplan.executor.program import program_of
    from meshplan.executor.store import Store
    from meshplan.model.blockmask import rows_overlap
    from meshplan.search.candidate import predict

    torch = pytest.importorskip("torch")
    w = resolve(seq_len=2048, heads=4, kv_heads=4, head_dim=16, mask=mask, layout=layout, dtype="fp32",
                passes="fwd", doc_layout="packed" if mask.startswith("docs") else "per-doc")
    sched = predict(algo, w, Topology.load("cpu-local", gpus=4), 4, {}).schedule
    prog, m = program_of(sched), attn_matrix(w, sched.n_chunks)
    runner, checked = OpRunner(prog, Store(torch.device("cpu")), 0.25), 0
    for op in prog.ops_of(0, "fwd"):
        if op.kind != "compute" or len(op.q_chunks) * len(op.kv_chunks) == 1:
            continue
        q_pos, k_pos = prog.tokens_of("q", op.q_chunks), prog.tokens_of("kv", op.kv_chunks)
        _, _, allowed, *_ = runner._layout(op, q_pos, k_pos)
        model, ran = op_cover(m, tuple(op.q_chunks), tuple(op.kv_chunks)), allowed.kernels
        assert sorted(map(_shape, model)) == sorted(map(_shape, ran))      # the op's rows may skip keyless rows
        assert rows_overlap(model) == rows_overlap(ran)
        checked += 1
    assert checked
