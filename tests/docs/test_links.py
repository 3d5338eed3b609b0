"""The repository stands on its own: every link in README.md and docs/ resolves (files and headings), every
file the code, tests, benchmarks and docs name exists, and nothing points outside the repository (``../shared``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = [p for folder in ("meshplan", "tests", "benchmarks", "notebooks", "docs")
           for p in sorted((ROOT / folder).rglob("*")) if p.is_file() and p.suffix in
           {".py", ".md", ".yaml", ".csv", ".ipynb", ".sh", ""} and "__pycache__" not in p.parts] + PAGES
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# a repository path named in prose or code: docs/*.md, meshplan/**/*.py, tests/**/*.py, benchmarks/*.py
NAMED = re.compile(r"(?<![\w./-])((?:docs|meshplan|tests|benchmarks|notebooks)/[\w./-]*\w\.(?:md|py|yaml|ipynb|sh))\b")
DESIGN = re.compile(r"\b(ARCHITECTURE|COSTMODEL|ALGORITHMS|WORKED_EXAMPLES|BUGCASES|DEVELOPERS|LAYOUT)\.md\b")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_every_named_file_exists():
    missing = sorted({f"{p.relative_to(ROOT)}: {name}" for p in SOURCES for name in NAMED.findall(p.read_text())
                      if "*" not in name and not (ROOT / name).exists()})
    assert not missing, "\n".join(missing)


def test_nothing_points_outside_the_repository():
    outside = sorted(f"{p.relative_to(ROOT)}:{i}" for p in SOURCES if p.name != "test_links.py"
                     for i, line in enumerate(p.read_text().splitlines(), 1)
                     if "../shared" in line or re.search(r"(?<![\w-])shared/(design|data|cases|tools)", line)
                     or DESIGN.search(line))
    assert not outside, "\n".join(outside)


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "](docs/" in text and "pip install" in text and "pytest" in text
