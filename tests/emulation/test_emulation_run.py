"""End to end: a tiny 2-site emulation with a fault, and no process left behind — after success,
after a failing child, after Ctrl-C and after the emulator itself is SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from geoloco.scenarios.emulation import Emulation
from geoloco.scenarios.launcher import wait_for
from geoloco.scenarios.report import write_report
from geoloco.scenarios.scenario import parse_scenario

TINY = {
    "workload": {"name": "mlp"},
    "algorithm": {"name": "diloco", "inner_steps": 5, "uplink_codec": "int8"},
    "run": {"rounds": 4, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 2.0, "timeout_s": 120.0},
    "sites": [
        {"name": "a", "uplink_bps": 4e6, "downlink_bps": 8e6, "latency_s": 0.02},
        {"name": "b", "uplink_bps": 2e6, "downlink_bps": 4e6, "latency_s": 0.05},
    ],
}


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """Live processes whose command line contains ``text`` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append((int(entry.name), cmdline))
    return found


def assert_no_children_left(out: Path) -> None:
    # Reaped children disappear at once; a SIGKILLed group may need a moment to be torn down.
    try:
        wait_for(lambda: not processes_mentioning(str(out)), 15, what="every child gone")
    except TimeoutError:
        raise AssertionError(f"processes left behind: {processes_mentioning(str(out))}") from None


def test_two_sites_with_a_killed_site_finish_and_report(tmp_path: Path) -> None:
    out = tmp_path / "run"
    raw = dict(TINY, faults=[{"kind": "kill_site", "site": "b", "at_round": 1, "down_s": 0.5}])
    scenario = parse_scenario(raw, "tiny.toml")
    result = Emulation(scenario, out).run()
    assert result.status == "completed", result.reason
    rounds = sorted({int(r["round"]) for r in result.records})
    assert rounds == [0, 1, 2, 3], "no round lost"
    assert result.records[-1]["run_finished"] is True
    # The fault fired once, b was killed and started again, and contributed afterwards.
    (event,) = result.faults
    assert event.fault.kind == "kill_site" and event.restored_s is not None
    assert event.restored_s >= event.fired_s + 0.5
    assert len(result.site_starts["b"]) == 2 and len(result.site_starts["a"]) == 1
    after = [r for r in result.records if r["observed_s"] >= event.restored_s]
    assert any("b" in r["participants"] for r in after)
    # Bytes really went through the shaped links (TLS + gRPC: more than the payload).
    payload_up = sum(int(r["bytes_up"].get("a", 0)) for r in result.records)
    assert result.wire_bytes["a"][0] > payload_up > 0

    summary, fidelity = write_report(result)
    text = summary.read_text()
    assert "kill site b (SIGKILL), restart after 0.5 s" in text
    assert "b contributed again in round" in text
    assert "| a |" in text and "| b |" in text and "**total**" in text
    assert fidelity.skipped is not None and "faults" in fidelity.skipped
    for name in ("loss_vs_round", "loss_vs_bytes", "loss_vs_time", "timeline"):
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(result.records) and json.loads(lines[0])["round"] == 0
    assert (out / "certs" / "ca.crt").exists() and (out / "certs" / "b.key").exists()
    assert_no_children_left(out)


def test_a_failing_site_stops_everything_and_says_why(tmp_path: Path) -> None:
    out = tmp_path / "run"
    emulation = Emulation(parse_scenario(TINY, "tiny.toml"), out)
    good = emulation.site_command

    def command(index: int) -> list[str]:
        if index == 1:
            return [sys.executable, "-c", "import sys; print('disk on fire'); sys.exit(3)"]
        return good(index)

    emulation.site_command = command  # type: ignore[method-assign]
    result = emulation.run()
    assert result.status == "failed"
    assert "site b exited with status 3" in result.reason
    assert "disk on fire" in result.reason
    assert_no_children_left(out)


IGNORING_SIGINT = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
)
"""Runs ``python ARGS`` with SIGINT ignored, as a shell without job control starts a background
command (and as this test's own process may have inherited it)."""


def _start_cli(tmp_path: Path, *, sigint_ignored: bool = False) -> tuple[subprocess.Popen[bytes], Path]:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(
        "[workload]\nname = \"mlp\"\n[algorithm]\ninner_steps = 5\n[run]\nrounds = 100000\n"
        "[[sites]]\nname = \"a\"\n[[sites]]\nname = \"b\"\n"
    )
    out = tmp_path / "run"
    prefix = ["-c", IGNORING_SIGINT] if sigint_ignored else []
    process = subprocess.Popen(
        [sys.executable, *prefix, "-m", "geoloco.scenarios.cli", "emulate", str(scenario), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    # Wait until the coordinator and both sites are up and training.
    wait_for(
        lambda: process.poll() is not None
        or ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size > 0),
        90,
        what="the first aggregated round",
    )
    assert process.poll() is None, process.stdout.read().decode()  # type: ignore[union-attr]
    assert len(processes_mentioning(str(out))) >= 4  # emulator, coordinator, two sites
    return process, out


def test_ctrl_c_stops_every_child(tmp_path: Path) -> None:
    # Started with SIGINT ignored: whatever disposition the emulator inherits (a suite run from a
    # shell without job control passes SIG_IGN down), SIGINT must stop the run. Relying on
    # Python's default handler made this test fail whenever the suite ran that way.
    process, out = _start_cli(tmp_path, sigint_ignored=True)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 130, output.decode()
    assert b"interrupted" in output
    assert (out / "summary.md").exists()
    assert_no_children_left(out)


def test_children_die_with_a_killed_emulator(tmp_path: Path) -> None:
    process, out = _start_cli(tmp_path)
    process.kill()
    process.wait(timeout=10)
    assert_no_children_left(out)


def test_child_shim_refuses_to_run_when_the_parent_is_already_gone() -> None:
    from geoloco.scenarios.launcher import CHILD_SHIM

    # A parent pid that is not ours: the shim exits instead of exec-ing an orphan.
    result = subprocess.run(
        [sys.executable, "-c", CHILD_SHIM, "1", "0", "echo", "orphan"], capture_output=True, timeout=30
    )
    assert result.returncode == 70
    assert b"orphan" not in result.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_sigterm_is_handled_like_ctrl_c(tmp_path: Path, sig: int) -> None:
    start = time.monotonic()
    process, out = _start_cli(tmp_path)
    process.send_signal(sig)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 130, output.decode()
    assert_no_children_left(out)
    assert time.monotonic() - start < 120
