"""The algorithm registry: the names ``search --algos`` and ``simulate --algo`` take (docs/formats.md).

Every name of the contract is listed; those whose modules have not landed yet are refused with the issue
that brings them (``simulate``) or skipped and counted (``search``).
"""

from __future__ import annotations

from meshplan.algorithms.base import Algorithm
from meshplan.algorithms.charm.charm import Charm, Merge, RMPlus
from meshplan.algorithms.docplace.docplace import DocPlace
from meshplan.algorithms.loongtrain import LoongTrain
from meshplan.algorithms.mesh.mesh import Mesh
from meshplan.algorithms.passq import PassQ
from meshplan.algorithms.ring import Ring
from meshplan.algorithms.startrail import StarTrail
from meshplan.algorithms.tasp import TASP
from meshplan.algorithms.ulysses import USP, Ulysses
from meshplan.core.errors import UserError

#: Contract order.
NAMES = ("ring", "pass-q", "ulysses", "usp", "loongtrain", "startrail", "tasp", "merge", "rmplus", "charm", "mesh")
REGISTRY: dict[str, Algorithm] = {a.name: a for a in (Ring(), PassQ(), Ulysses(), USP(), LoongTrain(), StarTrail(),
                                                        TASP(), Merge(), RMPlus(), Charm(), Mesh(), DocPlace())}
#: Registered but not enumerated by default (name them in ``--algos``): doc-place (issue 25, in progress).
EXTRA = ("doc-place",)
PLANNED: dict[str, str] = {}


def get(name: str, flag: str = "--algo") -> Algorithm:
    """The algorithm registered under ``name``; ``flag``: the option it came from (``--algo``, ``--algos``), which
    an error names.

    Raises:
        UserError: unknown name (with the valid ones), or a contract name not implemented yet.
    """
    if name in REGISTRY:
        return REGISTRY[name]
    if name in PLANNED:
        raise UserError(flag, f"{name!r} is not implemented yet (planned in {PLANNED[name]})",
                        f"use one of {', '.join(REGISTRY)}")
    raise UserError(flag, f"unknown algorithm {name!r}", f"use one of {', '.join(REGISTRY)}")
