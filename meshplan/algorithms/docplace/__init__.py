"""``doc-place``: packed documents placed by their work — short ones whole on one rank, long ones split across a
subgroup sized to them (issue 25).

:mod:`.placement` decides where each document goes (LPT within a token cap, split groups of consecutive ranks);
:mod:`.chunks` turns a placement into chunks — rank r's whole documents in chunk 2r, its pieces of split
documents (zigzag inside the group) in chunk 2r + 1 — and counts the exact work between them.

Not registered as an algorithm yet: the schedule (local blocks, then each group's pieces exchanged), the workload
field that carries the placement into the schedule file, and ``plan-batch`` come next.
"""
