"""``--set key=value``: change any key of a config file from the shell.

A sweep from the shell should not need one TOML file per run. Values are read as TOML literals
(``10``, ``0.5``, ``true``, ``"text"``, ``[1, 2]``) and otherwise taken as text, so
``--set algorithm.uplink_codec=topk:0.01|int4`` needs no quotes; where the schema says a key is
text, the text is kept as typed (``--set sites.0.name=007`` stays ``"007"``). The schema then
checks the value like any value read from the file, and its error names the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Sequence
from typing import Any, Union

from geoloco.scenarios.config_file import COMMAND_LINE, ConfigFileError, tomllib

__all__ = ["add_set_argument", "apply_overrides", "parse_override", "parse_value"]

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.([A-Za-z_][A-Za-z0-9_]*|[0-9]+))*$")


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, dotted as in the file (algorithm.inner_steps=50, "
        "sites.count=8, sites.0.speed_factor=0.5); the value is a TOML literal or plain text; "
        "repeat for more keys; applied after the file and before the other flags",
    )


def parse_override(text: str) -> tuple[str, str]:
    """``(dotted key, value text)`` of one ``--set`` argument."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not _KEY.match(key):
        raise ConfigFileError(
            COMMAND_LINE,
            "--set",
            f"expected KEY=VALUE with a dotted key such as algorithm.inner_steps=50, got {text!r}",
        )
    return key, value.strip()


def parse_value(text: str, *, strict: bool = False) -> Any:
    """The value of a ``KEY=VALUE`` argument read as one TOML literal (``10``, ``0.5``, ``true``,
    ``"text"``, ``[1, 2]``); text that is not one is returned as typed (``topk:0.01|int4``,
    ``small``) or, with ``strict``, raises ``ValueError`` saying why. The one reader of such
    values: ``--set``, ``--grid``, ``--workload-option``."""
    try:
        parsed = tomllib.loads(f"v = {text}")
        if parsed.keys() != {"v"}:  # "1\nw = 2" would set a second key
            raise ValueError(f"expected one value, got {text!r}")
        return parsed["v"]
    except ValueError:  # tomllib.TOMLDecodeError is a ValueError
        if strict:
            raise
        return text


def _unwrap(annotation: Any) -> Any:
    """``X`` of ``X | None``; anything else unchanged."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _field_type(schema: Any, path: Sequence[str]) -> Any:
    """The annotation of ``path`` in dataclass ``schema``, or ``None`` where the schema does not
    say (a free-form table, a key the schema lacks: the schema's own check reports those)."""
    current = schema
    for part in path:
        current = _unwrap(current)
        if typing.get_origin(current) is list:
            # ``sites.0.x`` indexes the list; ``sites.x`` is the ``[sites]`` table every site shares.
            current = _unwrap(typing.get_args(current)[0])
            if part.isdigit():
                continue
        if not (dataclasses.is_dataclass(current) and isinstance(current, type)):
            return None
        hints = typing.get_type_hints(current)
        if part not in hints:
            return None
        current = hints[part]
    return _unwrap(current)


def _typed(text: str, annotation: Any) -> Any:
    if annotation is str:
        return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text
    return parse_value(text)


def apply_overrides(
    raw: dict[str, Any], overrides: Sequence[str], source: str, schema: Any = None
) -> dict[str, Any]:
    """``raw`` (a parsed config file, changed in place and returned) with every ``--set`` applied.

    ``schema`` is the config dataclass the file is read into (``None``: values are TOML literals
    or text); a ``[sites]`` list is indexed by number, a missing table is created.
    """
    for text in overrides:
        key, value_text = parse_override(text)
        parts = key.split(".")
        node: Any = raw
        for depth, part in enumerate(parts[:-1]):
            where = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigFileError(
                        source, where, f"--set {key}: index into the list with 0..{len(node) - 1}"
                    )
                node = node[int(part)]
                continue
            child = node.setdefault(part, {})
            if not isinstance(child, (dict, list)):
                raise ConfigFileError(source, where, f"--set {key}: {where} is a value, not a table")
            node = child
        last = parts[-1]
        value = _typed(value_text, _field_type(schema, parts) if schema is not None else None)
        if isinstance(node, list):
            if not last.isdigit() or int(last) >= len(node):
                raise ConfigFileError(source, key, f"--set {key}: index into the list with 0..{len(node) - 1}")
            node[int(last)] = value
        else:
            node[last] = value
    return raw
