"""Built-in workloads: a byte-level GPT on the Python standard library, and a tiny MLP for tests.

Both implement ``geoloco.algorithms.workload.Workload``. They are found by name in ``WORKLOADS``
(``register_workload`` adds a plug-in's);
``build_workload(name, **options)`` turns the plain values of a TOML table into the workload's
config dataclass, field for field, and rejects unknown names, unknown options and wrongly typed
values with a message that says what is allowed.

Every command reads its ``[workload]`` table through ``parse_workload``, into one typed
``WorkloadSpec`` (name + options) with one set of defaults: the same table gives the same spec in
``geoloco simulate``, ``emulate``, ``coordinator`` and ``site``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.workload import Workload
from geoloco.scenarios.workloads.corpus import CorpusSplit, CorpusUnavailableError
from geoloco.scenarios.workloads.gpt import (
    GPT,
    GPT_PRESETS,
    GPTConfig,
    GPTWorkload,
    GPTWorkloadConfig,
)
from geoloco.scenarios.workloads.mlp import MLPWorkload, MLPWorkloadConfig

__all__ = [
    "DEFAULT_WORKLOAD",
    "GPT",
    "GPT_PRESETS",
    "WORKLOADS",
    "WORKLOAD_TABLE",
    "CorpusSplit",
    "CorpusUnavailableError",
    "GPTConfig",
    "GPTWorkload",
    "GPTWorkloadConfig",
    "MLPWorkload",
    "MLPWorkloadConfig",
    "WorkloadFactory",
    "WorkloadSpec",
    "build_workload",
    "parse_workload",
    "register_workload",
    "workload_config",
]


class WorkloadFactory(Protocol):
    """A workload class: knows its config dataclass and builds itself from one."""

    @property
    def config_class(self) -> type[Any]:
        """The workload's config dataclass (read from the class, which sets it as a ClassVar)."""
        ...

    def __call__(self, config: Any) -> Workload: ...


WORKLOADS: dict[str, WorkloadFactory] = {
    "gpt": GPTWorkload,
    "mlp": MLPWorkload,
}
"""Workload name -> class; the class's ``config_class`` lists the options it accepts. The one
registry, which ``register_workload`` adds a plug-in's workload to."""


def register_workload(name: str, factory: WorkloadFactory, *, replace: bool = False) -> None:
    """Make ``[workload] name = NAME`` build ``factory(config)``, where ``factory.config_class`` is
    the dataclass of the options the table may set (fields of type int, float, str, bool or
    ``X | None``, each with a default) and the result implements
    ``geoloco.algorithms.workload.Workload`` (any ``nn.Module`` from ``build_model``, its data from
    ``site_batches``).

    Registration is per process: a sweep's worker processes and Ray workers know the name only
    when the module that registers it is imported there too (a simulate config's ``[research]
    plugins``). A name already taken raises ``ValueError`` unless ``replace``; registering the
    same class again (a module imported twice) is a no-op."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a workload name is an identifier such as 'my_model', got {name!r}")
    config_class = getattr(factory, "config_class", None)
    if not (isinstance(config_class, type) and dataclasses.is_dataclass(config_class)) or not callable(factory):
        raise TypeError(
            f"workload {name!r}: the factory must be callable with its options and carry them as "
            f"config_class, a dataclass (class MyWorkload: config_class = MyConfig); got {factory!r}"
        )
    hints = typing.get_type_hints(config_class)
    for option in dataclasses.fields(config_class):
        try:
            _accepts(hints[option.name], None)
        except TypeError:
            raise TypeError(
                f"workload {name!r}: option {option.name!r} has type {_describe(hints[option.name])}; "
                "a [workload] table holds int, float, str, bool or X | None"
            ) from None
        if option.default is dataclasses.MISSING and option.default_factory is dataclasses.MISSING:
            raise TypeError(f"workload {name!r}: option {option.name!r} needs a default")
    known = WORKLOADS.get(name)
    if known is not None and not replace and _where(known) != _where(factory):
        raise ValueError(
            f"workload {name!r} is already registered (by {_where(known)}); pick another name, or pass replace=True"
        )
    WORKLOADS[name] = factory


def _where(factory: object) -> str:
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', repr(factory))}"


def _describe(annotation: object) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _accepts(annotation: object, value: object) -> tuple[bool, object]:
    """Whether ``value`` fits ``annotation`` (int, float, str, bool, or ``X | None``), and the value
    converted where the conversion is lossless (an int where a float is expected)."""
    origin = typing.get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        for member in typing.get_args(annotation):
            ok, converted = _accepts(member, value)
            if ok:
                return True, converted
        return False, value
    if annotation is type(None):
        return value is None, value
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False, value
        return True, float(value)
    if annotation is str:
        return isinstance(value, str), value
    raise TypeError(f"unsupported option type {annotation!r} in a workload config")


def workload_config(name: str, **options: object) -> Any:
    """The config dataclass of workload ``name`` built from plain option values, validated."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; valid workloads: {sorted(WORKLOADS)}")
    config_class = WORKLOADS[name].config_class
    hints = typing.get_type_hints(config_class)
    fields = {field.name: hints[field.name] for field in dataclasses.fields(config_class)}
    converted: dict[str, object] = {}
    for key, value in options.items():
        if key not in fields:
            allowed = ", ".join(f"{field} ({_describe(kind)})" for field, kind in fields.items())
            raise ValueError(
                f"unknown option {key!r} for workload {name!r}; allowed options: {allowed}"
            )
        ok, converted[key] = _accepts(fields[key], value)
        if not ok:
            raise ValueError(
                f"option {key!r} of workload {name!r} must be {_describe(fields[key])}, "
                f"got {type(value).__name__} {value!r}"
            )
    try:
        return config_class(**converted)
    except ValueError as error:
        raise ValueError(f"workload {name!r}: {error}") from error


