"""What every ``geoloco`` command shares for reading its config: one error type, one exit status.

Every command reports a bad file, table or flag the same way, on stderr as
``geoloco COMMAND: error: SOURCE: dotted.key: what is allowed``, and exits with
``EXIT_CONFIG_ERROR`` (2, argparse's own usage-error status) — never with a traceback. This module
is the one place that opens and writes TOML, words what went wrong with the file itself (missing, a
folder, not TOML), holds the exit statuses and the argparse value types the commands share. Key-level
checks stay with each command's schema (the config dataclasses), which raise
``geoloco.algorithms.config.ConfigError``; ``from_config_error`` names the source in front.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

if TYPE_CHECKING:
    from geoloco.algorithms.config import ConfigError

__all__ = [
    "COMMAND_LINE",
    "EXIT_CONFIG_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_RUNTIME_ERROR",
    "ConfigFileError",
    "from_config_error",
    "non_negative_int",
    "port_number",
    "positive_float",
    "positive_int",
    "read_toml",
    "report_config_error",
    "toml_text",
    "tomllib",
]

EXIT_OK = 0
EXIT_RUNTIME_ERROR = 1
"""A failure at run time (a process died, the coordinator refused a site, a port in use)."""
EXIT_CONFIG_ERROR = 2
"""A bad config file, table or flag (argparse's own usage-error status, so a bad flag value
caught by argparse and a bad key caught by a schema exit alike)."""

EXIT_INTERRUPTED = 130
"""Ctrl-C or SIGTERM stopped the command (128 + SIGINT, as a shell reports it)."""

COMMAND_LINE = "command line"
"""``source`` of an error in a flag."""


class ConfigFileError(Exception):
    """A problem in a config file or flag, already phrased for the user: ``SOURCE: key: message``."""

    def __init__(self, source: str, key: str, message: str) -> None:
        self.source = source
        self.key = key
        self.message = message
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {message}")

    def __reduce__(self) -> tuple[type[ConfigFileError], tuple[str, str, str]]:
        # Pickled as ``cls(*args)`` by default, whose one arg is the joined text (a worker
        # process's error would come back as a TypeError).
        return type(self), (self.source, self.key, self.message)


def from_config_error(source: str, err: ConfigError, prefix: str = "") -> ConfigFileError:
    """A schema's ``ConfigError`` (dotted key, message) as a ``ConfigFileError`` naming ``source``;
    ``prefix`` is the table the schema was read from (``"workload"`` -> ``workload.size``)."""
    key = ".".join(part for part in (prefix, err.key) if part)
    return ConfigFileError(source, key, err.message)


def report_config_error(command: str, err: ConfigFileError) -> int:
    """Print ``geoloco COMMAND: error: ...`` on stderr; the exit status every command returns."""
    print(f"geoloco {command}: error: {err}", file=sys.stderr)
    return EXIT_CONFIG_ERROR


def read_toml(path: Path) -> dict[str, Any]:
    """The parsed file, or a ``ConfigFileError`` that says why it cannot be read."""
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigFileError(str(path), "", "file not found") from None
    except IsADirectoryError:
        raise ConfigFileError(str(path), "", "is a folder; pass the TOML file") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigFileError(str(path), "", f"not valid TOML: {err}") from None


def toml_text(table: Mapping[str, Any], *, comments: Iterable[str] = ()) -> str:
    """``table`` as the text of a config file, ``comments`` as ``#`` lines on top.

    TOML has no null, so a key whose value is ``None`` is left out: read back, it takes its
    default, which is ``None`` for every ``X | None`` key of the config dataclasses (a test walks
    the schemas). Written by ``tomli_w`` (imported here, so commands that never write TOML do not
    import it); a ``None`` inside an array has no key to leave out and raises ``ValueError``."""
    import tomli_w

    header = "".join(f"# {line}\n" if line else "#\n" for line in comments)
    body = tomli_w.dumps(_without_none(table, ""))
    return f"{header}\n{body}" if header else body


def _without_none(value: Any, key: str) -> Any:
    """``value`` with every table's ``None`` values left out, tables inside arrays included."""
    if isinstance(value, Mapping):
        return {k: _without_none(v, f"{key}.{k}" if key else str(k)) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        if any(item is None for item in value):
            raise ValueError(f"{key}: TOML has no null, and an array cannot leave an item out: {list(value)!r}")
        return [_without_none(item, f"{key}[{i}]") for i, item in enumerate(value)]
    return value


# argparse value types: a bad value makes argparse print usage and exit with EXIT_CONFIG_ERROR.


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..65535, got {text!r}")
    return value
