"""The examples of README.md and of every documentation page (``docs/**/*.md``) are tested
artifacts: every fenced block is checked, or marked unchecked.

- A ```toml block is parsed and validated by the command that reads such a file (``geoloco
  emulate``'s scenario, ``geoloco simulate``'s or ``geoloco coordinator``'s config), through that
  command's own loader. Its kind is read from an HTML comment just above the fence,
  ``<!-- example: scenario, simulate, coordinator -->`` (one or more of ``TOML_KINDS``), or
  detected from its tables and keys (``detect_toml_kinds``). A fragment (``[privacy]`` alone) is
  merged into a minimal complete config of each kind (``BASES``).
- A ```python block is compiled and run in a fresh interpreter in a temporary folder (it must
  finish in a few seconds on a CPU); ``<!-- example: compile only: REASON -->`` only compiles it.
  A block that includes a file or a section of one (pymdownx.snippets' ``--8<-- "FILE:SECTION"``,
  how a page shows a script it keeps in ``docs/examples/``) is compiled with what it includes, and
  each included script runs once, whole (``test_included_script_runs``).
- A ```sh block: every ``geoloco ...`` command in it is parsed by the real argument parser (flags
  and subcommands exist; nothing runs) and every ``scenarios/*.toml`` and every repository path
  of a ``*.py`` script it names exists. So is every ``geoloco ...`` command in a code span of the
  prose (``test_inline_commands_parse``).
- Any other block, or one whose kind cannot be told, fails the test unless marked
  ``<!-- example: unchecked: REASON -->``, so the README cannot drift from the code again.

Prose is checked too: a backticked config key (``uplink_bps``, ``run.min_sites``) must be a field
of one of the config dataclasses, a fault kind or a metrics key (``test_backticked_keys_exist``);
on the explanation pages, which name code (``docs/architecture.md``, ``docs/explanation/``), it
may also be a name the package's source defines. The generated reference pages
(``docs/gen_reference.py``) are checked against the code by ``tests/docs/test_reference.py``
instead; pages that include a whole file from elsewhere (``benchmarks/README.md``) check only
their own text.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shlex
import subprocess
import sys
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from geoloco.scenarios.config_file import ConfigFileError, tomllib

if TYPE_CHECKING:
    import argparse

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
"""README.md and every page of the documentation site."""


def _gen_reference() -> Any:
    """``docs/gen_reference.py``, the generator of the reference pages, as a module (it imports
    geoloco only when it renders)."""
    import importlib.util

    if "gen_reference" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["gen_reference"] = module
        spec.loader.exec_module(module)
    return sys.modules["gen_reference"]


GENERATED = set(_gen_reference().pages())
"""Written by ``docs/gen_reference.py`` from the code (tests/docs/test_reference.py checks them)."""
CODE_PAGES = [DOCS / "architecture.md", *sorted((DOCS / "explanation").glob("*.md"))]
"""Explanation pages: they name modules, classes and functions as well as config keys."""
SNIPPET_RE = re.compile(r'^-{1,}8<-{1,}\s+"(?P<path>[^":]+)(?::(?P<section>[\w-]+))?"\s*$')

TOML_KINDS = ("scenario", "simulate", "coordinator")
MARKER_RE = re.compile(r"^<!--\s*example:\s*(?P<spec>.*?)\s*-->$")
FENCE_RE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
PYTHON_TIMEOUT_S = 300  # generous: a fresh interpreter imports torch and grpc on a loaded machine

BASES: dict[str, dict[str, Any]] = {
    # Three sites: the smallest run secure aggregation accepts.
    "scenario": {
        "workload": {"name": "mlp"},
        "run": {"rounds": 2},
        "sites": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
    },
    "simulate": {
        "workload": {"name": "mlp"},
        "sites": {"count": 3},
        "simulation": {"rounds": 1, "device": "cpu"},
    },
    "coordinator": {
        "workload": {"name": "mlp"},
        "total_rounds": 2,
        "min_sites": 3,
        "insecure": True,
    },
}
"""A minimal complete config of each kind; a README block is merged over it (the block wins)."""


@dataclass(frozen=True, slots=True)
class Block:
    lang: str
    text: str
    line: int
    """1-based line of the opening fence in its page."""
    marker: str | None
    """What ``<!-- example: ... -->`` right above the fence says, if there is one."""
    page: Path = README
    includes: tuple[Path, ...] = ()
    """Files the block includes (``--8<--`` lines), already put in ``text``."""

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.lang or 'no language'})"


def included(path: str, section: str | None) -> str:
    """What a ``--8<-- "PATH:SECTION"`` line includes: the file (relative to the repository root,
    mkdocs.yml's snippets ``base_path``), or the lines between its ``--8<-- [start:SECTION]`` and
    ``--8<-- [end:SECTION]`` markers."""
    lines = (ROOT / path).read_text().splitlines()
    if section is None:
        return "\n".join(line for line in lines if "--8<-- [" not in line)
    start = next(i for i, line in enumerate(lines) if f"--8<-- [start:{section}]" in line)
    end = next(i for i, line in enumerate(lines) if f"--8<-- [end:{section}]" in line)
    return "\n".join(lines[start + 1:end])


def readme_blocks(text: str, page: Path = README) -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE_RE.match(lines[i])
        if fence is None:
            i += 1
            continue
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        above = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER_RE.match(above)
        includes: list[Path] = []
        for k, line in enumerate(body):
            snippet = SNIPPET_RE.match(line.strip())
            if snippet is not None:
                includes.append(ROOT / snippet["path"])
                body[k] = included(snippet["path"], snippet["section"])
        blocks.append(
            Block(
                fence["lang"], "\n".join(body) + "\n", start + 1, marker["spec"] if marker else None, page,
                tuple(includes),
            )
        )
        i += 1
    return blocks


BLOCKS = [block for page in PAGES for block in readme_blocks(page.read_text(), page)]
INCLUDED_SCRIPTS = sorted({path for block in BLOCKS if block.lang == "python" for path in block.includes})
"""Scripts pages show in parts: each runs once, whole."""


def unchecked(block: Block) -> bool:
    return block.marker is not None and block.marker.startswith("unchecked:")


def _blocks(lang: str) -> list[Block]:
    return [b for b in BLOCKS if b.lang == lang and not unchecked(b)]


def _ids(blocks: list[Block]) -> list[str]:
    return [f"{b.page.relative_to(ROOT)}:{b.line}" for b in blocks]


# ------------------------------------------------------------------------------------------------
# Every block is known


def test_the_pages_have_examples_of_every_checked_kind() -> None:
    langs = {b.lang for b in BLOCKS}
    assert {"toml", "python", "sh"} <= langs, langs
    assert INCLUDED_SCRIPTS, "the tutorial's script is no longer included: is the snippet syntax still read?"


def test_every_block_is_checked_or_marked_unchecked() -> None:
    for block in BLOCKS:
        if unchecked(block):
            reason = block.marker.partition(":")[2].strip() if block.marker else ""
            assert reason, f"{block}: say why it is unchecked: <!-- example: unchecked: REASON -->"
            continue
        assert block.lang in ("toml", "python", "sh"), (
            f"{block}: no check for ```{block.lang} blocks; mark it "
            "<!-- example: unchecked: REASON --> or add a check to tests/test_readme_examples.py"
        )
        if block.lang == "toml":
            toml_kinds(block)  # fails for a block whose kind cannot be told
        if block.lang == "python" and block.marker is not None:
            assert block.marker.startswith("compile only:"), f"{block}: unknown marker {block.marker!r}"


def test_marker_parsing_and_an_unknown_block_fails() -> None:
    text = (
        "<!-- example: unchecked: pseudo code -->\n```text\nx\n```\n\n```toml\n[algorithm]\n"
        "inner_steps = 5\n```\n"
    )
    unmarked_kinds = readme_blocks(text)
    assert [(b.lang, b.marker, b.line) for b in unmarked_kinds] == [
        ("text", "unchecked: pseudo code", 2), ("toml", None, 6)
    ]
    with pytest.raises(AssertionError, match="mark its kind"):
        toml_kinds(unmarked_kinds[1])


def test_an_included_section_is_read_between_its_markers() -> None:
    (block,) = readme_blocks('```python\n--8<-- "docs/examples/two_sites.py:workload"\n```\n')
    assert block.includes == (ROOT / "docs" / "examples" / "two_sites.py",)
    assert "class MyWorkload" in block.text and "--8<--" not in block.text
    assert "simulate(" not in block.text  # the next section


# ------------------------------------------------------------------------------------------------
# TOML


def detect_toml_kinds(data: Mapping[str, Any]) -> tuple[str, ...]:
    """The kind of a complete config, told as every command tells it (``detect_config_kind``:
    ``[run]``/``[[faults]]`` -> scenario, ``[simulation]`` -> simulate, coordinator-only keys ->
    coordinator)."""
    from geoloco.scenarios.config_kinds import detect_config_kind

    kind = detect_config_kind(data)
    return (kind,) if kind in TOML_KINDS else ()


def toml_kinds(block: Block) -> tuple[str, ...]:
    if block.marker is not None:
        kinds = tuple(k.strip() for k in block.marker.split(","))
        unknown = [k for k in kinds if k not in TOML_KINDS]
        assert not unknown, f"{block}: unknown kind(s) {unknown} in the marker; allowed: {TOML_KINDS}"
        return kinds
    kinds = detect_toml_kinds(tomllib.loads(block.text))
    assert kinds, (
        f"{block}: cannot tell which config this TOML belongs to; mark its kind just above the "
        f"fence: <!-- example: {', '.join(TOML_KINDS)} --> (one or more)"
    )
    return kinds


def merged(base: Mapping[str, Any], block: Mapping[str, Any]) -> dict[str, Any]:
    """``block`` over ``base``, tables merged key by key (lists and values replaced)."""
    out = dict(base)
    for key, value in block.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def write_toml(data: Mapping[str, Any], path: Path) -> Path:
    """``data`` as a TOML file, by the writer the commands use."""
    from geoloco.scenarios.config_file import toml_text

    text = toml_text(data)
    path.write_text(text)
    assert tomllib.loads(text) == data, "write_toml lost something"
    return path


def validate(kind: str, path: Path) -> Any:
    """The config as the command ``kind`` reads it (raises ``ConfigFileError`` like it): the
    command's own loader, given the arguments its parser gives it for ``--config PATH``."""
    from geoloco.scenarios.cli import build_parser

    if kind == "scenario":
        from geoloco.scenarios.scenario import load_scenario

        return load_scenario(path)
    if kind == "simulate":
        from geoloco.scenarios.simulate_cmd import load_config as load_simulate

        return load_simulate(build_parser().parse_args(["simulate", "--config", str(path)]))
    from geoloco.scenarios.coordinator_cmd import load_config as load_coordinator

    return load_coordinator(build_parser().parse_args(["coordinator", "--config", str(path), "--insecure"]))


@pytest.mark.parametrize("block", _blocks("toml"), ids=_ids(_blocks("toml")))
def test_toml_block_is_a_valid_config_of_its_kind(block: Block, tmp_path: Path) -> None:
    data = tomllib.loads(block.text)
    for kind in toml_kinds(block):
        path = write_toml(merged(BASES[kind], data), tmp_path / f"{kind}.toml")
        try:
            validate(kind, path)
        except ConfigFileError as err:
            pytest.fail(f"{block} is not a valid {kind} config: {err}")


@pytest.mark.parametrize("kind", TOML_KINDS)
def test_minimal_bases_are_valid_and_a_bad_key_in_a_block_is_caught(kind: str, tmp_path: Path) -> None:
    validate(kind, write_toml(BASES[kind], tmp_path / "base.toml"))
    bad = merged(BASES[kind], {"algorithm": {"inner_stepz": 20}})
    with pytest.raises(ConfigFileError, match="algorithm.inner_stepz"):
        validate(kind, write_toml(bad, tmp_path / "bad.toml"))


def test_a_scenario_site_with_the_old_mbps_keys_is_refused(tmp_path: Path) -> None:
    """What a new user copied from the README before it said ``uplink_bps``."""
    bad = merged(BASES["scenario"], {"sites": [{"name": "a", "uplink_mbps": 100}]})
    with pytest.raises(ConfigFileError, match=r"sites\[0\].uplink_mbps: unknown key"):
        validate("scenario", write_toml(bad, tmp_path / "bad.toml"))


SHIPPED = sorted((ROOT / "scenarios").glob("*.toml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_toml_files_are_valid_configs_of_their_kind(path: Path) -> None:
    kinds = detect_toml_kinds(tomllib.loads(path.read_text()))
    assert len(kinds) == 1, f"{path.name}: cannot tell whether it is a scenario, simulate or coordinator config"
    validate(kinds[0], path)


# ------------------------------------------------------------------------------------------------
# Python


@pytest.mark.parametrize("block", _blocks("python"), ids=_ids(_blocks("python")))
def test_python_block_compiles_and_runs(block: Block, tmp_path: Path) -> None:
    code = compile(block.text, str(block), "exec")
    assert code is not None
    if block.marker is not None and block.marker.startswith("compile only:"):
        return
    if block.includes:
        return  # a part of a script: test_included_script_runs runs the whole script
    _run_python(["-c", block.text], str(block), tmp_path)


@pytest.mark.parametrize("script", INCLUDED_SCRIPTS, ids=[str(p.relative_to(ROOT)) for p in INCLUDED_SCRIPTS])
def test_included_script_runs(script: Path, tmp_path: Path) -> None:
    """A script a page shows in parts (``docs/examples/two_sites.py``) runs whole, as the page's
    reader runs it (``python docs/examples/two_sites.py``)."""
    _run_python([str(script)], str(script.relative_to(ROOT)), tmp_path)


def _run_python(args: list[str], what: str, cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True,
        timeout=PYTHON_TIMEOUT_S, env=env, check=False,
    )
    assert proc.returncode == 0, f"{what} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"


# ------------------------------------------------------------------------------------------------
# Shell


def geoloco_invocations(script: str) -> Iterator[list[str]]:
    """Each ``geoloco ...`` command of a shell snippet as argv (loop variables become ``0``;
    operators inside quotes, such as a codec's ``|``, stay in their word)."""
    for line in script.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0]
        lexer = shlex.shlex(re.sub(r"\$\{?\w+\}?", "0", line), posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        commands: list[list[str]] = [[]]
        for token in lexer:
            if token in (";", "&", "&&", "|", "||"):
                commands.append([])
            else:
                commands[-1].append(token)
        for words in commands:
            while words and words[0] in ("do", "then", "else", "time"):
                words = words[1:]
            if words and words[0] == "geoloco":
                yield words[1:]


def test_geoloco_invocations_are_found_in_loops_and_chains() -> None:
    script = 'pip install -e . && geoloco emulate x.toml --out r\nfor s in 0 1; do geoloco certs issue c $s; done\n'
    assert list(geoloco_invocations(script)) == [
        ["emulate", "x.toml", "--out", "r"], ["certs", "issue", "c", "0"]
    ]
    quoted = "geoloco sweep b.toml --grid a.c=none,'topk:0.01|int4' \\\n  --jobs 2 | tee log\n"
    assert list(geoloco_invocations(quoted)) == [
        ["sweep", "b.toml", "--grid", "a.c=none,topk:0.01|int4", "--jobs", "2"]
    ]


@pytest.mark.parametrize("block", _blocks("sh"), ids=_ids(_blocks("sh")))
def test_sh_block_commands_parse(block: Block) -> None:
    from geoloco.scenarios.cli import build_parser

    for argv in geoloco_invocations(block.text):
        try:
            build_parser().parse_args(argv)
        except SystemExit as exit_info:
            pytest.fail(f"{block}: `geoloco {' '.join(argv)}` is not accepted (exit {exit_info.code})")
        for word in argv:
            if word.startswith("scenarios/") and word.endswith(".toml"):
                assert (ROOT / word).is_file(), f"{block}: {word} does not exist"
    for word in block.text.split():
        if word.endswith(".py") and "/" in word and not word.startswith(("/", "$")):
            assert (ROOT / word).is_file(), f"{block}: {word} does not exist"


INLINE_COMMAND_RE = re.compile(r"`(geoloco [a-z][^`\n]*)`")


def inline_commands(text: str) -> Iterator[list[str]]:
    """The words after ``geoloco`` of every code span of the prose that starts a command
    (``geoloco site --state-dir DIR``, ``geoloco sweep --ray``)."""
    for span in INLINE_COMMAND_RE.findall(text):
        yield span.split()[1:]


def _command_parser(words: list[str]) -> tuple[argparse.ArgumentParser | None, list[str]]:
    """The (sub)command parser the words name (``certs issue``: its own), and the words left."""
    import argparse

    from geoloco.scenarios.cli import build_parser

    parser: argparse.ArgumentParser | None = build_parser()
    while words and parser is not None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words[0] not in subs[0].choices:
            break
        parser, words = subs[0].choices[words[0]], words[1:]
    return parser, words


@pytest.mark.parametrize("page", [p for p in PAGES if p not in GENERATED], ids=lambda p: str(p.relative_to(ROOT)))
def test_inline_commands_name_real_flags(page: Path) -> None:
    """A command in a code span names a real subcommand, and each of its ``--flags`` exists (the
    span may hold placeholders, so it is not parsed whole)."""
    from geoloco.scenarios.cli import SUBCOMMANDS

    for words in inline_commands(page.read_text()):
        if not words or words[0].startswith("-"):
            continue  # `geoloco --help`
        assert words[0] in SUBCOMMANDS, f"{page.relative_to(ROOT)}: `geoloco {' '.join(words)}`: no such command"
        parser, rest = _command_parser(words)
        assert parser is not None
        options = {option for action in parser._actions for option in action.option_strings}
        for word in rest:
            flag = word.split("=", 1)[0].rstrip(",;:)")
            if flag.startswith("--") and len(flag) > 2:
                assert flag in options, (
                    f"{page.relative_to(ROOT)}: `geoloco {' '.join(words)}`: {parser.prog} has no {flag}"
                )


# ------------------------------------------------------------------------------------------------
# Keys named in the prose

METRICS_KEYS = {
    # Keys of a round's record in metrics.jsonl (coordinator/rounds.py writes them) that the README
    # explains; they are not config fields.
    "deadline_s", "next_deadline_s", "arrival_s", "folded_late", "privacy_delta", "epsilon",
    "rejected_reasons", "phases_s", "round_wall_s", "site_phases_s", "update_norm",
}
NOT_KEYS = {"register_step_post_hook", "fully_shard", "to_empty"}
"""Backticked words that are not config keys (``optimizer.register_step_post_hook``,
``fully_shard``, ``model.to_empty``: torch's API)."""
KEY_RE = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")
MATH_RE = re.compile(r"^[a-z]_[a-z0-9]+$")
"""Subscripted math symbols (``g_k``, ``e_down``), not keys."""


def _config_field_names() -> set[str]:
    from geoloco.algorithms.record import RoundRecord
    from geoloco.algorithms.simulation.simulator import SimulatorConfig
    from geoloco.coordinator.config import CoordinatorConfig
    from geoloco.coordinator.status_board import StatusBoard, StatusQuery
    from geoloco.protos.round_phases import COORDINATOR_PHASES, SITE_PHASES
    from geoloco.relay import RelayConfig
    from geoloco.scenarios.scenario import FAULT_KINDS, Scenario
    from geoloco.scenarios.workloads import WORKLOADS
    from geoloco.site_agent.config import SiteAgentConfig

    names: set[str] = set(FAULT_KINDS) | METRICS_KEYS | set(COORDINATOR_PHASES) | set(SITE_PHASES)
    # The status page's JSON (``/api/status``): its top-level keys and its query parameters.
    board = StatusBoard({"relays": {}}, heartbeat_interval_s=1.0)
    names |= set(board.snapshot(round_number=0, phase="running", session_id="s"))
    names |= {field.name for field in dataclasses.fields(StatusQuery)}
    seen: set[type] = set()

    def walk(cls: type) -> None:
        if cls in seen:
            return
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            names.add(field.name)
            for tp in (hints[field.name], *typing.get_args(hints[field.name])):
                if dataclasses.is_dataclass(tp) and isinstance(tp, type):
                    walk(tp)

    roots = [Scenario, SimulatorConfig, CoordinatorConfig, SiteAgentConfig, RelayConfig, RoundRecord]
    for cls in [*roots, *(w.config_class for w in WORKLOADS.values())]:
        walk(cls)
    reference = _gen_reference().build_config_reference()  # the keys every loader accepts
    names |= {key.name for keys in reference.top.values() for key in keys}
    names |= {key.name for table in reference.tables.values() for key in table.keys}
    return names | _prometheus_names()


def _prometheus_names() -> set[str]:
    """The coordinator's and the sites' Prometheus metric names, without their prefix
    (``rounds_completed_total``), as ``docs/monitoring.md`` names them."""
    from geoloco.coordinator.prometheus import METRIC_PREFIX as COORDINATOR_PREFIX
    from geoloco.coordinator.prometheus import CoordinatorMetrics
    from geoloco.site_agent.prometheus import METRIC_PREFIX as SITE_PREFIX
    from geoloco.site_agent.prometheus import SiteMetrics

    names: set[str] = set()
    registries = ((CoordinatorMetrics().registry, COORDINATOR_PREFIX), (SiteMetrics("a").registry, SITE_PREFIX))
    for registry, prefix in registries:
        for metric in registry.collect():
            for name in (metric.name, *(sample.name for sample in metric.samples)):
                names.add(name.removeprefix(f"{prefix}_"))
    return names


@functools.cache
def _code_names() -> frozenset[str]:
    """Every name the package's source defines or uses (modules, classes, functions, arguments,
    attributes, string constants that look like names): what an explanation page may name."""
    import ast

    names: set[str] = set()
    for package in ("protos", "compression", "algorithms", "coordinator", "site_agent", "relay", "scenarios"):
        names.add(package)
        for path in (ROOT / package).rglob("*.py"):
            names.add(path.stem)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
                elif isinstance(node, ast.Attribute):
                    names.add(node.attr)
                elif isinstance(node, ast.Name):
                    names.add(node.id)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and KEY_RE.match(node.value):
                    names.add(node.value)
    return frozenset(names)


def backticked_keys(text: str) -> set[str]:
    """Config-key-looking words in backticks: ``uplink_bps``, ``late_updates = "fold"``,
    ``run.min_sites`` (each dotted part), leaving out file and module names."""
    keys: set[str] = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        span = span.split(" = ", 1)[0].strip()
        if span.endswith((".py", ".toml", ".md", ".jsonl")) or span.startswith("geoloco"):
            continue
        parts = span.split(".")
        if all(re.fullmatch(r"[a-z_][a-z0-9_]*", p) for p in parts):
            keys.update(p for p in parts if KEY_RE.match(p))
    return keys


@pytest.fixture(scope="module")
def known_keys() -> set[str]:
    return _config_field_names()


@pytest.mark.parametrize("page", [p for p in PAGES if p not in GENERATED], ids=lambda p: str(p.relative_to(ROOT)))
def test_backticked_keys_exist(page: Path, known_keys: set[str]) -> None:
    known = known_keys | (_code_names() if page in CODE_PAGES else frozenset())
    unknown = sorted(k for k in backticked_keys(page.read_text()) - known - NOT_KEYS if not MATH_RE.match(k))
    assert not unknown, (
        f"{page.relative_to(ROOT)} names keys no config has: {unknown}; fix the page (or, for a metrics "
        "key, add it to METRICS_KEYS)"
    )


def test_backticked_keys_check_catches_the_old_site_keys() -> None:
    keys = backticked_keys("per site (name, `uplink_mbps`/`downlink_mbps`), `run.min_sites`, `a.py`")
    assert keys == {"uplink_mbps", "downlink_mbps", "min_sites"}
    assert not {"uplink_mbps", "downlink_mbps"} & _config_field_names()
