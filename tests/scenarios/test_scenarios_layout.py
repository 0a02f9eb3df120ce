"""The shape of ``scenarios/``: nothing in it is dead code."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "scenarios"
MODULES = sorted(PACKAGE.rglob("*.py"))
SOURCE_FOLDERS = (
    "protos", "compression", "algorithms", "coordinator", "site_agent", "scenarios", "benchmarks", "examples",
)
SOURCES = sorted(p for folder in SOURCE_FOLDERS for p in (ROOT / folder).rglob("*.py"))
"""Library and benchmark code: what counts as a use (a helper only tests call belongs in tests).
Only the project's own folders: a virtual environment or a run folder inside the clone (as the
README's set-up makes) holds thousands of files that are not uses."""

DEFINITION_RE = re.compile(r"^\s*(?:async\s+)?def ([A-Za-z]\w*)\(|^([A-Z][A-Z0-9_]+)\s*[:=]", re.M)


def defined_names(text: str) -> set[str]:
    """Public functions, methods, properties and UPPER_CASE constants defined in ``text``."""
    return {m[1] or m[2] for m in DEFINITION_RE.finditer(text)}


WORD_RE = re.compile(r"\w+")


def unused(names: set[str], sources: list[str]) -> set[str]:
    """Names that appear only once (their definition) in ``sources``, as whole words: every
    source is split into words once, not searched once per name."""
    words = Counter(word for text in sources for word in WORD_RE.findall(text) if word in names)
    return {name for name in names if words[name] <= 1}


def test_nothing_in_scenarios_is_defined_but_unused() -> None:
    sources = [p.read_text() for p in SOURCES]
    names = set().union(*(defined_names(p.read_text()) for p in MODULES))
    dead = sorted(unused(names, sources))
    assert not dead, (
        f"defined in scenarios/ but used nowhere outside tests: {dead}; delete them, or move a "
        "helper only tests use into the tests"
    )


def test_the_dead_code_check_finds_an_unused_property() -> None:
    code = "class Burst:\n    @property\n    def duration_s(self) -> float:\n        return 1.0\nLIMIT = 3\n"
    assert defined_names(code) == {"duration_s", "LIMIT"}
    assert unused({"duration_s", "LIMIT"}, [code, "x = LIMIT"]) == {"duration_s"}
