"""A folder used by one process at a time: an advisory lock file that names its holder.

The coordinator's checkpoint folder (``geoloco.coordinator.checkpoint.CheckpointFolderLock``) and
a site's ``--state-dir`` (``geoloco.site_agent.persist.lock_state_dir``) are each written by one
process; a second one writing beside it would interleave two runs' files. ``FolderLock.take``
holds an advisory ``flock`` on a file in the folder, taken without waiting, and writes the
holder's pid, host and start time into it, so a refusal can say who holds the folder.

The kernel drops a ``flock`` when its holder dies, however it dies: a process killed with
``kill -9`` leaves its file behind but not its lock, and the next process takes the folder at
once. The file it finds then names a holder that no longer holds it (a *stale* lock, whose pid
is gone on this host); ``FolderLock.stale`` says who, so the caller can say it took over.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

__all__ = ["FolderInUseError", "FolderLock", "LockHolder"]

_Lock = TypeVar("_Lock", bound="FolderLock")

_HOLDER_LINE = re.compile(r"^pid (?P<pid>\d+) on (?P<host>[^,\s]+)")


@dataclass(frozen=True, slots=True)
class LockHolder:
    """What a lock file says about its holder: ``pid N on HOST, since TIME[, WHAT]``."""

    text: str
    """The holder's line as written (or a placeholder when it wrote none)."""
    pid: int | None = None
    host: str | None = None

    @classmethod
    def parse(cls, text: str) -> LockHolder:
        match = _HOLDER_LINE.match(text)
        if match is None:
            return cls(text or "holder unknown: it has not written its pid yet")
        return cls(text, int(match.group("pid")), match.group("host"))

    @property
    def gone(self) -> bool:
        """The holder was a process of this host that no longer runs (False when that cannot
        be told: another host, or no pid)."""
        if self.pid is None or self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False


class FolderInUseError(RuntimeError):
    """Another process (or another holder in this one) holds the folder's lock."""

    def __init__(self, folder: Path, holder: LockHolder) -> None:
        super().__init__(f"{folder} is in use ({holder.text})")
        self.folder = folder
        self.holder = holder

    def __reduce__(self) -> tuple[type[FolderInUseError], tuple[Path, LockHolder]]:
        return type(self), (self.folder, self.holder)


class FolderLock:
    """Exclusive use of a folder by one holder (module doc). ``release`` removes the file."""

    def __init__(self, path: Path, fd: int, stale: LockHolder | None = None) -> None:
        self.path = path
        self._fd: int | None = fd
        self.stale = stale
        """The holder a file left behind named, when this lock took the folder over from a
        process that no longer held it (killed, crashed); None when the file was new."""

    @classmethod
    def take(cls: type[_Lock], directory: str | os.PathLike[str], name: str, *, what: str = "") -> _Lock:
        """Hold ``directory/name`` (the folder is made if need be), or raise
        ``FolderInUseError`` naming the holder. ``what`` ends the holder's line (e.g. the site)."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise FolderInUseError(folder, holder) from None
            except BaseException:
                os.close(fd)
                raise
            # The holder may have released (and removed) the file between our open and our lock:
            # then we hold a file nobody else will open; try again on the one at the path.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        left = os.pread(fd, 512, 0).decode(errors="replace").strip()
        stale = LockHolder.parse(left.splitlines()[0]) if left else None
        line = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, (line + (f", {what}" if what else "") + "\n").encode(), 0)
        return cls(path, fd, stale)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __del__(self) -> None:
        # A holder dropped without release() (an exception past its owner): drop the flock
        # with the descriptor; the file stays, naming a holder that no longer holds it.
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        """Remove the file and drop the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still holding it: no one can take it between
        finally:
            os.close(fd)  # closing the last descriptor drops the flock


def _holder(fd: int) -> LockHolder:
    """What the holder wrote into the lock file (its first line)."""
    try:
        lines = os.pread(fd, 512, 0).decode(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return LockHolder.parse(lines[0] if lines else "")
