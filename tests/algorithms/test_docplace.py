"""doc-place's document placement: work per document against closed forms, LPT against the brute-force optimum
(Graham's 4/3 bound), the token cap, split groups sized to the document, conservation under fuzzing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.algorithms.docplace.placement import document_work, place_documents
from meshplan.core.errors import UserError
from meshplan.model import doc_place
from meshplan.model.matrix import AttnMatrix
from meshplan.model.workload import Mask, Workload


def test_work_is_causal_pairs_with_unit_tiles():
    lens = np.array([1, 2, 7, 1000])
    assert document_work(lens).tolist() == (lens * (lens + 1) / 2).tolist()


@pytest.mark.parametrize("length,tiles", [(128, 1), (129, 3), (140, 3), (256, 3), (257, 6), (1, 1), (0, 0)])
def test_work_counts_whole_tiles_on_and_below_the_diagonal(length, tiles):
    # k = ceil(L / 128) row tiles; a causal staircase touches k (k + 1) / 2 tiles, each computed whole
    assert document_work([length], (128, 128))[0] == tiles * 128 * 128


def _brute_force_makespan(work: np.ndarray, m: int) -> float:
    best = np.inf
    for assign in itertools.product(range(m), repeat=len(work)):
        loads = np.bincount(assign, weights=work, minlength=m)
        best = min(best, loads.max())
    return best


@pytest.mark.parametrize("seed", range(12))
def test_lpt_within_grahams_bound_of_the_optimum(seed):
    rng = np.random.default_rng(seed)
    m = 3
    lens = rng.integers(20, 60, size=7)          # no document above the mean work: none is split
    got = place_documents(lens, m, token_cap=1e9)
    assert not got.groups
    opt = _brute_force_makespan(document_work(lens), m)
    assert got.rank_work.max() <= (4 / 3 - 1 / (3 * m)) * opt + 1e-9


def test_token_cap_moves_short_documents_off_the_light_rank():
    # one 99-token document (4,950 pairs) and 4,950 one-token documents (4,950 pairs, 4,950 tokens) on 2 ranks:
    # by work alone rank 1 would take every short document; the cap stops it at 1.25 x the mean tokens
    lens = [99] + [1] * 4950
    free = place_documents(lens, 2, token_cap=1e9)
    capped = place_documents(lens, 2)
    mean = sum(lens) / 2
    assert free.rank_tokens.max() > 1.25 * mean
    assert capped.cap_ok and capped.rank_tokens.max() <= 1.25 * mean + 1e-9
    assert capped.token_cap == pytest.approx(1.25 * mean)
    assert capped.rank_tokens.sum() == sum(lens)


def test_cap_that_cannot_be_met_is_reported():
    # two documents of 10 tokens on 2 ranks... with a third of 10: some rank holds 20 > 1.25 x 15
    got = place_documents([10, 10, 10], 2, token_cap=1.25)
    assert not got.cap_ok


def test_long_document_split_over_the_ranks_its_work_needs():
    lens = np.array([2000] + [250] * 64)
    work = lens * (lens + 1) / 2
    g = int(np.ceil(work[0] / (work.sum() / 8)))
    got = place_documents(lens, 8, token_cap=1e9)
    assert 1 < g < 8
    assert got.groups == {0: tuple(range(g))} and got.owner[0] == -1
    assert (got.owner[1:] >= 0).all()

def test_document_above_the_token_cap_is_split_by_its_tokens():
    # a 3,000-token slot with 10 real tokens: almost no work, but 3,000 > 1.25 x 5,000 / 4 tokens
    got = place_documents([10] + [250] * 8, 4, slots=[3000] + [250] * 8)
    assert got.groups == {0: (0, 1)}                 # ceil(3000 / 1562.5) = 2
    assert got.cap_ok


def test_group_sizes_round_to_the_ulysses_degree():
    from meshplan.algorithms.docplace.placement import _rounded

    sizes = np.array([1, 2, 3, 5, 8, 9, 347])
    assert _rounded(sizes, 8, 512).tolist() == [1, 2, 4, 8, 8, 16, 352]     # divisors of 8, then whole nodes
    assert _rounded(sizes, 8, 350).tolist() == [1, 2, 4, 8, 8, 16, 347]     # 352 would not fit 350 ranks
    assert _rounded(sizes, 1, 512).tolist() == sizes.tolist()


def test_split_group_stays_inside_a_node():
    lens = [3000, 3000] + [60] * 200                  # two long documents, each needing 2-3 ranks, 4 per node
    got = place_documents(lens, 8, ranks_per_node=4, token_cap=1e9)
    for ranks in got.groups.values():
        assert len(ranks) <= 4
        assert ranks[0] // 4 == ranks[-1] // 4
        assert list(ranks) == list(range(ranks[0], ranks[-1] + 1))
    assert set(got.groups[0]).isdisjoint(got.groups[1])


@pytest.mark.parametrize("bad", [dict(lengths=[]), dict(lengths=[-1]), dict(lengths=[4], slots=[3]),
                                 dict(lengths=[4], n_ranks=0), dict(lengths=[4], token_cap=0.5),
                                 dict(lengths=[4], n_ranks=6, ranks_per_node=4)])
def test_bad_input_is_refused(bad):
    args = dict(n_ranks=2) | bad
    with pytest.raises(ValueError):
        place_documents(args.pop("lengths"), args.pop("n_ranks"), **args)


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 5000), min_size=1, max_size=60), n=st.sampled_from([1, 2, 3, 4, 8, 12]),
       tile=st.sampled_from([(1, 1), (64, 64), (128, 64)]), cap=st.sampled_from([1.0, 1.25, 2.0]))
def test_every_token_and_pair_placed_once(lens, n, tile, cap):
    got = place_documents(lens, n, tile=tile, token_cap=cap, ranks_per_node=4 if n % 4 == 0 else None)
    work = document_work(lens, tile)
    assert got.rank_tokens.sum() == pytest.approx(sum(lens))
    assert got.rank_work.sum() == pytest.approx(work.sum())
    for d in range(len(lens)):
        assert (got.owner[d] >= 0) != (d in got.groups)
    for d, ranks in got.groups.items():
        assert 1 < len(ranks) <= n and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks)))
        assert work[d] / len(ranks) <= work.sum() / n + 1e-6 or len(ranks) == n


# --- the chunks a placement implies --------------------------------------------------------------------------

def _brute_pairs(ch, real_ends, bounds):
    """[c, c] pairs by enumeration: causal inside a document (by slot), padding neither query nor key."""
    pos = [ch.positions(i) for i in range(ch.n)]
    doc = lambda x: np.searchsorted(bounds, x, side="right") - 1  # noqa: E731
    real = [x[x < real_ends[doc(x)]] for x in pos]
    out = np.zeros((ch.n, ch.n), dtype=np.int64)
    for i, q in enumerate(real):
        for j, k in enumerate(real):
            ok = (q[:, None] >= k[None, :]) & (doc(q)[:, None] == doc(k)[None, :])
            out[i, j] = ok.sum()
    return out


@settings(max_examples=40, deadline=None)
@given(docs=st.lists(st.tuples(st.integers(1, 400), st.integers(0, 9)), min_size=1, max_size=25),
       n=st.sampled_from([1, 2, 3, 4, 6]), cap=st.sampled_from([1.0, 1.25]))
def test_chunks_hold_every_token_once_and_pairs_match_enumeration(docs, n, cap):
    real = np.array([r for r, _ in docs])
    slots = real + np.array([p for _, p in docs])
    got = place_documents(real, n, slots=slots, token_cap=cap)
    p = doc_place.pieces(got.doc_ranks, slots, real)
    ch = doc_place.chunking(p, 2 * n)
    everything = np.sort(np.concatenate([ch.positions(i) for i in range(2 * n)]))
    assert everything.tolist() == list(range(int(slots.sum())))
    bounds = np.concatenate([[0], np.cumsum(slots)])
    real_ends = bounds[:-1] + real
    pairs = doc_place.block_pairs(p, 2 * n)
    assert (pairs == _brute_pairs(ch, real_ends, bounds)).all()
    assert pairs.sum() == (real * (real + 1) // 2).sum()
    # whole documents stay in their rank's even chunk; split ones meet only their group's odd chunks
    for r in range(n):
        assert pairs[2 * r, np.arange(2 * n) != 2 * r].sum() == 0
    for d, ranks in got.groups.items():
        assert set(p["chunk"][p["doc"] == d]) == {2 * r + 1 for r in ranks}


def test_split_document_is_zigzag_inside_its_group():
    # one 800-token document on 4 ranks (g = 4): pieces of 100 tokens, member k holds pieces k and 7 - k
    got = place_documents([800], 4)
    assert got.groups == {0: (0, 1, 2, 3)}
    p = doc_place.pieces(got.doc_ranks, [800], [800])
    ch = doc_place.chunking(p, 8)
    for k in range(4):
        assert ch.segments(2 * k + 1) == [(100 * k, 1, 100), (100 * (7 - k), 1, 100)]
        assert ch.segments(2 * k) == []
    pairs = doc_place.block_pairs(p, 8)
    own = np.diag(pairs)[1::2]
    assert (own == own[0]).all()             # zigzag: every member's diagonal block the same work


# --- the doc-place layout in the attention matrix -----------------------------------------------------------

def _doc_place_workload(real, pad, n, cap=1.25):
    real, pad = np.asarray(real), np.asarray(pad)
    got = place_documents(real, n, slots=real + pad, token_cap=cap)
    spec = "docs:" + ",".join(f"{r}+{p}" if p else str(r) for r, p in zip(real, pad))
    return Workload(batch=1, seq_len=int((real + pad).sum()), n_heads=2, n_kv_heads=1, head_dim=8,
                    mask=Mask.parse(spec), layout="doc-place", doc_ranks=got.doc_ranks, passes="fwd+bwd")


@settings(max_examples=30, deadline=None)
@given(docs=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 7)), min_size=1, max_size=20),
       n=st.sampled_from([1, 2, 3, 4]))
def test_matrix_of_a_placement_matches_enumeration(docs, n):
    w = _doc_place_workload([r for r, _ in docs], [p for _, p in docs], n)
    m = AttnMatrix(w, 2 * n)
    bounds, real_ends = w.mask.doc_bounds, w.mask.doc_real_ends
    assert (m.pairs == _brute_pairs(m.chunks, real_ends, bounds)).all()
    # the kernel's shape: query rows and keys of the segments that take part, by enumeration
    for i in range(2 * n):
        for j in range(2 * n):
            seg_q, seg_k = m.chunks.segments(i), m.chunks.segments(j)
            meets = np.array([[_pairs(a, c, b, d, bounds, real_ends) > 0 for b, _, d in seg_k]
                              for a, _, c in seg_q]).reshape(len(seg_q), len(seg_k))
            real = lambda segs: np.array([min(a + c, real_ends[np.searchsorted(bounds, a, side="right") - 1]) - a  # noqa: E731
                                          for a, _, c in segs])
            assert m.s_q[i, j] == real(seg_q)[meets.any(axis=1)].sum()
            assert m.s_kv[i, j] == real(seg_k)[meets.any(axis=0)].sum()


def _pairs(a, c, b, d, bounds, real_ends):
    q, k = np.arange(a, a + c), np.arange(b, b + d)
    dq, dk = (np.searchsorted(bounds, x, side="right") - 1 for x in (q, k))
    ok = (k[None, :] <= q[:, None]) & (dq[:, None] == dk[None, :])
    ok &= (q < real_ends[dq])[:, None] & (k < real_ends[dk])[None, :]
    return int(ok.sum())


def test_doc_place_workload_refuses_a_bad_placement():
    with pytest.raises(UserError, match="doc_ranks"):
        Workload(batch=1, seq_len=10, n_heads=1, n_kv_heads=1, head_dim=8, mask=Mask.parse("docs:4,6"),
                 layout="doc-place", doc_ranks=((0, 1),))
    with pytest.raises(UserError, match="--layout"):
        Workload(batch=1, seq_len=10, n_heads=1, n_kv_heads=1, head_dim=8, mask=Mask.parse("causal"),
                 layout="doc-place")
    with pytest.raises(UserError, match="doc_ranks"):
        Workload(batch=1, seq_len=10, n_heads=1, n_kv_heads=1, head_dim=8, mask=Mask.parse("docs:4,6"),
                 layout="zigzag", doc_ranks=((0, 1), (0, 1)))
    w = Workload(batch=1, seq_len=10, n_heads=1, n_kv_heads=1, head_dim=8, mask=Mask.parse("docs:4,6"),
                 layout="doc-place", doc_ranks=((0, 1), (1, 2)))
    with pytest.raises(UserError, match="does not fit 2 ranks"):
        AttnMatrix(w, 4)
    assert AttnMatrix(w, 6).pairs.sum() == 4 * 5 // 2 + 6 * 7 // 2


# --- the doc-place schedule -----------------------------------------------------------------------------------

def _doc_place_schedule(mask: str, n: int, passes="fwd+bwd", **knobs):
    from meshplan.algorithms import get
    from meshplan.model.topology import Topology
    from meshplan.model.workload import resolve

    w = resolve(seq_len=sum(int(x.split("+")[0]) + int(x.split("+")[1]) if "+" in x else int(x)
                            for x in mask.removeprefix("docs:").split(",")),
                heads=4, kv_heads=2, head_dim=16, dtype="bf16", mask=mask, passes=passes)
    topo = Topology.load("cpu-local", gpus=n)
    alg = get("doc-place")
    plan = alg.plan(w, topo, n, alg.normalize(knobs))
    return plan, alg.schedule(plan, topo)


@settings(max_examples=40, deadline=None)
@given(docs=st.lists(st.tuples(st.integers(1, 400), st.integers(0, 5)), min_size=1, max_size=16),
       n=st.sampled_from([1, 2, 3, 4, 8]), passes=st.sampled_from(["fwd", "bwd", "fwd+bwd"]),
       split=st.sampled_from(["auto", "fetch"]))
def test_schedule_verifies_on_any_pack(docs, n, passes, split):
    from meshplan.plan.verify import verify

    mask = "docs:" + ",".join(f"{r}+{p}" if p else str(r) for r, p in docs)
    _, sched = _doc_place_schedule(mask, n, passes, split=split)
    report = verify(sched)                      # every permitted pair once, matched batches, no deadlock
    assert report.ok, report.violations[:3]


@settings(max_examples=25, deadline=None)
@given(docs=st.lists(st.integers(16, 3000), min_size=1, max_size=24), n=st.sampled_from([8, 16, 24]),
       heads=st.sampled_from([(8, 8), (8, 2), (6, 3), (4, 1)]))
def test_head_parallel_groups_verify_across_nodes(docs, n, heads):
    # dgx-h100: 8 ranks a node, so groups wider than a node run Ulysses inside nodes and a ring over them
    from meshplan.algorithms import get
    from meshplan.model.topology import Topology
    from meshplan.model.workload import resolve
    from meshplan.plan.verify import verify

    w = resolve(seq_len=sum(docs), heads=heads[0], kv_heads=heads[1], head_dim=16, dtype="bf16",
                mask="docs:" + ",".join(map(str, docs)))
    topo = Topology.load("dgx-h100", gpus=n)
    alg = get("doc-place")
    plan = alg.plan(w, topo, n, alg.normalize({}))
    report = verify(alg.schedule(plan, topo))
    assert report.ok, report.violations[:3]


def test_bytes_received_are_the_group_peers_pieces():
    # one long document (split) among short ones on 4 ranks: rank r receives the KV of every group peer's
    # pieces forward; backward that again plus its own pieces' partial dK/dV (fp32) from each peer
    from helpers import recv_bytes

    plan, sched = _doc_place_schedule("docs:1200,40,60,100,80,120,200", 4, split="fetch")
    m, w = plan.matrix, plan.workload
    tokens = m.chunks.tokens
    need = m.permitted[1::2, 1::2] & ~np.eye(4, dtype=bool)
    assert need.any()
    kv = 2 * w.n_kv_heads * w.head_dim * w.elem_bytes * tokens[1::2]          # KV bytes of each rank's pieces
    dkv = kv * 4 // w.elem_bytes
    assert recv_bytes(sched, 0).tolist() == (need * kv[None, :]).sum(axis=1).tolist()
    assert recv_bytes(sched, 1).tolist() == ((need * kv[None, :]).sum(axis=1) + (need.T * dkv[:, None]).sum(axis=1)
                                             ).tolist()


def test_head_parallel_bytes_are_the_all_to_alls_and_the_ring():
    # one document over 4 ranks, 4 query / 2 KV heads: Ulysses 2 (ranks 0-1, 2-3) x a ring of 2 subgroups.
    # Member i receives forward: its partner's Q and KV pieces for its 2 heads, the other subgroup's KV (2 chunks),
    # its partner's O for its own chunk; backward: Q, KV, O and dO from its partner, the other subgroup's KV, the
    # partial dK/dV (fp32) of its subgroup's chunks, and dQ, dK/dV of its own chunk from its partner
    from helpers import recv_bytes

    from meshplan.algorithms.docplace.docplace import split_modes
    from meshplan.model.topology import Topology
    from meshplan.plan.schedule import tensor_bytes

    plan, sched = _doc_place_schedule("docs:1200", 4)
    w = plan.workload
    (hg,), fetched = split_modes(w, Topology.load("cpu-local", gpus=4), 4, "auto")
    assert (hg.u, hg.m) == (2, 2) and not fetched.any()
    c = plan.matrix.chunks.tokens[1::2]
    tb = lambda kind, x, dt=w.dtype: tensor_bytes(w, kind, int(c[x]), 2, dt)  # noqa: E731
    partner = [1, 0, 3, 2]
    other = [(2, 3), (2, 3), (0, 1), (0, 1)]
    mine = [(0, 1), (0, 1), (2, 3), (2, 3)]
    fwd = [tb("q", partner[i]) + tb("kv", partner[i]) + sum(tb("kv", x) for x in other[i]) + tb("out", i)
           for i in range(4)]
    bwd = [sum(tb(k, partner[i]) for k in ("q", "kv", "out", "dout")) + sum(tb("kv", x) for x in other[i])
           + sum(tb("dkv", x, "fp32") for x in mine[i]) + tb("dq", i) + tb("dkv", i) for i in range(4)]
    assert recv_bytes(sched, 0).tolist() == fwd
    assert recv_bytes(sched, 1).tolist() == bwd


def test_short_documents_need_no_communication():
    _, sched = _doc_place_schedule("docs:" + ",".join(["64"] * 16), 4)
    from meshplan.plan.schedule import RECV
    assert not (sched.ops.kind == RECV).any()


def test_search_plans_doc_place_once():
    from meshplan.model.topology import Topology
    from meshplan.model.workload import resolve
    from meshplan.search import enumerate_candidates

    w = resolve(seq_len=2048, heads=4, kv_heads=4, head_dim=64, mask="docs:1500,300,248")
    cands, _ = enumerate_candidates(w, Topology.load("cpu-local", gpus=4), 4, ["doc-place"], {}, False)
    assert [c.algorithm for c in cands] == ["doc-place"]          # not once per layout; zigzag could not cut it


@settings(max_examples=25, deadline=None)
@given(docs=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 7)), min_size=1, max_size=12),
       n=st.sampled_from([1, 2, 3, 4]))
def test_cost_model_segments_of_a_placement_are_its_pairs(docs, n):
    """The kernel segments the cost model prices (block_segments, block_tiles with 1x1 tiles) hold exactly the
    matrix's pairs per block — a placement whose chunk count happens to equal a per-document layout's must not
    be read as one."""
    from meshplan.model.doc_segments import block_segments, block_tiles

    w = _doc_place_workload([r for r, _ in docs], [p for _, p in docs], n)
    m = AttnMatrix(w, 2 * n)
    got = np.zeros(4 * n * n, dtype=np.int64)
    for seg in block_segments(m):
        np.add.at(got, seg.block, seg.pairs)
    assert (got.reshape(2 * n, 2 * n) == m.pairs).all()
    bt = block_tiles(m, 1, 1)
    assert (bt.rect_work + bt.stair_work == m.pairs).all()


def test_two_documents_on_two_ranks_are_not_read_as_a_per_document_layout():
    # the case that was priced 10x too cheap: 2 documents, 2 ranks, 2 segments per chunk = 1 x 2 documents
    w = _doc_place_workload([784, 3312], [0, 0], 2)
    assert w.doc_ranks == ((0, 1), (0, 2))
    from meshplan.model.doc_segments import block_segments
    m = AttnMatrix(w, 4)
    got = np.zeros(16, dtype=np.int64)
    for seg in block_segments(m):
        np.add.at(got, seg.block, seg.pairs)
    assert m.pairs[1, 3] == 2 * 828 * 828           # rank 0's piece 3 against rank 1's pieces 1 and 2
    assert (got.reshape(4, 4) == m.pairs).all()


@settings(max_examples=40, deadline=None)
@given(docs=st.lists(st.tuples(st.integers(1, 400), st.integers(0, 7)), min_size=1, max_size=16),
       n=st.sampled_from([1, 2, 3, 4, 6]), tiles=st.sampled_from([(1, 1), (128, 64), (16, 32)]))
def test_tile_sums_of_a_placement_are_its_segments_summed(docs, n, tiles):
    """The doc-place closed form of block_tiles (prefix sums over each split document's pieces) equals the
    tiles of every document segment of the layout, summed one by one."""
    from meshplan.model.doc_segments import block_tiles, summed_tiles

    w = _doc_place_workload([r for r, _ in docs], [p for _, p in docs], n, cap=1.05)
    m = AttnMatrix(w, 2 * n)
    got, want = block_tiles(m, *tiles), summed_tiles(m, *tiles)
    for k in ("rect_work", "stair_work", "rect", "stair"):
        np.testing.assert_array_equal(getattr(got, k), getattr(want, k), err_msg=k)
    if tiles == (1, 1):                                                   # unit tiles: the permitted pairs
        np.testing.assert_array_equal(got.rect_work + got.stair_work, m.pairs)


def test_tile_sums_of_a_split_document_are_its_segments_summed():
    from meshplan.model.doc_segments import block_tiles, summed_tiles

    w = _doc_place_workload([900, 37, 12, 301], [5, 0, 3, 1], 4)
    assert max(g for _, g in w.doc_ranks) > 1                             # a document is split
    m = AttnMatrix(w, 8)
    got, want = block_tiles(m, 128, 64), summed_tiles(m, 128, 64)
    for k in ("rect_work", "stair_work", "rect", "stair"):
        np.testing.assert_array_equal(getattr(got, k), getattr(want, k), err_msg=k)
