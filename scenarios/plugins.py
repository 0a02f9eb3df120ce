"""Plug-ins: a user's own outer optimizers, codecs and workloads, loaded by module name in every
process a run happens in, and identified by a hash of their source.

A plug-in is an importable module that registers its parts when imported, into the one registry
of each kind: ``geoloco.algorithms.register_outer_optimizer``,
``geoloco.compression.register_codec``, ``geoloco.scenarios.workloads.register_workload``. A
simulate config names it in ``[research] plugins`` (or ``--plugin`` on the command line), so the
name travels with the config to wherever the run goes: this process, a sweep's spawned worker
processes (they inherit ``sys.path``), a Ray worker (the backend ships the source of a plug-in
that is not installed: ``pack_modules``) or a tuner's trial. Each run records the module's name,
version and source hash (``module_provenance``), and a sweep folds the hash into its run
folders' names, so an edited plug-in never resumes into results of the old code.

A workload object (``research.run(..., workload=obj)``) is identified the same way, by its
class's module (``workload_identity``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from geoloco.scenarios.config_file import ConfigFileError

__all__ = [
    "PLUGINS_KEY",
    "ShippedModule",
    "add_plugin_argument",
    "import_plugins",
    "module_provenance",
    "pack_modules",
    "plugin_modules",
    "source_sha256",
    "unpack_modules",
    "workload_identity",
]

PLUGINS_KEY = "research.plugins"
"""Where a simulate config lists its plug-in modules (the key config errors name)."""
OWN_PACKAGE = "geoloco"
HOW_TO = "docs/how-to/plug-ins.md"


def add_plugin_argument(parser: argparse.ArgumentParser) -> None:
    """``--plugin MODULE`` (repeatable): added to the config's ``[research] plugins``."""
    parser.add_argument(
        "--plugin",
        dest="plugins",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (and in every worker): a plug-in that registers its own outer "
        "optimizers, codecs or workloads by name; added to the config's [research] plugins, recorded "
        "with its source hash; must be importable (installed, or its folder on PYTHONPATH); repeat "
        f"for more (see {HOW_TO})",
    )


def import_plugins(names: Sequence[str], source: str) -> list[ModuleType]:
    """Import each plug-in module (once per process: Python caches modules), so that what it
    registers exists before a config naming it is read. A module that cannot be imported, or
    whose import fails, raises ``ConfigFileError`` on ``research.plugins`` saying why."""
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except ImportError as err:
            raise ConfigFileError(
                source, PLUGINS_KEY,
                f"cannot import plug-in module {name!r} ({err}); a plug-in must be importable by name in "
                "every process a run happens in: install it, or put its folder on PYTHONPATH (a sweep's "
                f"local workers inherit this process's sys.path, the Ray backend ships it; see {HOW_TO})",
            ) from None
        except Exception as err:
            raise ConfigFileError(
                source, PLUGINS_KEY, f"importing plug-in module {name!r} failed: {type(err).__name__}: {err}"
            ) from err
    return modules


def source_sha256(module: ModuleType) -> str | None:
    """SHA-256 over a module's source: its file, or for a package every ``.py`` file under it
    (by relative path, in sorted order, so the hash does not depend on where it is installed);
    ``None`` for a module without source files (built in, or defined in a notebook)."""
    paths = getattr(module, "__path__", None)
    if paths is not None and len(list(paths)) == 1:
        root = Path(next(iter(paths)))
        files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    else:
        file = getattr(module, "__file__", None)
        if not file or not file.endswith(".py"):
            return None
        root = Path(file).parent
        files = [Path(file)]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def _distribution_version(top_level: str) -> str | None:
    """The installed distribution's version that provides ``top_level``; ``None`` when none does
    (a module on ``PYTHONPATH``)."""
    names = metadata.packages_distributions().get(top_level, [])
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def module_provenance(name: str) -> dict[str, Any]:
    """``{"module", "version", "source_sha256"}`` of an imported module: its ``__version__`` or
    its distribution's, and ``source_sha256``."""
    module = sys.modules.get(name) or importlib.import_module(name)
    version = getattr(module, "__version__", None)
    if not isinstance(version, str):
        version = _distribution_version(name.partition(".")[0])
    return {"module": name, "version": version, "source_sha256": source_sha256(module)}


