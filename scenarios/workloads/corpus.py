"""Text corpus for the GPT workload: the Python standard library's own source code.

Every machine that runs geoloco has a Python interpreter, and (almost) every interpreter ships its
standard library as ``*.py`` files, so this is real text that needs no download. Its top-level
modules (``asyncio``, ``email``, ``json.py``, ...) differ in vocabulary and style, which gives each
site a naturally different ("non-IID") distribution, as real data centers have.

How the corpus is cut, all deterministic:

* **Files.** Every ``*.py`` file under the root, except under ``site-packages``/``dist-packages``
  (third-party code), test suites (any folder named ``test``, ``tests`` or ``idle_test``, which
  covers ``test/``, ``idlelib/idle_test``, ``lib2to3/tests``, ``ctypes/test``...) and
  ``__pycache__``, and except files that are not valid UTF-8. Each file's bytes are followed by one
  ``0x00`` byte, a document separator that never occurs in source text.
* **Evaluation modules** are chosen among the top-level modules by a fixed rule that depends only
  on the corpus and ``eval_fraction`` — never on the number of sites or any seed — so runs with
  different site counts are scored on the same text: modules are visited in the order of the
  SHA-256 of their name and taken (skipping any larger than half the byte target, so that the
  held-out set mixes several modules) until they hold ``eval_fraction`` of all bytes.
* **Site split.** The remaining modules are dealt to sites balanced by bytes with the
  longest-processing-time greedy rule (largest module first, each to the currently lightest
  site), which keeps every site within one module's size of the mean. A module bigger than a fair
  share (``training bytes / num_sites``) is first broken into its sub-modules, recursively (e.g.
  ``encodings`` into ``encodings/cp1252.py``...), so that 64 sites remain balanced; a single file
  is never split. ``split_seed`` breaks size ties and decides which site receives which bundle.

Files are read once per process and root, and each split once per (root, num_sites, fraction,
seed): simulating 64 sites in one process shares the tensors. Treat the returned tensors as
read-only.
"""

from __future__ import annotations

import functools
import heapq
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from geoloco.scenarios.workloads._seeding import stable_rank

logger = logging.getLogger(__name__)

EXCLUDED_DIRS: frozenset[str] = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
"""Folder names never descended into: third-party code, test suites, bytecode caches."""

DOCUMENT_SEPARATOR: bytes = b"\x00"
"""Appended after every file so that a window spanning two files sees where one ends."""


class CorpusUnavailableError(RuntimeError):
    """The source tree holds no usable ``*.py`` text (e.g. a distribution stripped it)."""


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One source file of the corpus."""

    parts: tuple[str, ...]
    """Path relative to the corpus root, split into components (``("email", "utils.py")``)."""
    data: bytes
    """The file's raw UTF-8 bytes."""

    @property
    def path(self) -> str:
        return "/".join(self.parts)


@dataclass(frozen=True, slots=True)
class CorpusSplit:
    """The per-site training text and the held-out evaluation text for one site count."""

    root: str
    """Folder the text was read from."""
    site_modules: tuple[tuple[str, ...], ...]
    """For each site, the modules (relative paths, e.g. ``"asyncio"``, ``"json.py"``) it owns."""
    eval_modules: tuple[str, ...]
    """Modules held out from every site and used only for evaluation."""
    site_data: tuple[torch.Tensor, ...]
    """For each site, its files concatenated as a 1-D ``uint8`` tensor (read-only by convention)."""
    eval_data: torch.Tensor
    """The evaluation modules' files concatenated as a 1-D ``uint8`` tensor."""


def default_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def resolve_root(data_root: str) -> str:
    """``data_root`` as an absolute path; the empty string means the interpreter's stdlib."""
    return str(Path(data_root).expanduser().resolve() if data_root else default_root().resolve())


@functools.lru_cache(maxsize=4)
def read_source_files(root: str) -> tuple[SourceFile, ...]:
    """All corpus files under ``root`` in sorted path order (cached per process)."""
    base = Path(root)
    how_to_fix = (
        "install the interpreter's standard library sources (e.g. Debian/Ubuntu: "
        "`apt-get install libpython3-stdlib`; Alpine: `apk add python3`; or use an official "
        "python.org / pyenv / conda build), or point the workload option `data_root` at any "
        "folder of UTF-8 *.py files"
    )
    if not base.is_dir():
        raise CorpusUnavailableError(f"corpus folder {root!r} does not exist; {how_to_fix}")
    files: list[SourceFile] = []
    skipped_non_utf8 = 0
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(name for name in dirnames if name not in EXCLUDED_DIRS)
        relative = Path(dirpath).relative_to(base).parts
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            data = (Path(dirpath) / filename).read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                skipped_non_utf8 += 1
                continue
            files.append(SourceFile(parts=(*relative, filename), data=data))
    files.sort(key=lambda source: source.parts)
    if not files:
        raise CorpusUnavailableError(
            f"no UTF-8 *.py files found under {root!r} (searched recursively, excluding "
            f"{sorted(EXCLUDED_DIRS)}); this Python distribution seems to ship only bytecode. "
            f"To fix: {how_to_fix}"
        )
    total = sum(len(source.data) for source in files)
    logger.info(
        "read %d source files (%d bytes, %d non-UTF-8 skipped) from %s",
        len(files), total, skipped_non_utf8, root,
    )
    return tuple(files)


