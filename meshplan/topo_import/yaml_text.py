"""Topology YAML text with a comment per number, and its checks: validate, round-trip dump.

A file is built as a tree of dicts whose leaves are :class:`S` (value, where it came from); :func:`render`
writes one key per line with its source as the comment, the way the shipped topologies are written.
"""

from __future__ import annotations

import json
import re
import textwrap
from typing import Any, NamedTuple

from meshplan.core.errors import UserError
from meshplan.model.topology_spec import TopologySpec


class S(NamedTuple):
    """A value for the file and where it came from (its comment)."""

    value: Any
    note: str


def render(tree: dict, head: list[str]) -> str:
    """YAML text of a tree of dicts and :class:`S` leaves, one key per line with its source as a comment."""
    lines = [f"# {w}" for h in head for w in textwrap.wrap(h, 110)]

    def walk(node: dict, depth: int) -> None:
        for key, v in node.items():
            if isinstance(v, dict):
                lines.append(f"{'  ' * depth}{key}:")
                walk(v, depth + 1)
            else:
                text = f"{'  ' * depth}{key}: {_scalar(v.value)}"
                lines.append(f"{text:<36} # {v.note}")

    walk(tree, 0)
    return "\n".join(lines) + "\n"


def _scalar(v) -> str:
    import yaml

    if isinstance(v, float):
        s = repr(v)
        return s if "." in s or "inf" in s or "nan" in s else s.replace("e", ".0e")   # YAML 1.1 floats need a dot
    if isinstance(v, str) and "#" not in v and ": " not in v:
        try:
            if yaml.safe_load(f"k: {v}") == {"k": v}:
                return v                                                             # plain when it reads back
        except yaml.YAMLError:
            pass
    return json.dumps(v)


def validate(text: str) -> TopologySpec:
    """The spec of a topology file's text, built once into a Topology (so every route exists)."""
    import yaml
    from pydantic import ValidationError

    from meshplan.model.topology import Topology

    try:
        spec = TopologySpec.model_validate(yaml.safe_load(text))
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("function-", "tagged-union")))
        raise UserError(loc or "topo import", f"the imported file does not validate: {first['msg']}",
                        "check the flags' values") from None
    topo = Topology(spec)
    if spec.node.nics is not None:                  # and its NIC routes, across two nodes
        Topology(spec, 2 * topo.gpus_per_node).route(0, topo.gpus_per_node)
    return spec


def dump_spec(spec: TopologySpec) -> str:
    """Plain YAML of a spec (no comments): load -> dump -> load gives the same spec."""
    import yaml

    return yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True), sort_keys=False)


def comments(text: str, section: str = "device") -> dict[str, str]:
    """key -> its end-of-line comment, for the keys of one block of a YAML file."""
    out, depth = {}, None
    for line in text.splitlines():
        m = re.match(r"^(\s*)([A-Za-z_]\w*):\s*([^#]*?)\s*(?:#\s*(.*))?$", line)
        if not m:
            continue
        if depth is not None and len(m.group(1)) <= depth:
            break
        if depth is None and m.group(2) == section and not m.group(3):
            depth = len(m.group(1))
        elif depth is not None and m.group(4):
            out[m.group(2)] = m.group(4)
    return out