def build_workload(name: str, **options: object) -> Workload:
    """Workload ``name`` configured by ``options`` (the fields of its config dataclass)."""
    config = workload_config(name, **options)
    return WORKLOADS[name](config)


DEFAULT_WORKLOAD = "gpt"
"""The workload of a config without a ``[workload]`` table or without its ``name``."""

WORKLOAD_TABLE = "workload"
"""The table's name in every config file (and the prefix of its error keys)."""


@dataclass(kw_only=True, slots=True)
class WorkloadSpec:
    """A built-in workload by name and the options of its config dataclass, as validated by
    ``parse_workload``; what the ``[workload]`` table of every command's config means."""

    name: str = DEFAULT_WORKLOAD
    """A key of ``WORKLOADS``."""
    options: dict[str, Any] = field(default_factory=dict)
    """The options set in the table (the fields of the workload's config dataclass); the
    dataclass's defaults fill in the rest."""

    def config(self) -> Any:
        """The workload's config dataclass, every default filled in."""
        return workload_config(self.name, **self.options)

    def build(self) -> Workload:
        return build_workload(self.name, **self.options)

    def to_table(self) -> dict[str, Any]:
        """The ``[workload]`` table again (``name`` plus the options), JSON-able."""
        return {"name": self.name, **self.options}


def parse_workload(table: Any) -> WorkloadSpec:
    """The ``WorkloadSpec`` of a ``[workload]`` table (``None``: no table, the defaults).

    Raises ``ConfigError`` with a key under ``workload``: ``workload.name`` for an unknown name,
    ``workload.OPTION`` for an unknown or wrongly typed option, ``workload`` for a table that is
    not one or options that contradict each other.
    """
    if table is None:
        return WorkloadSpec()
    if not isinstance(table, Mapping):
        raise ConfigError(
            WORKLOAD_TABLE,
            f"expected a [workload] table with name = one of {', '.join(map(repr, WORKLOADS))}, "
            f"got {table!r}",
        )
    options = dict(table)
    name = options.pop("name", DEFAULT_WORKLOAD)
    if not isinstance(name, str) or name not in WORKLOADS:
        raise ConfigError(
            f"{WORKLOAD_TABLE}.name",
            f"got {name!r}; allowed values: {', '.join(WORKLOADS)} (a plug-in's workload exists once its "
            "module is imported: list it in [research] plugins)",
        )
    for key, value in options.items():
        try:
            workload_config(name, **{key: value})
        except ValueError as err:
            raise ConfigError(f"{WORKLOAD_TABLE}.{key}", str(err)) from None
    try:
        workload_config(name, **options)
    except ValueError as err:  # a constraint between options
        raise ConfigError(WORKLOAD_TABLE, str(err)) from None
    return WorkloadSpec(name=name, options=options)