def _size(files: list[SourceFile]) -> int:
    return sum(len(source.data) + len(DOCUMENT_SEPARATOR) for source in files)


def _group(files: list[SourceFile], depth: int) -> dict[tuple[str, ...], list[SourceFile]]:
    """Files grouped by their first ``depth + 1`` path components (one group per child module)."""
    groups: dict[tuple[str, ...], list[SourceFile]] = {}
    for source in files:
        groups.setdefault(source.parts[: depth + 1], []).append(source)
    return groups


def _refine(
    prefix: tuple[str, ...], files: list[SourceFile], limit: int
) -> list[tuple[str, list[SourceFile]]]:
    """Break a module bigger than ``limit`` into its sub-modules, recursively; files stay whole."""
    if _size(files) <= limit or (len(files) == 1 and files[0].parts == prefix):
        return [("/".join(prefix), files)]
    units: list[tuple[str, list[SourceFile]]] = []
    for child, child_files in sorted(_group(files, len(prefix)).items()):
        units.extend(_refine(child, child_files, limit))
    return units


def _concat(files: list[SourceFile]) -> torch.Tensor:
    joined = bytearray()
    for source in sorted(files, key=lambda s: s.parts):
        joined += source.data
        joined += DOCUMENT_SEPARATOR
    if not joined:
        return torch.empty(0, dtype=torch.uint8)
    # The tensor shares (and keeps alive) the bytearray's memory: no copy of the corpus.
    return torch.frombuffer(joined, dtype=torch.uint8)


@functools.lru_cache(maxsize=8)
def held_out_corpus(root: str, eval_fraction: float) -> tuple[tuple[str, ...], torch.Tensor]:
    """The held-out top-level modules and their text; depends on nothing but corpus and fraction."""
    modules = _group(list(read_source_files(root)), 0)
    total = sum(_size(files) for files in modules.values())
    target = eval_fraction * total
    chosen: list[tuple[str, ...]] = []
    held = 0
    for name in sorted(modules, key=lambda parts: stable_rank("eval", "/".join(parts))):
        if held >= target:
            break
        size = _size(modules[name])
        if size <= target / 2:
            chosen.append(name)
            held += size
    if not chosen:  # every module is large compared to the target: take the smallest one
        chosen.append(min(modules, key=lambda parts: (_size(modules[parts]), parts)))
    eval_files = [source for name in chosen for source in modules[name]]
    return tuple(sorted("/".join(name) for name in chosen)), _concat(eval_files)


@functools.lru_cache(maxsize=8)
def split_corpus(root: str, num_sites: int, eval_fraction: float, split_seed: int) -> CorpusSplit:
    """Cut the corpus under ``root`` into ``num_sites`` disjoint site corpora and a held-out set.

    See the module docstring for the rules. Cached per process: every site of a simulation
    shares one split.
    """
    if num_sites < 1:
        raise ValueError(f"num_sites must be >= 1, got {num_sites}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    eval_modules, eval_data = held_out_corpus(root, eval_fraction)
    held_out = set(eval_modules)
    modules = _group(list(read_source_files(root)), 0)
    training = {name: files for name, files in modules.items() if "/".join(name) not in held_out}
    limit = max(1, _size([f for files in training.values() for f in files]) // num_sites)
    units = [unit for name, files in sorted(training.items()) for unit in _refine(name, files, limit)]
    if len(units) < num_sites:
        raise ValueError(
            f"num_sites={num_sites} exceeds the {len(units)} training modules available under "
            f"{root!r}; use at most {len(units)} sites or a larger corpus (`data_root`)"
        )
    # Longest-processing-time greedy: biggest module first, each to the lightest bin so far.
    units.sort(key=lambda unit: (-_size(unit[1]), stable_rank("split", split_seed, unit[0])))
    bins: list[tuple[int, int]] = [(0, index) for index in range(num_sites)]
    bin_units: list[list[tuple[str, list[SourceFile]]]] = [[] for _ in range(num_sites)]
    for unit in units:
        load, index = heapq.heappop(bins)
        bin_units[index].append(unit)
        heapq.heappush(bins, (load + _size(unit[1]), index))
    # The seed decides which site receives which bundle, so that site 0 is not always the largest.
    order = sorted(range(num_sites), key=lambda site: stable_rank("site", split_seed, site))
    site_units = [bin_units[order[site]] for site in range(num_sites)]
    return CorpusSplit(
        root=root,
        site_modules=tuple(tuple(sorted(name for name, _ in units)) for units in site_units),
        eval_modules=eval_modules,
        site_data=tuple(_concat([f for _, files in units for f in files]) for units in site_units),
        eval_data=eval_data,
    )
