"""A stop signal always ends the emulator, promptly: also when its ``KeyboardInterrupt`` is raised
inside a finalizer (where Python drops it), when it arrives during the shaping probe, and when it
arrives while a namespace command runs (the command ends first, so clean-up never races it); and
the sites are stopped together, within one grace period."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from geoloco.scenarios.emulation import Emulation
from geoloco.scenarios.launcher import STARTING_GRACE_S, STOP_GRACE_S, ChildProcess, wait_for
from geoloco.scenarios.netns import list_links, list_namespaces, owner_pid, run_command
from geoloco.scenarios.scenario import parse_scenario
from geoloco.scenarios.stop_signals import StopSignals

TINY = {"workload": {"name": "mlp"}, "sites": [{"name": "a"}, {"name": "b"}]}

TINY_TOML = """
[workload]
name = "mlp"
[algorithm]
inner_steps = 5
[run]
rounds = 2
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 2.0
timeout_s = 120.0
[[sites]]
name = "a"
[[sites]]
name = "b"
"""

SIGNAL_IN_A_FINALIZER = """
import os, signal, sys
from geoloco.scenarios import cli, emulation


class SignalledWhileFinalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        len("the handler runs at the next bytecode: here, inside a finalizer, which drops its exception")


start_coordinator = emulation.Emulation._start_coordinator


def first_start_signalled(self):
    SignalledWhileFinalized()
    start_coordinator(self)


emulation.Emulation._start_coordinator = first_start_signalled
sys.exit(cli.main(sys.argv[1:]))
"""
"""Runs ``geoloco ARGS`` with a SIGTERM whose handler runs inside a finalizer just before the
coordinator starts: the window a loaded machine hits by chance, made certain."""

SIGNAL_DURING_THE_PROBE = """
import os, signal, sys
from geoloco.scenarios import cli, netns

detect_support = netns.detect_support


def signalled_probe(*args):
    os.kill(os.getpid(), signal.SIGTERM)
    return detect_support(*args)


netns.detect_support = signalled_probe
sys.exit(cli.main(sys.argv[1:]))
"""
"""Runs ``geoloco ARGS`` with a SIGTERM arriving as ``--shaping kernel`` probes the machine."""


def _run_cli(script: str, *args: str) -> tuple[int, int, str]:
    """(pid, exit status, stdout + stderr) of ``python -c script ARGS``."""
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output, _ = process.communicate(timeout=240)
    return process.pid, process.returncode, output


def test_a_stop_signal_whose_exception_a_finalizer_dropped_still_stops_the_run(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY_TOML)
    out = tmp_path / "run"
    _, returncode, output = _run_cli(SIGNAL_IN_A_FINALIZER, "emulate", str(scenario), "--out", str(out))
    # The window was hit: Python dropped the handler's exception...
    assert "Exception ignored in" in output and "KeyboardInterrupt: SIGTERM" in output, output
    # ...and the run stopped anyway, instead of training on (here: to completion).
    assert returncode == 130, output
    assert "geoloco emulate: interrupted" in output
    assert (out / "summary.md").exists()
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()


def test_a_stop_signal_during_the_shaping_probe_is_handled(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY_TOML)
    pid, returncode, output = _run_cli(
        SIGNAL_DURING_THE_PROBE, "emulate", str(scenario), "--shaping", "kernel", "--check"
    )
    # Handled (exit 130 once the probe removed what it made), not the default action (killed).
    assert returncode == 130, (returncode, output)
    assert [n for n in list_namespaces() + list_links() if owner_pid(n) == pid] == []


def test_stop_signals_remember_a_signal_whose_exception_was_dropped() -> None:
    stop = StopSignals().install()
    dropped: list[str] = []
    previous_hook = sys.unraisablehook
    sys.unraisablehook = lambda info: dropped.append(repr(info.exc_value))

    class Finalized:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            len("inside the finalizer")

    try:
        Finalized()
        assert dropped and "SIGTERM" in dropped[0]
        assert stop.received == "SIGTERM"
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            stop.check()
    finally:
        sys.unraisablehook = previous_hook
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_an_interrupted_command_ends_before_the_interrupt_is_raised(tmp_path: Path) -> None:
    marker = tmp_path / "made"
    command = [
        sys.executable, "-c", "import sys, time; time.sleep(1.5); open(sys.argv[1], 'w').close()", str(marker),
    ]

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupt)
    timer = threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    try:
        timer.start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            run_command(command)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    # What the command makes exists when the caller's clean-up runs: the command was not cut off.
    assert marker.exists()
    assert time.monotonic() - started >= 1.5


TERM_TRAPPING_CHILD = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: print('term', time.monotonic(), flush=True))\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)
"""A child that notes when SIGTERM came and carries on: only SIGKILL ends it."""


def test_shutdown_gives_every_site_its_sigterm_at_once(tmp_path: Path) -> None:
    """Sites stopped one by one took a grace period each (SIGTERM, wait, SIGKILL, next site):
    with 4 slow sites, 40 s before the coordinator was even told."""
    emulation = Emulation(parse_scenario(TINY, "tiny.toml"), tmp_path)
    for name in ("a", "b"):
        emulation.sites[name] = ChildProcess(
            name, [sys.executable, "-c", TERM_TRAPPING_CHILD], log_path=tmp_path / f"{name}.log"
        )
        emulation.sites[name].start()
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    # (The log's first line is the command, which mentions both words.)
    wait_for(lambda: all("\nready\n" in log.read_text() for log in logs), 60, what="both children ready")
    emulation.shutdown()
    assert not any(child.running for child in emulation.sites.values())
    term_times = [float(log.read_text().split("\nterm ")[1].split()[0]) for log in logs]
    # Both were told together; one by one, the second heard only after the first's grace period.
    assert abs(term_times[0] - term_times[1]) < STOP_GRACE_S / 2, term_times


def test_a_coordinator_stopped_before_it_served_gets_a_short_grace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its SIGTERM handler lets it finish starting (model, server) before it stops, and a stop
    during start-up has no round to drain: the full grace period only delayed the emulator's exit."""
    emulation = Emulation(parse_scenario(TINY, "tiny.toml"), tmp_path)
    log = tmp_path / "coordinator.log"
    emulation.coordinator = ChildProcess("coordinator", [sys.executable, "-c", TERM_TRAPPING_CHILD], log_path=log)
    emulation.coordinator.start()
    wait_for(lambda: "\nready\n" in log.read_text(), 60, what="the child ready")
    with caplog.at_level("WARNING", logger="geoloco.scenarios.launcher"):
        emulation.shutdown()
    assert not emulation.coordinator.running
    assert "\nterm " in log.read_text()  # asked first, killed after the short grace
    assert f"coordinator did not stop within {STARTING_GRACE_S:.0f} s" in caplog.text
