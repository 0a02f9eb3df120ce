"""The generated reference pages of the documentation site are true to the code.

``docs/gen_reference.py`` writes ``docs/reference/{config,cli,round-record,protocol,scenarios}.md``
from the config dataclasses, the argument parsers, the round record and the ``.proto`` comments.
These tests fail when a committed page is stale (regenerate with ``python docs/gen_reference.py``),
when a config field has no docstring (the reference would have nothing to say about it), and when
the keys the reference lists differ from the keys the config loaders accept: every table of every
file kind is probed by giving its loader an unknown key, and the loader's own "allowed keys" answer
is compared with the reference's keys there.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from geoloco.algorithms.simulation.sim_config import SimulatorConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.scenarios.config_file import ConfigFileError

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "docs" / "gen_reference.py"
PROBE = "zz_not_a_key"


def _generator() -> Any:
    if "gen_reference" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gen_reference", GENERATOR)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["gen_reference"] = module
        spec.loader.exec_module(module)
    return sys.modules["gen_reference"]


gen = _generator()


@pytest.fixture(scope="module")
def reference() -> Any:
    return gen.build_config_reference()


# --------------------------------------------------------------------------------------------------
# Fresh pages, documented fields


@pytest.mark.parametrize("page", list(gen.pages()), ids=lambda p: p.name)
def test_generated_page_is_up_to_date(page: Path) -> None:
    text = gen.pages()[page]()
    assert page.is_file() and page.read_text() == text, (
        f"{page.relative_to(ROOT)} is stale: run `{gen.REGENERATE}` and commit the result"
    )


def test_every_config_field_has_a_docstring(reference: Any) -> None:
    assert not reference.missing_docstrings, (
        f"config fields without a docstring (the string literal under the field): {reference.missing_docstrings}"
    )


@dataclasses.dataclass
class _Example:
    documented: int = 1
    """What it means."""
    bare: int = 2


def test_a_field_without_a_docstring_is_noticed() -> None:
    assert gen.field_docstrings(_Example) == {"documented": "What it means."}


# --------------------------------------------------------------------------------------------------
# The reference's keys are the loaders' keys


def _load_scenario(raw: dict[str, Any]) -> None:
    from geoloco.scenarios.scenario import parse_scenario

    parse_scenario(raw, "probe.toml")


def _load_simulate(raw: dict[str, Any]) -> None:
    from geoloco.scenarios import research

    prepare_run = getattr(research, "prepare_run", None)
    if prepare_run is not None:
        prepare_run(raw, [], "probe.toml")
    else:
        research.load_run_config(research.prepare_raw(raw, [], "probe.toml"), "probe.toml")


def _load_coordinator(raw: dict[str, Any]) -> None:
    from geoloco.scenarios.coordinator_cmd import parse_config

    parse_config(raw, "probe.toml")


def _load_relay(raw: dict[str, Any]) -> None:
    from geoloco.algorithms.config import ConfigError
    from geoloco.relay import RelayConfig

    try:
        RelayConfig.from_dict(raw)
    except ConfigError as err:
        raise ConfigFileError("probe.toml", err.key, err.message) from None


LOADERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "scenario": _load_scenario,
    "simulate": _load_simulate,
    "coordinator": _load_coordinator,
    "relay": _load_relay,
}
"""What each file kind's command does with the parsed file (the parts that check its keys)."""

BASES: dict[str, dict[str, Any]] = {
    "scenario": {"workload": {"name": "mlp"}, "sites": [{"name": "a"}], "run": {"rounds": 2}},
    "simulate": {"workload": {"name": "mlp"}, "sites": [{"name": "a"}], "simulation": {"rounds": 1}},
    "coordinator": {"workload": {"name": "mlp"}, "insecure": True},
    "relay": {"name": "eu", "coordinator": "localhost:7000", "insecure": True},
}
"""A minimal valid file of each kind; the probes add one unknown key to it."""

