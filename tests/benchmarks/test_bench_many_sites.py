"""``benchmarks/bench_many_sites.py``: 256 real sites on one coordinator, reported, and no process left behind.

The benchmark's figures are not asserted (README, "Benchmarks"); what is checked is that the
harness works end to end (a real coordinator process, sites in worker processes), that a
``--study`` through real secure sites ends where the simulator does, and that its processes end
both when it finishes and when it is killed mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_many_sites.py"


def _ours(marker: str, also: str = "") -> list[int]:
    """Pids of live processes whose command line mentions ``marker`` (and ``also``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and also in cmdline:
            pids.append(int(entry.name))
    return pids


def _wait_until(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s} s")
        time.sleep(0.1)


def _start(tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    # The driver's temporary folder (named on every child's command line) lies under tmp_path.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    return subprocess.Popen(
        [sys.executable, str(BENCH), "--workers", "2", "--json", str(tmp_path / "out.json"), *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def test_256_real_sites_on_one_coordinator_all_count_in_every_round(tmp_path: Path) -> None:
    """256 site agents in two worker processes, each over its own TCP connection, on one real
    coordinator process (issue 30's CI size): every site's update counts in both rounds, none is
    dropped or fails, and the harness reports and leaves nothing behind."""
    driver = _start(tmp_path, "--sites", "256", "--mode", "plain", "--rounds", "2")
    output, _ = driver.communicate(timeout=480)
    assert driver.returncode == 0, output
    assert "| plain | 256 |" in output
    result = json.loads((tmp_path / "out.json").read_text())["results"][0]
    assert result["finished"] and result["rounds"] == 2 and result["site_failures"] == 0
    assert result["participants"] == [256, 256] and result["dropped"] == 0
    # One TCP connection per site, counted at every round's end. Channels that shared a
    # connection would show about 2 (one per worker process), channels that opened several 512 or
    # more. Under load a few sites' channels are reconnecting at any moment (a missed keepalive):
    # between their old and new connection they hold none or two, so a count is within a few of
    # 256 (measured under two busy-loops: 250, 254, 257), never exactly 256 by rule.
    assert 256 - 8 <= result["connections"] <= 256 and result["connections_max"] <= 256 + 8, result
    assert result["cpu_per_round_s"] > 0 and result["max_threads"] > 0
    assert not _ours(str(tmp_path))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("geoloco-many-sites-")]


def test_light_sites_speak_the_protocol_and_all_count(tmp_path: Path) -> None:
    """``--client light``: site threads that upload a fixed update and read the broadcast
    without training, over mutual TLS. Every one counts in every round, each over its own
    connection, so what the harness measures at a thousand sites is a real round's traffic."""
    driver = _start(tmp_path, "--sites", "96", "--mode", "tls", "--rounds", "3", "--client", "light")
    output, _ = driver.communicate(timeout=300)
    assert driver.returncode == 0, output
    assert "light site threads" in output and "| mutual TLS | 96 |" in output, output
    result = json.loads((tmp_path / "out.json").read_text())["results"][0]
    assert result["finished"] and result["site_failures"] == 0 and result["dropped"] == 0, result
    assert result["participants"] == [96, 96, 96]
    # One connection per site: shared channels would show about 2 (one per worker), channels that
    # opened several far more than 96. The most seen at a round's end is held to N; the fewest is
    # not: a read of /proc/net/tcp at one round's end found 64 of 96 while the whole suite loaded
    # the machine, where a quiet run of 40 rounds found 96 at every end (and `ss` all 96 open
    # throughout).
    assert 96 - 8 <= result["connections_max"] <= 96 + 8, result
    assert not _ours(str(tmp_path))


def test_light_sites_refuse_what_they_cannot_do(tmp_path: Path) -> None:
    """Light sites neither train nor mask: secure aggregation is a usage error naming the way."""
    driver = _start(tmp_path, "--sites", "8", "--mode", "secure", "--client", "light")
    output, _ = driver.communicate(timeout=60)
    assert driver.returncode == 2 and "use --client agent for secure" in output, output


STUDY = Path(__file__).resolve().parents[2] / "scenarios" / "privacy_frontier.toml"


def _study(tmp_path: Path, *overrides: str) -> tuple[dict, list[dict]]:  # type: ignore[type-arg]
    """The privacy frontier's file at 6 sites and 2 rounds through real secure sites, and once in
    the simulator at its seed: (the real run's result, the simulator's runs)."""
    sets = [arg for o in ("run.rounds=2", *overrides) for arg in ("--set", o)]
    driver = _start(tmp_path, "--sites", "6", "--mode", "secure", "--study", str(STUDY), *sets, "--simulator-runs", "1")
    output, _ = driver.communicate(timeout=300)
    assert driver.returncode == 0, output
    report = json.loads((tmp_path / "out.json").read_text())
    assert not _ours(str(tmp_path))
    return report["results"][0], report["simulator"]


def test_a_secure_study_through_real_sites_ends_on_the_simulators_loss(tmp_path: Path) -> None:
    """Secure aggregation without DP: 6 real sites (mutual TLS, SecAgg+ masks over gRPC), each on
    its share of the workload's data, end on the simulator's final eval loss bit for bit. (With
    DP the noise is the OS's on both sides; benchmarks/pages/many-sites.md compares epsilon and
    the loss's spread at 256 sites.)"""
    real, simulator = _study(tmp_path, "privacy.dp=off")
    assert real["participants"] == [6, 6] and simulator[0]["participants"] == [6, 6]
    assert real["final_eval_loss"] == simulator[0]["final_eval_loss"]
    assert real["epsilon"] is None and simulator[0]["epsilon"] is None


def test_killed_driver_leaves_no_process(tmp_path: Path) -> None:
    driver = _start(tmp_path, "--sites", "3", "--mode", "plain", "--rounds", "50")
    try:
        _wait_until(lambda: _ours(str(tmp_path), "--role worker"), 120, "no worker process started")
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        _wait_until(lambda: not _ours(str(tmp_path)), 30, "the coordinator and workers did not exit")
    finally:
        if driver.poll() is None:
            driver.kill()
        if driver.stdout is not None:
            driver.stdout.close()
