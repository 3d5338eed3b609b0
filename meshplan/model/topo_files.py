"""Finding and parsing topology files: a path or the bare name of a shipped file (``h100x32`` or
``h100x32.yaml``), read with YAML's safe loader and validated by :mod:`meshplan.model.topology_spec`; every failure is
one :class:`~meshplan.core.errors.UserError` line naming the file and the field."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from meshplan.core.errors import UserError
from meshplan.core.limits import MAX_DEVICES
from meshplan.model.topology_spec import TopologySpec


def shipped_topologies() -> list[str]:
    """Names of the topology files shipped with the package."""
    root = resources.files("meshplan").joinpath("topologies")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def find_topology(name_or_path: str) -> tuple[Path, str]:
    """(path, text) of a topology file given by path or by the bare name of a shipped one.

    Raises:
        UserError: neither a file nor a shipped name (the message lists the shipped names).
    """
    path = Path(name_or_path)
    if path.is_file():
        return path, path.read_text()
    stem = path.name[:-5] if path.name.endswith(".yaml") else path.name
    shipped = resources.files("meshplan").joinpath(f"topologies/{stem}.yaml")
    if path.parent == Path(".") or str(path.parent).endswith("topologies"):
        if shipped.is_file():
            return Path(str(shipped)), shipped.read_text()
    raise UserError("--topo", f"no topology file {name_or_path!r}",
                    f"give a path or a shipped name: {', '.join(shipped_topologies())}")


def parse_topology(text: str, path: Path) -> TopologySpec:
    """The validated spec of a topology file's text (YAML, safe loader).

    Raises:
        UserError: invalid YAML (with its line) or a key or value the schema refuses (with its dotted path).
    """
    import yaml
    from pydantic import ValidationError

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"--topo {path.name}", f"invalid YAML{where}", "fix the file's syntax") from None
    try:
        return TopologySpec.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("function-", "tagged-union")))
        msg = first["msg"].replace("Extra inputs are not permitted", "unknown key")
        fix = "remove or correct it" if first["type"] == "extra_forbidden" else "see the shipped topologies"
        raise UserError(f"{path.name}: {loc}", msg, fix) from None


def place_devices(spec: TopologySpec, gpus: int | None) -> tuple[int, int, int]:
    """(devices per node, nodes, devices) for a requested device count, as the CLI contract says: a multiple of
    the GPUs per node (that many nodes), or a divisor of it (inside one node); a loopback host any count up to
    ``max_ranks``; none given: the file's own count (a CPU host: its cores).

    Raises:
        UserError: a count the topology cannot place (the fix lists the counts it can).
    """
    node = spec.node
    if node.gpus is None:  # a host of CPU ranks: any count up to max_ranks
        default = node.compute_pool.cores if node.compute_pool is not None else node.max_ranks
        n = gpus if gpus is not None else default
        if not 1 <= n <= node.max_ranks:
            raise UserError("--gpus", f"{spec.name} takes 1..{node.max_ranks} ranks, not {n}",
                            f"use a rank count from 1 to {node.max_ranks}")
        return n, 1, n
    g = node.gpus
    if gpus is None:
        return g, spec.nodes, g * spec.nodes
    if gpus > 0 and gpus % g == 0 and gpus <= MAX_DEVICES:
        return g, gpus // g, gpus
    if gpus > 0 and g % gpus == 0:
        return g, 1, gpus
    divisors = [d for d in range(1, g + 1) if g % d == 0]
    raise UserError("--gpus", f"{gpus} GPUs cannot be placed on {spec.name} ({g} GPUs per node)",
                    f"use a divisor of {g} ({', '.join(map(str, divisors))}) or a multiple of {g} "
                    f"({g}, {2 * g}, {3 * g}, ...)")
