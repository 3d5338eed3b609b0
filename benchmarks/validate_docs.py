"""Validation on packed documents: predicted vs measured on CPU ranks (gloo) for packs drawn from the Pile's
published document sizes (docs/accuracy.md, "Packed documents"; a benchmark, not a CI gate).

``python benchmarks/validate_docs.py [--quick] [--rounds R] [--ranks 2,4] [--repredict]`` — the protocol of
``validate_cpu.py`` (every candidate ``search`` enumerates, every method and layout, run interleaved in one spawned
world; median of R rounds; Kendall τ over pairs apart by more than 2σ; the race's held-out regret), on packed-
document workloads instead of fixed masks.

**The document mix.** Documents are drawn as a Pile training stream sees them: The Pile's Table 1 (Gao et al.,
"The Pile: An 800GB Dataset of Diverse Text for Language Modeling", arXiv 2101.00027) gives each of its 22
components' effective size (its weight) and mean document size in KiB. A document comes from component i with
probability ∝ weight_i / mean_size_i (the share of documents, not of bytes), and its length is log-normal with
that component's mean, σ = 1 (the table gives means only: σ is our assumption), at 4 bytes per token (GPT-2's BPE
on English text); documents are drawn until the pack is full and the last one is cut. Each document is padded to
a multiple of 8 tokens (what zigzag over 4 ranks needs; ``L+P`` in ``--mask docs:``), so one pack serves 2 and 4
ranks and every layout. The calibration (``meshplan calibrate``) times single blocks over its own fixed document
mixes (uniform 64-512 tokens and one hand-picked mix) and never these packs.

Results: ``benchmarks/results/validate_docs.json``; ``--repredict`` compares the stored measurements with this
code's predictions (a model change; the same calibration only).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "validate_docs.json"
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import validate_cpu  # noqa: E402  (beside this file)

from meshplan.core.fileio import write_atomic  # noqa: E402

# The Pile, Table 1 (arXiv 2101.00027): component -> (effective size GiB, mean document size KiB)
PILE = {"Pile-CC": (227.12, 4.33), "PubMed Central": (180.55, 30.55), "Books3": (151.44, 538.36),
        "OpenWebText2": (125.54, 3.85), "ArXiv": (112.42, 46.61), "Github": (95.16, 5.25),
        "FreeLaw": (76.73, 15.06), "StackExchange": (64.39, 2.16), "USPTO Backgrounds": (45.81, 4.08),
        "PubMed Abstracts": (38.53, 1.30), "Gutenberg (PG-19)": (27.19, 398.73), "OpenSubtitles": (19.47, 30.48),
        "Wikipedia (en)": (19.13, 1.11), "DM Mathematics": (15.49, 8.00), "Ubuntu IRC": (11.03, 545.48),
        "BookCorpus2": (9.45, 369.87), "EuroParl": (9.17, 68.87), "HackerNews": (7.80, 4.92),
        "YoutubeSubtitles": (7.47, 22.55), "PhilPapers": (4.76, 73.37), "NIH ExPorter": (3.79, 2.11),
        "Enron Emails": (1.76, 1.78)}
BYTES_PER_TOKEN = 4.0
SIGMA = 1.0
PAD_TO = 8


def pile_pack(seq_len: int, seed: int) -> str:
    """A ``--mask docs:`` spec of ``seq_len`` tokens: Pile documents (module docstring), each padded to a multiple
    of :data:`PAD_TO`, the last one cut so the pack is exactly full (``seq_len`` a multiple of PAD_TO)."""
    rng = np.random.default_rng(seed)
    names = list(PILE)
    size = np.array([PILE[k][0] for k in names])
    mean_tokens = np.array([PILE[k][1] for k in names]) * 1024 / BYTES_PER_TOKEN
    p = size / mean_tokens
    p /= p.sum()
    parts, used = [], 0
    while used < seq_len:
        i = rng.choice(len(names), p=p)
        mu = np.log(mean_tokens[i]) - SIGMA ** 2 / 2             # a log-normal of that mean
        real = max(1, int(rng.lognormal(mu, SIGMA)))
        slot = min(-(-real // PAD_TO) * PAD_TO, seq_len - used)
        real = min(real, slot)
        parts.append(f"{real}+{slot - real}" if slot > real else str(real))
        used += slot
    return "docs:" + ",".join(parts)


def _flags(seq_len, seed, **rest):
    return dict(seq_len=seq_len, mask=pile_pack(seq_len, seed), **rest)


# (label, workload flags): pack size, GQA, dtype, pass and document layout vary; every pack its own seed
WORKLOADS = [
    ("Pile 8K MHA fp32 fwd+bwd", _flags(8192, 1, heads=4, kv_heads=4, head_dim=64, dtype="fp32", passes="fwd+bwd")),
    ("Pile 16K GQA4 bf16 fwd", _flags(16384, 2, heads=8, kv_heads=2, head_dim=64, dtype="bf16", passes="fwd")),
    ("Pile 8K MHA fp32 fwd packed", _flags(8192, 3, heads=4, kv_heads=4, head_dim=64, dtype="fp32", passes="fwd",
                                           doc_layout="packed")),
]


def main() -> None:
    args = validate_cpu.parse_args(__doc__, "one workload")
    if args.repredict:
        validate_cpu.repredict_file(RESULTS, WORKLOADS)
        return
    body = validate_cpu.run_all(args, WORKLOADS, [int(x) for x in args.ranks.split(",")], quick_workloads=1)
    body["documents"] = {label: flags["mask"] for label, flags in WORKLOADS}
    if not args.quick:
        write_atomic(RESULTS, json.dumps(body, indent=1, default=str).encode())
    print(json.dumps(body["summary"], indent=1))


if __name__ == "__main__":
    main()
