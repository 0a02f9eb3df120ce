"""Real ``geoloco coordinator`` / ``geoloco site`` processes for integration tests.

Each process runs ``python -m geoloco.scenarios.cli ...`` in its own session (process group), so
``kill -9`` reaches it and everything it started. Its stdout is read line by line by a thread;
tests wait for a line matching a pattern (a condition with a timeout, never a fixed sleep). The
CLIs print machine-readable lines for exactly this (see ``geoloco.scenarios.coordinator_cmd`` and
``geoloco.scenarios.site_cmd``). stderr (the logs) goes to a file, quoted when a wait fails.

``Processes`` is a context manager: on exit every process still running is killed with SIGKILL
and reaped, so a failing test leaves nothing behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

CLI = [sys.executable, "-m", "geoloco.scenarios.cli"]
WAIT_S = 120.0
"""Upper bound of one wait; generous because a fresh process imports torch (seconds on a loaded
2-core machine). Only a hang gets near it."""

LISTENING = re.compile(r"^geoloco-coordinator listening on (?P<host>\S+):(?P<port>\d+)$")
STARTING = re.compile(r"^geoloco-coordinator starting at round (?P<round>\d+) \((?P<how>[^)]*)\)$")
COORDINATOR_ROUND = re.compile(
    r"^geoloco-coordinator round (?P<round>\d+) done: participants=(?P<participants>\S+) "
    r"excluded=(?P<excluded>\S+) eval_loss=(?P<eval_loss>\S+) digest=(?P<digest>[0-9a-f]+)$"
)
COORDINATOR_END = re.compile(
    r"^geoloco-coordinator (?P<how>finished|stopped \(\w+\)): "
    r"round=(?P<round>\d+) digest=(?P<digest>[0-9a-f]+)$"
)
SITE_JOINED = re.compile(
    r"^geoloco-site (?P<site>\S+) joined session (?P<session>[0-9a-f]+) at round (?P<round>\d+)$"
)
SITE_ROUND = re.compile(
    r"^geoloco-site (?P<site>\S+) round (?P<round>\d+): loss=(?P<loss>\S+) included=(?P<included>yes|no) "
    r"contributors=(?P<contributors>\d+) next_round=(?P<next_round>\d+) digest=(?P<digest>[0-9a-f]+)$"
)
SITE_END = re.compile(
    r"^geoloco-site (?P<site>\S+) (?P<how>finished|stopped \(\w+\)): final_round=(?P<final_round>\d+) "
    r"rounds_trained=(?P<rounds_trained>\d+) rounds_included=(?P<rounds_included>\d+) "
    r"run_finished=(?P<run_finished>yes|no) digest=(?P<digest>[0-9a-f]*)$"
)


def names(field: str) -> set[str]:
    """``"a,b"`` -> {"a", "b"}; ``"-"`` -> empty."""
    return set() if field == "-" else set(field.split(","))


def process_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # several processes share 2 cores; one thread each is fastest
    return env


class Process:
    """One CLI process: its stdout lines, waits on them, signals to its process group."""

    def __init__(self, label: str, args: list[str], log_dir: Path, command: list[str] | None = None) -> None:
        """``command``: what runs with ``args`` (default the CLI, ``python -m geoloco.scenarios.cli``)."""
        self.label = label
        self.args = args
        self.stderr_path = log_dir / f"{label}.stderr.log"
        self._stderr = open(self.stderr_path, "w")  # noqa: SIM115 - closed in reap()
        self.popen = subprocess.Popen(
            [*(CLI if command is None else command), *args],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
            text=True,
            env=process_env(),
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._eof = False
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"read-{label}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def describe(self) -> str:
        stderr = self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""
        return (
            f"--- {self.label}: {' '.join(self.args)} (exit status {self.popen.poll()})\n"
            f"stdout:\n" + "\n".join(self.lines[-40:]) + f"\nstderr (tail):\n{stderr[-6000:]}"
        )

    def wait_line(
        self,
        pattern: re.Pattern[str],
        *,
        start: int = 0,
        where: Callable[[re.Match[str]], bool] | None = None,
        what: str = "",
        timeout_s: float = WAIT_S,
    ) -> tuple[int, re.Match[str]]:
        """The first stdout line at index >= ``start`` that matches ``pattern`` (and ``where``),
        with its index. Fails, quoting the process's output, when the process ends first or after
        ``timeout_s``; ``what`` says what was awaited."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            index = start
            while True:
                while index < len(self.lines):
                    match = pattern.match(self.lines[index])
                    if match and (where is None or where(match)):
                        return index, match
                    index += 1
                remaining = deadline - time.monotonic()
                if self._eof or remaining <= 0:
                    break
                self._cond.wait(remaining)
        why = "ended" if self._eof else f"printed nothing matching within {timeout_s:.0f} s"
        raise AssertionError(
            f"{self.label} {why} (waiting for {what or pattern.pattern!r})\n{self.describe()}"
        )

    def wait_exit(self, timeout_s: float = WAIT_S) -> int:
        try:
            code = self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.label} still running after {timeout_s:.0f} s\n{self.describe()}"
            ) from None
        self._reader.join(timeout_s)
        return code

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process group (the re-executed interpreter keeps the pid)."""
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def reap(self) -> None:
        if self.popen.poll() is None:
            self.kill(signal.SIGKILL)
        self.popen.wait(30)
        self._reader.join(30)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._stderr.close()


class Processes:
    """Starts CLI processes and kills whatever is left of them on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[Process] = []

    def start(self, label: str, *args: str, command: list[str] | None = None) -> Process:
        process = Process(label, list(args), self.log_dir, command)
        self.started.append(process)
        return process

    def describe(self) -> str:
        return "\n".join(p.describe() for p in self.started)

    def __enter__(self) -> Processes:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for process in self.started:
            process.reap()
