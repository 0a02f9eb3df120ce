"""SIGINT / SIGTERM for the emulator: a stop request that cannot be lost.

The emulator stops by unwinding: the handler raises ``KeyboardInterrupt`` in the main thread, which
interrupts whatever it waits for (a child's start-up line, a tc command, the poll loop's sleep) and
reaches ``Emulation.run``'s clean-up. But Python runs a signal handler at the next bytecode of
the main thread, wherever that is, and an exception raised inside a finalizer (a ``__del__``,
a generator being closed) is printed as "Exception ignored" and dropped. On a loaded machine a
signal often lands there, and the run went on as if nothing had happened: SIGTERM during
start-up was lost and the emulator trained until killed.

So the handler also records the signal, and the emulator asks ``check()`` between start-up steps
and on every poll: a signal whose exception was swallowed still stops the run at the next check.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["STOP_SIGNALS", "StopSignals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Stop the run cleanly (every child stopped, report written, exit 130), whatever the
dispositions this process inherited (a shell without job control starts background commands with
SIGINT ignored)."""


class StopSignals:
    """Installs the stop handler for ``STOP_SIGNALS`` (main thread) and remembers the first."""

    def __init__(self) -> None:
        self.received: str | None = None
        """Name of the first stop signal, once one arrived."""
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            # Inherited blocked signals would never reach the handler.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
        raise KeyboardInterrupt(name)

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if a stop signal arrived (its own may have been dropped)."""
        if self.received is not None:
            raise KeyboardInterrupt(self.received)
