"""Reading the TOML files of the commands (`simulate`, `coordinator`, `emulate`), with one error type.

Every command reports a bad file or flag the same way, ``FILE: key: message``, and exits with
status 2; this module is the one place that opens TOML and words what went wrong with the file
itself (missing, a folder, not TOML). Key-level checks stay with each command's schema.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

__all__ = ["ConfigFileError", "read_toml", "tomllib"]


class ConfigFileError(Exception):
    """A problem in a config file or flag, already phrased for the user."""

    def __init__(self, source: str, key: str, message: str) -> None:
        self.source = source
        self.key = key
        self.message = message
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {message}")


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
