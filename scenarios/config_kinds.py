"""Which command a config file is for, told from its top-level keys: one place for every command.

Four kinds of TOML file configure geoloco, each read by its own command: an emulator scenario
(``geoloco emulate``), a simulate config (``geoloco simulate``, and the base of ``sweep`` and
``tune``), a coordinator config (``geoloco coordinator``) and a relay config (``geoloco relay``);
``geoloco plan`` reads the first three. Their top-level keys overlap (``[algorithm]``,
``[workload]``, ``[sites]``, ``[run]``, ...), but each kind has keys no other kind has
(``[[faults]]`` or ``run.timeout_s``, ``[simulation]`` or ``run.total_inner_steps``, ``host`` and
the other coordinator settings, a relay's ``coordinator`` address); those keys, taken from each
kind's own schema (``[run]``'s keys as ``run.KEY``), tell the kind.

Every command opens its file through ``read_config``: a file of another kind is refused in one
line that names the command which takes it, instead of with the first key the command's schema
does not know (``run: unknown section``). A file whose keys do not tell (only shared tables, or
keys of two kinds) is read as the command's own kind, and its schema words what is wrong.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geoloco.algorithms.config import RUN_TABLE
from geoloco.scenarios.config_file import ConfigFileError, read_toml

__all__ = [
    "COORDINATOR",
    "KINDS",
    "RELAY",
    "SCENARIO",
    "SIMULATE",
    "ConfigKind",
    "detect_config_kind",
    "distinguishing_keys",
    "read_config",
]

SCENARIO = "scenario"
SIMULATE = "simulate"
COORDINATOR = "coordinator"
RELAY = "relay"


@dataclass(frozen=True, slots=True)
class ConfigKind:
    """One kind of config file and the command that runs it."""

    name: str
    what: str
    """The kind in words, with its article: ``an emulate scenario``."""
    usage: str
    """The command line that runs a file of this kind, ``{path}`` standing for the file."""


KINDS: dict[str, ConfigKind] = {
    SCENARIO: ConfigKind(SCENARIO, "an emulate scenario", "geoloco emulate {path}"),
    SIMULATE: ConfigKind(SIMULATE, "a simulate config", "geoloco simulate --config {path}"),
    COORDINATOR: ConfigKind(COORDINATOR, "a coordinator config", "geoloco coordinator --config {path}"),
    RELAY: ConfigKind(RELAY, "a relay config", "geoloco relay --config {path}"),
}


@functools.cache
def _top_level_keys() -> dict[str, frozenset[str]]:
    """Every top-level key each kind's schema allows, and every key of its ``[run]`` table as
    ``run.KEY`` (three kinds share ``[run]``; some of its keys are one kind's own)."""
    # Imported here: the schemas import torch, and `geoloco --help` builds every parser.
    from geoloco.algorithms.simulation.sim_config import SIMULATE_RUN
    from geoloco.coordinator.config import COORDINATOR_RUN, CoordinatorConfig
    from geoloco.relay import RelayConfig
    from geoloco.scenarios.research import SECTIONS as SIMULATE_SECTIONS
    from geoloco.scenarios.scenario import SECTIONS as SCENARIO_SECTIONS
    from geoloco.scenarios.scenario import RunSettings

    def run_keys(names: Iterable[str]) -> set[str]:
        return {RUN_TABLE, *(f"{RUN_TABLE}.{name}" for name in names)}

    return {
        SCENARIO: frozenset(SCENARIO_SECTIONS) | run_keys(f.name for f in dataclasses.fields(RunSettings)),
        SIMULATE: frozenset(SIMULATE_SECTIONS) | run_keys(SIMULATE_RUN.fields),
        # Its fields stay its keys: a file of the old layout (top-level total_rounds) is still one.
        COORDINATOR: frozenset(f.name for f in dataclasses.fields(CoordinatorConfig))
        | run_keys(COORDINATOR_RUN.fields),
        RELAY: frozenset(f.name for f in dataclasses.fields(RelayConfig)),
    }


def _file_keys(raw: Mapping[str, Any]) -> set[str]:
    """The file's top-level keys and its ``[run]`` keys as ``run.KEY``."""
    run = raw.get(RUN_TABLE)
    return set(raw) | ({f"{RUN_TABLE}.{key}" for key in run} if isinstance(run, Mapping) else set())


@functools.cache
def distinguishing_keys() -> dict[str, frozenset[str]]:
    """kind -> the top-level keys only that kind has (``scenario``: ``run``, ``faults``)."""
    keys = _top_level_keys()
    return {
        kind: own - frozenset().union(*(other for name, other in keys.items() if name != kind))
        for kind, own in keys.items()
    }


def detect_config_kind(raw: Mapping[str, Any]) -> str | None:
    """The kind (a ``KINDS`` key) whose own keys the parsed file has, else the one kind whose
    schema takes every key it has; ``None`` when its keys do not tell: keys of more than one
    kind, or only keys several kinds share and take."""
    keys = _file_keys(raw)
    found = [kind for kind, own in distinguishing_keys().items() if own & keys]
    if found:
        return found[0] if len(found) == 1 else None
    # No kind's own key (``[run]`` and the tables are shared): a file that only one kind's
    # schema can take is that kind's (a scenario with heartbeats, a coordinator with host/port).
    fitting = [kind for kind, allowed in _top_level_keys().items() if keys <= allowed]
    return fitting[0] if len(fitting) == 1 else None


def _key_text(raw: Mapping[str, Any], key: str) -> str:
    if key not in raw:  # a [run] key
        return key
    value = raw[key]
    if isinstance(value, Mapping):
        return f"[{key}]"
    if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        return f"[[{key}]]"
    return key


def _or(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def read_config(path: Path, accepts: Sequence[str]) -> tuple[dict[str, Any], str]:
    """The parsed file and its kind, for a command that reads the kinds ``accepts`` (the first
    is its default: the kind a file whose keys do not tell is read as).

    A file of another kind raises a ``ConfigFileError`` whose one line says what the file is and
    the command that runs it; an unreadable file, the ``read_toml`` error."""
    raw = read_toml(path)
    kind = detect_config_kind(raw)
    if kind is None:
        return raw, accepts[0]
    if kind not in accepts:
        own = distinguishing_keys()[kind]
        run = raw.get(RUN_TABLE)
        markers = [key for key in raw if key in own] + (  # in the file's order
            [f"{RUN_TABLE}.{key}" for key in run if f"{RUN_TABLE}.{key}" in own] if isinstance(run, Mapping) else []
        )
        shown = ", ".join(_key_text(raw, key) for key in markers[:3]) + (", ..." if len(markers) > 3 else "")
        found = KINDS[kind]
        raise ConfigFileError(
            str(path),
            "",
            f"is {found.what} (it has {shown}), not {_or([KINDS[k].what for k in accepts])}; "
            f"run it with `{found.usage.format(path=path)}`",
        )
    return raw, kind
