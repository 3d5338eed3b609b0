"""CHARM+ partner lists (arXiv 2611.05906, Algorithm 1) and domains.

Inside a domain of p ranks (p a power of two), level i (1 ≤ i ≤ log2 p) pairs local rank l with the group
``{l XOR j : 2^(i−1) ≤ j < 2^i}``. *Merge* swaps KV with every partner. *RM+* swaps KV at level 1; from
level 2 on it splits the group (sorted) into halves ``first``/``second`` and, with ``g3`` the ranks merged
so far (sorted, starting with level 1's pair), takes KV-peers = first and Q-peers = second when l is in the
lower half of g3, else the reverse; then ``g3 ∪= group``. KV-peers swap KV (each computes its Q against
the other's KV); Q-peers swap Q (each computes the other's Q against its own KV and returns the partial
output and LSE). The relation is mutual, so both are swaps; every block is computed once and every rank
computes p blocks (docs/algorithms.md oracle; for p = 8, rank 0: level 1 KV {1}; level 2 KV {2}, Q {3};
level 3 KV {4, 5}, Q {6, 7}).
"""

from __future__ import annotations

import functools

import numpy as np

from meshplan.core.errors import SkipCandidate, UserError

KV, Q = 1, 2


def levels(p: int) -> list[list[int]]:
    """Offsets j of each level: level i holds 2^(i−1) ≤ j < 2^i."""
    return [list(range(1 << (i - 1), 1 << i)) for i in range(1, p.bit_length())]


@functools.lru_cache(maxsize=8)
def roles(p: int, mechanism: str) -> np.ndarray:
    """[p, p] role[l, j] of offset j for local rank l: KV or Q (0 for j = 0). ``mechanism``: merge | rmplus.
    Read-only (cached: a 1024-rank domain's RM+ lists take 0.5 s)."""
    if mechanism == "merge":                              # every partner a KV-peer
        out = np.full((p, p), KV, dtype=np.int8)
        out[:, 0] = 0
        out.flags.writeable = False
        return out
    out = np.zeros((p, p), dtype=np.int8)
    for x in range(p):
        g3 = sorted({x, x ^ 1}) if p > 1 else [x]
        if p > 1:
            out[x, 1] = KV
        for offsets in levels(p)[1:]:
            group = sorted(x ^ j for j in offsets)
            if mechanism == "merge":
                kv_peers, q_peers = group, []
            else:
                half = len(group) // 2
                first, second = group[:half], group[half:]
                lower = g3.index(x) < len(g3) // 2
                kv_peers, q_peers = (first, second) if lower else (second, first)
            for y in kv_peers:
                out[x, x ^ y] = KV
            for y in q_peers:
                out[x, x ^ y] = Q
            g3 = sorted(set(g3) | set(group))
    out.flags.writeable = False
    return out


def partner_lists(p: int, mechanism: str, rank: int) -> list[dict[str, list[int]]]:
    """Per level, the KV and Q peers (local ranks) of ``rank``, as Algorithm 1 lists them."""
    role = roles(p, mechanism)[rank]
    return [{"kv": [rank ^ j for j in offs if role[j] == KV], "q": [rank ^ j for j in offs if role[j] == Q]}
            for offs in levels(p)]


def power_of_two(n: int) -> bool:
    """n is 1, 2, 4, 8, …"""
    return n >= 1 and n & (n - 1) == 0


def domain_size(topo, n_ranks: int, device_of_rank: np.ndarray, declared: int | None, name: str) -> int:
    """Ranks per domain: ``declared`` domains (``--domains M``), else nodes when the ranks span several, else
    the topology's NUMA sockets. Domains must hold consecutive ranks, equally many, a power of two.

    Raises:
        UserError: a declared M that does not divide N or gives a domain size that is not a power of two.
        SkipCandidate: the topology's domains do not suit (unequal, not a power of two, fewer than two).
    """
    if declared is not None:
        if n_ranks % declared or not power_of_two(n_ranks // declared) or declared < 1:
            raise UserError("--domains", f"{declared} domains of {n_ranks} ranks are not equal power-of-two "
                            "domains", f"choose M so that {n_ranks}/M is a power of two")
        return n_ranks // declared
    dev = np.asarray(device_of_rank)
    node = topo.node_of_device[dev]
    dom = node if len(np.unique(node)) > 1 else topo.domain_of_device[dev]
    m = len(np.unique(dom))
    p = n_ranks // m
    if m < 2:
        raise SkipCandidate("needs two or more domains", f"{name} needs at least two nodes or NUMA domains; "
                            "declare them with --domains M on a single domain")
    if n_ranks % m or not power_of_two(p) or not np.array_equal(dom, np.repeat(np.unique(dom), p)):
        raise SkipCandidate("domains are not equal powers of two",
                            f"{name} needs equal power-of-two domains of consecutive ranks")
    return p