ENTRIES: dict[str, dict[str, Any]] = {
    "faults": {"kind": "cut_link", "site": "a", "at_round": 0},
    "regions": {"name": "eu", "sites": ["a"]},
    "sites": {"name": "a"},
}
"""A valid entry of each array of tables, for a probe of a key inside one."""


def _tables(reference: Any, kind: str) -> Iterator[tuple[tuple[str, ...], str | None]]:
    """``(path, anchor)`` of the top level (anchor None) and of every table a ``kind`` file has."""
    yield (), None

    def walk(keys: list[Any], path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], str | None]]:
        for key in keys:
            if key.table is None or key.table.startswith("workload"):
                continue
            yield (*path, key.name), key.table
            yield from walk(reference.tables[key.table].keys, (*path, key.name))

    yield from walk(reference.top[kind], ())


def _old_layout(kind: str, path: tuple[str, ...]) -> set[str]:
    """Keys the loader still reads at ``path`` in the layout before ``[run]`` (with a deprecation
    message), which the reference shows under ``[run]`` only."""
    schema = {"simulate": SimulatorConfig, "coordinator": CoordinatorConfig}.get(kind)
    if schema is None:
        return set()
    old = [tuple(p.split(".")) for p in schema.RUN_LAYOUT.fields.values()]
    return {p[-1] for p in old if p[:-1] == path}


def _with_probe(base: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """``base`` with the unknown key set in the table at ``path`` (an array's first entry)."""
    raw = copy.deepcopy(dict(base))
    table = raw
    for name in path:
        if name in ENTRIES:
            entries = table.setdefault(name, [copy.deepcopy(ENTRIES[name])])
            table = entries[0]
        else:
            table = table.setdefault(name, {})
    table[PROBE] = 1
    return raw


ALLOWED_RE = re.compile(r"(?:unknown key; allowed keys|unknown section; allowed|allowed options): (?P<names>.*)$")


def _allowed(kind: str, raw: dict[str, Any]) -> set[str]:
    """The keys the loader says it allows where the probe sits."""
    with pytest.raises(ConfigFileError) as refused:
        LOADERS[kind](raw)
    message = str(refused.value)
    assert PROBE in message, f"the {kind} loader refused the probe for another reason: {message}"
    match = ALLOWED_RE.search(message)
    assert match is not None, f"the {kind} loader does not list the allowed keys: {message}"
    return {name.split(" (")[0].strip() for name in match["names"].split(", ")}


@pytest.mark.parametrize("kind", list(LOADERS))
def test_reference_lists_exactly_the_keys_each_loader_accepts(kind: str, reference: Any) -> None:
    for path, anchor in _tables(reference, kind):
        keys = reference.top[kind] if anchor is None else reference.tables[anchor].keys
        documented = {key.name for key in keys}
        if path == ("sites",) and kind == "simulate":
            documented.discard("count")  # the `[sites]` table form's own key (SimulatorConfig.prepare_config_dict)
        accepted = _allowed(kind, _with_probe(BASES[kind], path)) - _old_layout(kind, path)
        where = ".".join(path) or "the top level"
        assert documented == accepted, (
            f"{kind} files, {where}: the reference lists {sorted(documented - accepted)} that the loader "
            f"refuses and lacks {sorted(accepted - documented)} that it accepts; run `{gen.REGENERATE}` "
            "(a new top-level table may need its dataclass in gen_reference.EXTRA_SECTIONS)"
        )


@pytest.mark.parametrize("workload", ["gpt", "mlp"])
def test_reference_lists_every_workload_option(workload: str, reference: Any) -> None:
    documented = {key.name for key in reference.tables[f"workload-{workload}"].keys}
    accepted = _allowed("coordinator", {"insecure": True, "workload": {"name": workload, PROBE: 1}})
    assert documented == accepted


def test_reference_keys_of_a_kind_are_dotted_paths(reference: Any) -> None:
    keys = reference.keys("scenario")
    assert {"algorithm.streaming.fragments", "sites[].uplink_bps", "faults[].kind", "run.rounds"} <= keys
    assert "source" not in keys  # Scenario.source is the file's name, set by the loader
