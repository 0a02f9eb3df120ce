"""A site's state on disk, so that a site killed and restarted goes on as if it never stopped.

A restarted site that kept only the global weights would start its inner optimizer from zero,
drop what error feedback held back, and read its data stream again from the first batch: its
later updates, hence the model, would differ from an uninterrupted run's. With a ``state_dir``
the site saves, at every round boundary, everything its future updates depend on:

* the global weights it holds, their digest, its rounds and the run config (``SiteState``);
* the inner optimizer's state, the model's buffers, the data position (batches drawn; the
  stream is replayed to it on restart, so the iterator must be deterministic, as the built-in
  workloads' are), the inner lr schedule's step and torch's RNG state (``SiteTrainer``);
* the uplink's error-feedback residuals, and the update trained for a round whose broadcast has
  not resolved it yet (``PlainRounds``): saved before it is uploaded, so a site killed after the
  upload, or while the broadcast arrives, re-sends the same bytes (the coordinator deduplicates)
  or learns from the round's broadcast whether they counted.

Files (in ``state_dir``): ``site-state-00000042.safetensors`` holds every tensor (never pickle:
loading a state cannot run code), ``site-state.json`` points to the newest one with its SHA-256
and holds everything else as JSON. Each is written atomically (``atomic_files``), tensors before
pointer, so ``kill -9`` at any instant leaves the previous state or the new one.

A state belongs to one site, one model (parameter names and shapes) and one run (the
coordinator's seed, algorithm, optimizers, workload and privacy settings); loading it for
anything else is refused with ``SiteStateError`` rather than mixing two runs' states.

A state folder belongs to one process at a time: ``lock_state_dir`` holds ``site.lock`` in it
(``geoloco.protos.folder_lock``: an advisory ``flock`` naming the holder's pid and host) from
before the state is read until the site is done. A second process on the folder is refused
with a message naming the holder; the file a killed process left behind holds no lock, and the
next process takes the folder over, saying so at WARNING.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from geoloco.algorithms.params import ParamLayout
from geoloco.protos.atomic_files import atomic_write, atomic_write_safetensors, file_sha256
from geoloco.protos.folder_lock import FolderInUseError, FolderLock
from geoloco.site_agent.client import SiteAgentError

__all__ = [
    "FORMAT_VERSION",
    "LOCK_NAME",
    "POINTER_NAME",
    "SiteSnapshot",
    "SiteStateError",
    "SiteStateStore",
    "b64decode",
    "b64encode",
    "check_layout",
    "layout_fingerprint",
    "load_optimizer_state",
    "lock_state_dir",
    "optimizer_state",
    "prefixed",
    "run_fingerprint",
    "unprefixed",
]

logger = logging.getLogger(__name__)

POINTER_NAME = "site-state.json"
LOCK_NAME = "site.lock"
"""The file ``lock_state_dir`` holds in a state folder while a site process uses it."""
FORMAT_VERSION = 1
_TENSOR_FILE = re.compile(r"^site-state-(\d{8,})\.safetensors$")

RUN_IDENTITY_KEYS = ("seed", "algorithm", "inner_optimizer", "outer_optimizer", "workload", "privacy")
"""Sections of the coordinator's config (``RunConfig.config_json``) that make a run what it is:
a state saved under other values belongs to another run. Deadlines, ports and quorum may change
between coordinator restarts of the same run."""


class SiteStateError(SiteAgentError):
    """A saved site state that cannot be used here (another site, model or run; corrupt files)."""


@dataclass(slots=True)
class SiteSnapshot:
    """One saved state: tensors (safetensors) and JSON metadata."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Pure helpers


def prefixed(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{prefix}{name}": t for name, t in tensors.items()}


def unprefixed(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64decode(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def layout_fingerprint(layout: ParamLayout) -> list[list[Any]]:
    """The model's parameters as ``[name, shape]`` pairs (what a state's tensors must fit)."""
    return [[e.name, list(e.shape)] for e in layout.entries]


def check_layout(saved: Any, layout: ParamLayout, where: Path) -> None:
    ours = layout_fingerprint(layout)
    if saved != ours:
        raise SiteStateError(
            f"the site state in {where} was saved for another model ({len(saved or [])} parameter "
            f"tensors, this model has {len(ours)}, or their names or shapes differ); point "
            "state_dir at this model's own folder, or delete it to start this site afresh"
        )


def run_fingerprint(config_json: str) -> dict[str, Any]:
    """The sections of the coordinator's config that identify its run (``RUN_IDENTITY_KEYS``)."""
    data = json.loads(config_json or "{}")
    return {key: data[key] for key in RUN_IDENTITY_KEYS if key in data}


def _jsonable(value: Any, what: str) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v, what) for v in value]
    if isinstance(value, list):
        return [_jsonable(v, what) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise SiteStateError(
        f"cannot save {what}: value {value!r} of type {type(value).__name__} is neither a tensor "
        "nor a JSON value; use an optimizer whose state holds tensors and plain numbers"
    )


def optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``optimizer.state_dict()`` split into tensors and JSON."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    state_meta: dict[str, dict[str, Any]] = {}
    for pid, entries in sd["state"].items():
        scalars: dict[str, Any] = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{pid}.{key}"] = value
            else:
                scalars[key] = _jsonable(value, f"the inner optimizer's state {key!r}")
        state_meta[str(pid)] = scalars
    groups: list[dict[str, Any]] = []
    for index, group in enumerate(sd["param_groups"]):
        entry: dict[str, Any] = {}
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                tensors[f"group.{index}.{key}"] = value
            else:
                entry[key] = _jsonable(value, f"the inner optimizer's setting {key!r}")
        groups.append(entry)
    return tensors, {"state": state_meta, "param_groups": groups, "keys": sorted(tensors)}


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
) -> None:
    """The inverse of ``optimizer_state``; JSON lists become tuples where the optimizer's own
    settings are tuples (``betas``), so the loaded optimizer is the saved one exactly."""
    current = optimizer.param_groups
    if len(meta["param_groups"]) != len(current):
        raise SiteStateError(
            f"the saved inner optimizer has {len(meta['param_groups'])} parameter groups, this one "
            f"{len(current)}; build the same optimizer as the run that saved the state"
        )
    groups = []
    for index, (saved, ours) in enumerate(zip(meta["param_groups"], current, strict=True)):
        group = {
            key: tuple(value) if isinstance(ours.get(key), tuple) and isinstance(value, list) else value
            for key, value in saved.items()
        }
        for name, tensor in tensors.items():
            parts = name.split(".", 2)
            if parts[0] == "group" and int(parts[1]) == index:
                group[parts[2]] = tensor
        groups.append(group)
    state: dict[int, dict[str, Any]] = {int(pid): dict(scalars) for pid, scalars in meta["state"].items()}
    for name, tensor in tensors.items():
        parts = name.split(".", 2)
        if parts[0] == "state":
            state.setdefault(int(parts[1]), {})[parts[2]] = tensor
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError) as err:
        raise SiteStateError(f"the saved inner optimizer state does not fit this optimizer: {err}") from err


