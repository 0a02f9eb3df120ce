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


SITES_EXAMPLES = "algorithm.inner_steps=50, sites.count=8, sites.0.speed_factor=0.5"
"""``--set`` examples of the commands whose files have a ``[sites]`` table (simulate, emulate,
sweep, tune)."""


def add_set_argument(parser: argparse.ArgumentParser, *, examples: str = SITES_EXAMPLES) -> None:
    """``--set KEY=VALUE``; ``examples``: keys this command's file accepts (the help must not
    offer one the command refuses)."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override one config key, dotted as in the file ({examples}); the value is a TOML "
        "literal or plain text; repeat for more keys; applied after the file and before the other flags",
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


def _move_to(raw: dict[str, Any], old: Sequence[str], new: Sequence[str]) -> None:
    """Move what the file has at ``old`` (a ``[run]`` key's place in the old layout) to ``new``
    unless the file has that too (then both stay, and the schema refuses the file)."""
    node: Any = raw
    for part in old[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or old[-1] not in node:
        return
    table = raw.setdefault(new[0], {})
    if isinstance(table, dict) and new[1] not in table:
        table[new[1]] = node.pop(old[-1])


def _is_list(schema: Any, path: Sequence[str]) -> bool:
    """Whether the schema says ``path`` is a list (``sites``, which a file may also write as one
    ``[sites]`` table with ``count``)."""
    return schema is not None and typing.get_origin(_field_type(schema, path)) is list


def _as_list(table: dict[str, Any], key: str, where: str, source: str) -> list[dict[str, Any]]:
    """A ``[sites]`` table with ``count`` as the list it stands for (``count`` copies of its
    other keys), so ``--set sites.2.speed_factor=0.5`` changes site 2 alone."""
    count = table.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigFileError(
            source, where,
            f"--set {key}: the [{where}] table describes every entry alike; set {where}.count first "
            f"(--set {where}.count=N before this one) to index them",
        )
    index = int(key.split(".")[len(where.split("."))])
    if index >= count:
        raise ConfigFileError(
            source, f"{where}.{index}",
            f"--set {key}: index out of range: [{where}] has count = {count}, so index it with "
            f"0..{count - 1} (or raise {where}.count first)",
        )
    shared = {k: v for k, v in table.items() if k != "count"}
    return [dict(shared) for _ in range(count)]


def _index_error(key: str, part: str, length: int) -> str:
    if part.isdigit():
        return f"--set {key}: index out of range: the list has {length} entries, so index it with 0..{length - 1}"
    return f"--set {key}: {part!r} is not an index: this is a list of {length} entries, index it with 0..{length - 1}"


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
    layout = getattr(schema, "RUN_LAYOUT", None)  # the schema's [run] table (training.RunLayout)
    for text in overrides:
        key, value_text = parse_override(text)
        field_parts = key.split(".")
        if layout is not None:
            key, old_place = layout.override_key(key)
            if old_place is not None:  # the key's field, for its type; the file's old place moved
                field_parts = [*old_place.split("."), *key.split(".")[2:]]
                _move_to(raw, old_place.split("."), key.split(".")[:2])
        parts = key.split(".")
        node: Any = raw
        parent: Any = None
        for depth, part in enumerate(parts[:-1]):
            where = ".".join(parts[: depth + 1])
            if isinstance(node, dict) and part.isdigit() and depth > 0 and _is_list(schema, parts[:depth]):
                node = parent[parts[depth - 1]] = _as_list(node, key, ".".join(parts[:depth]), source)
            parent = node
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigFileError(source, where, _index_error(key, part, len(node)))
                node = node[int(part)]
                continue
            child = node.setdefault(part, {})
            if not isinstance(child, (dict, list)):
                raise ConfigFileError(source, where, f"--set {key}: {where} is a value, not a table")
            node = child
        last = parts[-1]
        if isinstance(node, dict) and last.isdigit() and len(parts) > 1 and _is_list(schema, parts[:-1]):
            node = parent[parts[-2]] = _as_list(node, key, ".".join(parts[:-1]), source)
        value = _typed(value_text, _field_type(schema, field_parts) if schema is not None else None)
        if isinstance(node, list):
            if not last.isdigit() or int(last) >= len(node):
                raise ConfigFileError(source, key, _index_error(key, last, len(node)))
            node[int(last)] = value
        else:
            node[last] = value
    return raw
