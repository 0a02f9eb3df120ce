"""Child processes of an emulation: started in their own process group, never left behind.

Every child (the coordinator, each site) is started through a tiny shim (``CHILD_SHIM``) that
asks the kernel to SIGKILL it when the emulator dies (``prctl(PR_SET_PDEATHSIG)``), checks the
emulator did not die before that, and then ``exec``s the real command — so even a ``kill -9`` of
the emulator leaves nothing behind. The shim runs in the child after ``fork`` and ``exec``, so it
avoids ``preexec_fn``, which is unsafe once the relay thread runs. Children get their own session
(``start_new_session``): a Ctrl-C in the terminal reaches only the emulator, which then stops
every group itself (SIGTERM, a grace period, SIGKILL).

Children must be started from the emulator's main thread: the parent-death signal follows the
thread that forked, not the process.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

__all__ = ["CHILD_SHIM", "ChildProcess", "stop_all", "wait_for"]

logger = logging.getLogger(__name__)

CHILD_SHIM = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(70)  # the emulator died before prctl took effect\n"
    "os.nice(int(sys.argv[2]))\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)
"""Runs as ``python -c CHILD_SHIM EMULATOR_PID NICE CMD...``: parent-death signal, niceness, exec."""

STOP_GRACE_S = 10.0
"""Seconds a child gets to exit after SIGTERM before its whole group is SIGKILLed."""
STARTING_GRACE_S = 1.0
"""The same for a coordinator stopped before it served: its SIGTERM handler lets it finish
starting first (model, server) only to stop then, and it has no round to drain."""


class ChildProcess:
    """One named child command; can be started again after it exited or was killed."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        nice: int = 0,
    ) -> None:
        """``nice``: added to the child's niceness (positive = lower CPU priority)."""
        self.name = name
        self.nice = nice
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.expected_exit = False
        """Set while a fault (or the emulator) is killing it on purpose."""
        self._terminated = False
        """SIGTERM was sent to this start's group (a second one means 'exit at once' to it)."""
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        if self.running:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._close_log()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed on stop
        self.starts += 1
        self._log.write(f"==== start #{self.starts}: {' '.join(self.argv)}\n".encode())
        self._log.flush()
        self.expected_exit = False
        self._terminated = False
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD_SHIM, str(os.getpid()), str(self.nice), *self.argv],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
        )
        logger.debug("started %s (pid %d)", self.name, self.process.pid)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def _signal_group(self, sig: int) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL the child's whole process group (a crash, as a fault)."""
        self.expected_exit = True
        self._signal_group(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=30)

    def terminate(self) -> None:
        """SIGTERM the child's group, once per start; ``stop`` waits for it."""
        if self.process is None:
            return
        self.expected_exit = True
        if self.process.poll() is None and not self._terminated:
            self._terminated = True
            self._signal_group(signal.SIGTERM)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL the group; always reaps the child."""
        if self.process is None:
            return
        self.terminate()
        if self.process.poll() is None:
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s; killing it", self.name, grace_s)
        # Whatever the leader did, nothing of its group may survive it.
        self._signal_group(signal.SIGKILL)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            logger.error("%s (pid %d) survived SIGKILL", self.name, self.process.pid)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None and not self._log.closed:
            self._log.close()
        self._log = None


def stop_all(children: Sequence[ChildProcess], grace_s: float = STOP_GRACE_S) -> None:
    """Stop several children within one grace period: SIGTERM to every group first, then each
    gets what is left of ``grace_s`` before SIGKILL (one by one, N children took N periods)."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.stop(max(0.0, deadline - time.monotonic()))


def wait_for(
    condition: Callable[[], bool | object],
    timeout_s: float,
    *,
    interval_s: float = 0.05,
    what: str = "condition",
) -> object:
    """Poll ``condition`` until it returns something truthy; ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s:.0f} s")
        time.sleep(interval_s)
