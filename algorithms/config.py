"""Turning plain dicts (parsed TOML, JSON logs) into validated config dataclasses.

Every config in ``geoloco.algorithms`` is a ``@dataclass(kw_only=True, slots=True)`` that validates
itself in one ``validate()`` method (called from ``__post_init__``), so a config built in code is
checked exactly like one read from a file. ``config_from_dict`` adds what only a file needs: unknown
keys and wrong types are reported with the dotted key path (``outer_optimizer.lr``) and the allowed
values, so the CLI can name the file and the key without a traceback.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

T = TypeVar("T")


RUN_TABLE = "run"
"""The table every config file kind keeps the run's knobs in (length, seed, quorum, deadline,
evaluation, heartbeats): ``geoloco.algorithms.training.RunLayout``."""

class ConfigError(ValueError):
    """A config value is unknown, of the wrong type or impossible.

    ``key`` is the dotted path of the offending key (``"algorithm.inner_steps"``) and ``message``
    says what is allowed, so a caller can prefix the file name and show it to a user as is.
    """

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str]]:
        # Exceptions pickle as ``cls(*args)``; this one's args are the joined text, so a sweep
        # worker's (or a user's own multiprocessing) error came back as a TypeError.
        return type(self), (self.key, self.message)

    def under(self, prefix: str) -> ConfigError:
        """The same error with its key nested under ``prefix`` (``"sites[2]"`` + ``"speed"``)."""
        if not prefix:
            return self
        key = f"{prefix}.{self.key}" if self.key and not self.key.startswith("[") else (
            f"{prefix}{self.key}"
        )
        return ConfigError(key, self.message)


def require(condition: bool, key: str, message: str) -> None:
    """Raise ``ConfigError(key, message)`` unless ``condition``; keeps ``validate()`` bodies flat."""
    if not condition:
        raise ConfigError(key, message)


_VALUE_WORDS: dict[Any, str] = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def value_description(tp: Any) -> str:
    """What a config file must write for annotation ``tp``, in a file's words rather than
    Python's: ``an integer``, ``a number (or leave the key out)``, ``one of 'uniform' | 'samples'``,
    ``a list of integers``, ``a table``."""
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        words = " or ".join(value_description(a) for a in args if a is not type(None))
        return f"{words} (or leave the key out)" if type(None) in args else words
    if origin is list or origin is tuple:
        items = [a for a in get_args(tp) if a is not Ellipsis]
        if origin is tuple and len(items) > 1:
            return f"a list of {len(items)} values ({', '.join(value_description(a) for a in items)})"
        return f"a list of {_plural(value_description(items[0]))}" if items else "a list"
    if origin is dict or tp is dict or dataclasses.is_dataclass(tp):
        return "a table"
    return _VALUE_WORDS.get(tp, getattr(tp, "__name__", str(tp)))


def _plural(words: str) -> str:
    """``an integer`` -> ``integers``, ``a number`` -> ``numbers`` (others as they are)."""
    for article in ("an ", "a "):
        if words.startswith(article) and " " not in words[len(article):]:
            return words[len(article):] + "s"
    return words


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp`` and convert (int -> float, list -> tuple)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value in get_args(tp) and not isinstance(value, bool):
            return value
        raise ConfigError(key, f"got {value!r}; allowed values: {' | '.join(repr(a) for a in get_args(tp))}")
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(key, f"must be set; expected {value_description(tp)}")
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(key, f"got {value!r}; expected {value_description(tp)}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"expected a table of {tp.__name__} keys, got {value!r}")
        return config_from_dict(tp, value, prefix=key)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"got {value!r}; expected {value_description(tp)}")
        (item_type,) = get_args(tp) or (Any,)
        return [_convert(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"got {value!r}; expected {value_description(tp)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(key, f"got {len(value)} values; expected {value_description(tp)}")
        return tuple(_convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"got {value!r}; expected a table")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"got {value!r}; expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(key, f"got {value!r}; expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(key, f"got {value!r}; expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, f"got {value!r}; expected a string")
    raise TypeError(f"config_from_dict cannot check annotation {tp!r} of {key}")


def config_from_dict(cls: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    """Build config dataclass ``cls`` from ``data``, checking keys and types.

    Raises ``ConfigError`` naming the dotted key (under ``prefix``) for an unknown key, a value of
    the wrong type, or a value ``cls.validate()`` rejects. Missing keys take the field default.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(prefix, f"expected a table, got {data!r}")
    layout = getattr(cls, "RUN_LAYOUT", None)  # a schema whose file keeps some fields under [run]
    if layout is None:
        return _from_dict(cls, data, prefix)
    try:
        return _from_dict(cls, layout.lift(data), prefix)
    except ConfigError as err:
        raise layout.error(err, data) from None  # named as the file has the key


def _from_dict(cls: type[T], data: Mapping[str, Any], prefix: str) -> T:
    # A schema whose file form is richer than its fields (``[sites]`` with ``count``) says how to
    # read it, so every way of building it (file, dict, sweep grid) accepts the same input.
    prepare = getattr(cls, "prepare_config_dict", None)
    if prepare is not None:
        try:
            data = prepare(data)
        except ConfigError as err:
            raise err.under(prefix) from None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        allowed = set(fields)
        layout = getattr(cls, "RUN_LAYOUT", None)  # the file form: fields a file writes under [run]
        if layout is not None:
            allowed = allowed - {path for path in layout.fields.values() if "." not in path} | {RUN_TABLE}
        allowed -= getattr(cls, "MOVED_TO_RUN", frozenset())
        raise ConfigError(key, f"unknown key; allowed keys: {', '.join(sorted(allowed))}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(value, hints[name], key)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.under(prefix) from None


def config_to_dict(config: Any) -> dict[str, Any]:
    """A JSON-able dict of a config dataclass (tuples become lists, nesting is kept)."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        return value

    return plain(config)