def workload_identity(workload: Any) -> dict[str, Any]:
    """What names a workload object in a run's ``config.json`` and a sweep's folder hash: its
    ``name``, class and the options of its ``config`` dataclass when it has one (its module's
    source hash is among the run's plug-ins: ``plugin_modules``). Objects of one class that
    differ otherwise (constructor arguments kept outside a ``config`` dataclass) should differ in
    ``name``."""
    cls = type(workload)
    module = _main_named(cls.__module__)
    config = getattr(workload, "config", None)
    options = (
        dataclasses.asdict(config) if dataclasses.is_dataclass(config) and not isinstance(config, type) else {}
    )
    return {
        "name": getattr(workload, "name", cls.__name__),
        "class": f"{module}.{cls.__qualname__}",
        **options,
    }


def _main_named(module: str) -> str:
    """A script's module under one name: a spawned worker runs the script as ``__mp_main__``."""
    return "__main__" if module == "__mp_main__" else module


def plugin_modules(plugins: Iterable[str], workload: Any = None) -> list[str]:
    """The modules whose code a run depends on beyond geoloco: the plug-ins, then a workload
    object's module (unless it is one of ours), without repeats."""
    names = list(dict.fromkeys(plugins))
    if workload is not None:
        module = _main_named(type(workload).__module__)
        if module.partition(".")[0] != OWN_PACKAGE and module not in names:
            names.append(module)
    return names


@dataclass(frozen=True, slots=True)
class ShippedModule:
    """A plug-in's source, sent to a worker that may not have it (``pack_modules``)."""

    name: str
    """The top-level module or package name."""
    source_sha256: str
    """``source_sha256`` of the module the files make up."""
    files: dict[str, bytes]
    """Path relative to the folder that goes on ``sys.path`` -> content."""


def pack_modules(names: Iterable[str]) -> list[ShippedModule]:
    """The source of each name's top-level module or package, for workers that do not share this
    machine's files (the Ray backend: Ray itself ships local modules only for a whole job, at
    ``ray.init``). Only plain-source modules on this machine's own paths travel: an installed one
    (under ``site-packages``), one with files besides ``.py`` sources (extension modules, data)
    or a namespace package must be installed on the workers, like geoloco itself; the
    ``__main__`` script needs nothing (Ray pickles its classes by value)."""
    shipped: dict[str, ShippedModule] = {}
    for name in names:
        top = name.partition(".")[0]
        if top in (OWN_PACKAGE, "__main__") or top in shipped:
            continue
        module = sys.modules.get(top) or importlib.import_module(top)
        files = _plain_sources(module)
        digest = source_sha256(module)
        if files is not None and digest is not None:
            shipped[top] = ShippedModule(top, digest, files)
    return list(shipped.values())


def _plain_sources(module: ModuleType) -> dict[str, bytes] | None:
    """``ShippedModule.files`` of a top-level module, or ``None`` when it cannot travel as source."""
    paths = list(getattr(module, "__path__", None) or [])
    file = getattr(module, "__file__", None)
    location = Path(paths[0]) if len(paths) == 1 else (Path(file) if file and not paths else None)
    if location is None or {"site-packages", "dist-packages"} & set(location.parts):
        return None
    if not paths:
        return {location.name: location.read_bytes()} if location.suffix == ".py" else None
    contents = [p for p in location.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    if any(p.suffix != ".py" for p in contents):
        return None
    return {f"{module.__name__}/{p.relative_to(location).as_posix()}": p.read_bytes() for p in sorted(contents)}


def unpack_modules(shipped: Iterable[ShippedModule], root: Path) -> None:
    """Make shipped modules importable in this process: each written under ``root/<hash>/`` (once
    per machine), that folder first on ``sys.path``, and a different version imported earlier
    (a reused worker process) dropped, so the next import takes the shipped source."""
    for module in shipped:
        folder = root / module.source_sha256
        for relative, content in module.files.items():
            path = folder / relative
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                tmp.write_bytes(content)
                os.replace(tmp, path)  # another worker on this machine may write it at once
        loaded = sys.modules.get(module.name)
        if loaded is not None and source_sha256(loaded) != module.source_sha256:
            for key in [k for k in sys.modules if k == module.name or k.startswith(module.name + ".")]:
                del sys.modules[key]
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