# ---------------------------------------------------------------------------------------------
# The files


def lock_state_dir(directory: str | os.PathLike[str], site: str) -> FolderLock:
    """Hold ``directory`` for this process of ``site`` (module doc), or raise
    ``SiteStateError`` naming the process that holds it. Taking over a lock that a process
    gone from this host left behind is logged at WARNING."""
    try:
        lock = FolderLock.take(directory, LOCK_NAME, what=f"site {site}")
    except FolderInUseError as err:
        raise SiteStateError(
            f"the site state folder {err.folder} is in use by another site process "
            f"({err.holder.text}); two processes writing one state would mix their rounds. Stop "
            "that process first, or give this one its own state_dir (--state-dir)"
        ) from None
    stale = lock.stale
    if stale is not None:
        gone = " (no longer running)" if stale.gone else ""
        logger.warning(
            "site %s: took over the lock of %s left by %s%s: that process was killed or crashed "
            "without releasing it", site, lock.path.parent, stale.text, gone,
        )
    return lock


class SiteStateStore:
    """The state folder: ``save`` a snapshot atomically, ``load`` the newest (see the module
    docstring). ``keep`` tensor files stay on disk (the newest and ``keep - 1`` before it)."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self._sequence = 0

    @property
    def pointer(self) -> Path:
        return self.directory / POINTER_NAME

    def save(self, snapshot: SiteSnapshot) -> Path:
        """Write ``snapshot`` (tensors first, then the pointer) and prune older tensor files."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._sequence = max(self._sequence, self._newest_on_disk()) + 1
        tensor_path = self.directory / f"site-state-{self._sequence:08d}.safetensors"
        sha256 = atomic_write_safetensors(tensor_path, snapshot.tensors)
        pointer = {
            "format_version": FORMAT_VERSION,
            "tensor_file": tensor_path.name,
            "sha256": sha256,
            "meta": snapshot.meta,
        }
        atomic_write(self.pointer, json.dumps(pointer, indent=1, sort_keys=True).encode())
        self._prune(current=self._sequence)
        return tensor_path

    def load(self) -> SiteSnapshot | None:
        """The newest saved state, or None when the folder holds none yet.

        Raises ``SiteStateError`` when the pointer exists but cannot be trusted: going on from a
        silently corrupted state would change the model without anyone knowing.
        """
        pointer_path = self.pointer
        if not pointer_path.exists():
            return None
        try:
            pointer = json.loads(pointer_path.read_text())
            tensor_path = self.directory / str(pointer["tensor_file"])
            expected = str(pointer["sha256"])
            meta = dict(pointer["meta"])
        except (ValueError, KeyError, TypeError) as err:
            raise SiteStateError(
                f"{pointer_path} is not a geoloco site state ({err}); delete {self.directory} to "
                "start this site afresh"
            ) from err
        if pointer.get("format_version") != FORMAT_VERSION:
            raise SiteStateError(
                f"{pointer_path} has format_version {pointer.get('format_version')!r}; this geoloco "
                f"reads version {FORMAT_VERSION}"
            )
        if not tensor_path.exists():
            raise SiteStateError(f"{pointer_path} names {tensor_path.name}, which does not exist")
        actual = file_sha256(tensor_path)
        if actual != expected:
            raise SiteStateError(
                f"{tensor_path} fails its checksum (sha256 {actual[:16]}..., expected "
                f"{expected[:16]}...); delete {self.directory} to start this site afresh"
            )
        match = _TENSOR_FILE.match(tensor_path.name)
        self._sequence = int(match.group(1)) if match else self._sequence
        return SiteSnapshot(tensors=load_file(str(tensor_path)), meta=meta)

    def _newest_on_disk(self) -> int:
        numbers = [int(m.group(1)) for p in self.directory.iterdir() if (m := _TENSOR_FILE.match(p.name))]
        return max(numbers, default=0)

    def _prune(self, *, current: int) -> None:
        files = {
            int(m.group(1)): p for p in self.directory.iterdir() if (m := _TENSOR_FILE.match(p.name))
        }
        older = sorted(n for n in files if n < current)
        for number in older[: max(0, len(older) - (self.keep - 1))]:
            files[number].unlink(missing_ok=True)
        for tmp in self.directory.glob(".*.tmp-*"):
            tmp.unlink(missing_ok=True)
