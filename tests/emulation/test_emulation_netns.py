"""Kernel link shaping (``--shaping kernel``): command building, capability detection, a real
namespace pair shaped by tbf and measured with a timed TCP transfer, the sweep of leftovers, and a
tiny end-to-end emulation. Where this machine cannot create namespaces, the tests that need them
skip and say why (``pytest -ra``); the fallback itself is tested everywhere, by running the CLI
where ``ip`` and ``tc`` cannot be found."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from geoloco.scenarios.netns import (
    ADDRESS_POOL,
    IFNAMSIZ,
    MODE_KERNEL,
    MODE_KERNEL_RATE,
    MODE_RELAY,
    UNSHAPED_BPS,
    CommandResult,
    KernelLinkError,
    KernelLinks,
    KernelSupport,
    choose_shaping,
    detect_support,
    free_blocks,
    list_links,
    list_namespaces,
    names_for,
    netem_args,
    owner_pid,
    plan_links,
    relay_shape,
    setup_commands,
    stale_names,
    sweep_stale,
    tbf_args,
    teardown_commands,
)
from geoloco.scenarios.shaping import LinkShape

UP = LinkShape(4e6, 0.05, 0.01, 0.01)
DOWN = LinkShape(8e6, 0.05, 0.01, 0.01)


# -- names and stale sweeping (pure) -------------------------------------------------------------


def test_names_carry_the_owner_pid_and_fit_the_kernel_limit() -> None:
    namespace, host_if, site_if = names_for(4194304, 9999)
    assert namespace == "geoloco-4194304-9999"
    assert len(host_if) <= IFNAMSIZ and len(site_if) <= IFNAMSIZ and host_if != site_if
    assert {owner_pid(n) for n in (namespace, host_if, site_if)} == {4194304}
    for foreign in ("eth0", "lo", "geoloco", "geoloco-x-1", "gl-1h", "glance", "docker0", "gl12"):
        assert owner_pid(foreign) is None, foreign


def test_stale_names_are_only_ours_and_only_of_dead_owners() -> None:
    names = [
        "geoloco-10-1", "gl10-1h", "geoloco-20-2", "gl20-2h", "geoloco-30-3", "geoloco-30-4", "eth0", "gl-x",
    ]
    stale = stale_names(names, alive=lambda pid: pid == 20, own_pid=30, active={"geoloco-30-3"})
    # 10 is dead; 20 is alive; 30 is us: our active namespace stays, an unknown one with our pid
    # (a previous process that had it) goes; foreign names are never touched.
    assert stale == ["geoloco-10-1", "gl10-1h", "geoloco-30-4"]


# -- command building (pure) ---------------------------------------------------------------------


def test_tbf_and_netem_arguments() -> None:
    assert tbf_args(8e6) == ["tbf", "rate", "8000000bit", "burst", "5000", "limit", "250000"]
    # Slow links keep the floors: a bucket of two frames, a queue above one GSO packet.
    assert tbf_args(1e5)[4] == "3028" and tbf_args(1e5)[6] == str(128 * 1024)
    # Uniform in [latency, latency + jitter]: netem draws delay ± jitter.
    assert netem_args(LinkShape(1e6, 0.05, 0.01, 0.01)) == [
        "netem", "limit", "100000", "delay", "55000us", "5000us", "loss", "1%",
    ]
    assert netem_args(LinkShape(1e6, 0.02)) == ["netem", "limit", "100000", "delay", "20000us"]


def test_setup_commands_tbf_only_shape_each_direction_on_its_egress() -> None:
    (link,) = plan_links([(UP, DOWN)], pid=1234, tokens=[7])
    commands = setup_commands(link, netem=False)
    assert commands[0] == ["ip", "netns", "add", "geoloco-1234-7"]
    assert commands[1] == [
        "ip", "link", "add", "gl1234-7h", "type", "veth", "peer", "name", "gl1234-7s",
        "netns", "geoloco-1234-7",
    ]
    qdiscs = [c for c in commands if c[0] == "tc"]
    assert qdiscs == [
        ["tc", "-n", "geoloco-1234-7", "qdisc", "add", "dev", "gl1234-7s", "root", "handle", "1:",
         *tbf_args(4e6)],
        ["tc", "qdisc", "add", "dev", "gl1234-7h", "root", "handle", "1:", *tbf_args(8e6)],
    ]
    assert not any("netem" in c for c in commands)
    assert ["ip", "-n", "geoloco-1234-7", "link", "set", "lo", "up"] in commands
    assert teardown_commands(link) == [
        ["ip", "netns", "del", "geoloco-1234-7"], ["ip", "link", "del", "gl1234-7h"],
    ]
    assert link.exec_prefix() == ["ip", "netns", "exec", "geoloco-1234-7"]


def test_setup_commands_with_netem_put_tbf_under_it() -> None:
    (link,) = plan_links([(UP, DOWN)], pid=1234, tokens=[7])
    qdiscs = [c for c in setup_commands(link, netem=True) if c[0] == "tc"]
    assert [c[c.index("dev") + 1] for c in qdiscs] == ["gl1234-7s", "gl1234-7s", "gl1234-7h", "gl1234-7h"]
    assert qdiscs[0][-len(netem_args(UP)) :] == netem_args(UP) and "root" in qdiscs[0]
    assert qdiscs[1][qdiscs[1].index("parent") + 1] == "1:1"
    assert qdiscs[1][-len(tbf_args(4e6)) :] == tbf_args(4e6)
    assert qdiscs[3][-len(tbf_args(8e6)) :] == tbf_args(8e6)


def test_plan_links_skips_used_blocks_and_gives_each_site_its_own_pair() -> None:
    used = [ipaddress.IPv4Network("10.201.0.0/24"), ipaddress.IPv4Network("192.168.0.0/16")]
    links = plan_links([(UP, DOWN)] * 3, pid=0, used=used, tokens=[1, 2, 3])
    nets = [ipaddress.IPv4Network(f"{l.host_address}/30", strict=False) for l in links]
    assert len(set(nets)) == 3
    for link, net in zip(links, nets):
        assert net.subnet_of(ADDRESS_POOL) and not net.overlaps(used[0])
        assert ipaddress.ip_address(link.site_address) in net and link.site_address != link.host_address
    assert len({l.namespace for l in links}) == 3 and len({l.host_if for l in links}) == 3
    with pytest.raises(KernelLinkError, match="free /30 blocks"):
        free_blocks([ADDRESS_POOL], 1)


def test_relay_keeps_what_the_kernel_does_not_shape() -> None:
    assert relay_shape(UP, MODE_RELAY) == UP
    assert relay_shape(UP, MODE_KERNEL_RATE) == LinkShape(UNSHAPED_BPS, 0.05, 0.01, 0.01)
    assert relay_shape(UP, MODE_KERNEL) == LinkShape(UNSHAPED_BPS)


# -- capability detection and the plan ----------------------------------------------------------


class FakeRunner:
    """Records commands; fails the first command whose words contain ``fail_on``."""

    def __init__(self, fail_on: str | None, error: str) -> None:
        self.fail_on = fail_on
        self.error = error
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> CommandResult:
        self.calls.append(list(argv))
        if self.fail_on is not None and self.fail_on in argv:
            return CommandResult(2, self.error)
        return CommandResult(0, "")


def test_detect_support_without_netem_cleans_up_its_probe() -> None:
    runner = FakeRunner("netem", "Error: Specified qdisc kind is unknown.")
    support = detect_support(runner)
    assert (support.netns, support.veth, support.tbf, support.netem) == (True, True, True, False)
    assert "Specified qdisc kind is unknown" in support.detail
    probe = runner.calls[0][3]
    assert owner_pid(probe) == os.getpid()
    assert ["ip", "netns", "del", probe] in runner.calls


def test_detect_support_without_permission_touches_nothing_else() -> None:
    runner = FakeRunner("add", "mount --make-shared /run/netns failed: Operation not permitted")
    support = detect_support(runner)
    assert support == KernelSupport(False, False, False, False, support.detail)
    assert "Operation not permitted" in support.detail
    assert len(runner.calls) == 1  # nothing was created, so nothing is deleted


def test_an_interrupted_probe_still_removes_what_its_command_may_have_made() -> None:
    class InterruptedRunner(FakeRunner):
        def __call__(self, argv: Sequence[str]) -> CommandResult:
            result = super().__call__(argv)
            if "veth" in argv:  # a Ctrl-C / SIGTERM while `ip link add ... veth` ran
                raise KeyboardInterrupt
            return result

    runner = InterruptedRunner(None, "")
    with pytest.raises(KeyboardInterrupt):
        detect_support(runner)
    namespace, host_if = runner.calls[0][3], runner.calls[1][3]
    assert ["ip", "netns", "del", namespace] in runner.calls
    assert ["ip", "link", "del", host_if] in runner.calls


def test_choose_shaping_says_what_it_falls_back_to() -> None:
    relay = choose_shaping("relay", None)
    assert relay.mode == MODE_RELAY and relay.fallback is None and not relay.uses_namespaces
    none = choose_shaping("kernel", KernelSupport(False, False, False, False, "Operation not permitted"))
    assert none.mode == MODE_RELAY and not none.uses_namespaces
    assert none.fallback is not None
    assert "network namespaces not available here (Operation not permitted)" in none.fallback
    assert "falling back to portable relay shaping" in none.fallback
    assert "kernel shaping unavailable" in none.description
    rate = choose_shaping("kernel", KernelSupport(True, True, True, False, "qdisc kind is unknown"))
    assert rate.mode == MODE_KERNEL_RATE and rate.uses_namespaces
    assert rate.fallback is not None and "netem qdisc is not available" in rate.fallback
    assert "latency, jitter and loss in the userspace relay" in rate.description
    full = choose_shaping("kernel", KernelSupport(True, True, True, True))
    assert full.mode == MODE_KERNEL and full.fallback is None and "netem" in full.description
    with pytest.raises(ValueError, match="choose one of: relay, kernel"):
        choose_shaping("tc", None)


def test_a_failing_setup_command_is_reported_and_what_was_made_is_removed() -> None:
    links = plan_links([(UP, DOWN), (UP, DOWN)], pid=1234, tokens=[1, 2])
    runner = FakeRunner("tbf", "Error: Specified qdisc kind is unknown.")
    kernel = KernelLinks(links, netem=False, runner=runner)
    with pytest.raises(KernelLinkError, match=r"`tc -n geoloco-1234-1 qdisc add .*tbf.*` failed .*qdisc kind"):
        kernel.create()
    # The first link was half made: its namespace and link are deleted; the second never started.
    assert ["ip", "netns", "del", "geoloco-1234-1"] in runner.calls
    assert ["ip", "link", "del", "gl1234-1h"] in runner.calls
    assert not any("geoloco-1234-2" in c for c in runner.calls)
    calls = len(runner.calls)
    kernel.close()  # idempotent
    assert len(runner.calls) == calls


# -- real namespaces -----------------------------------------------------------------------------

CLIENT = """
import socket, sys, time
host, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with socket.create_connection((host, port), timeout=30) as s:
    assert s.recv(1) == b"g"  # the server's clock runs: upload
    s.sendall(b"u" * nbytes)
    assert s.recv(1) == b"k"  # all of it arrived
    started = time.monotonic()
    s.sendall(b"g")  # our clock runs: the download may start
    got = 0
    while data := s.recv(65536):
        got += len(data)
    print(got, time.monotonic() - started)
"""
"""Each direction is timed by its receiver from a moment before the sender may start, so a
receiver that a loaded machine runs late can only lengthen the measured time, never shorten it."""


def _serve_once(server: socket.socket, nbytes: int, result: dict[str, float]) -> None:
    """Time the upload of ``nbytes`` (from the go-ahead to the last byte), then send as many back."""
    conn, _ = server.accept()
    with conn:
        started = time.monotonic()
        conn.sendall(b"g")
        got = 0
        while got < nbytes and (data := conn.recv(min(65536, nbytes - got))):
            got += len(data)
        result["up_s"] = time.monotonic() - started
        result["up_bytes"] = got
        conn.sendall(b"k")
        assert conn.recv(1) == b"g"
        conn.sendall(b"d" * nbytes)


def _qdisc_stats(dev: str, namespace: str | None = None) -> tuple[str, int]:
    """(the tbf's rate as tc shows it, its overlimits: packets that had to wait for tokens)."""
    tc = ["tc", *(["-n", namespace] if namespace else []), "-s", "qdisc", "show", "dev", dev]
    shown = subprocess.run(tc, capture_output=True, text=True, check=True).stdout
    rate = re.search(r"tbf .*?rate (\S+)", shown)
    overlimits = re.search(r"overlimits (\d+)", shown)
    assert rate and overlimits, shown
    return rate[1], int(overlimits[1])


def _leftovers(pid: int) -> list[str]:
    return [n for n in list_namespaces() + list_links() if owner_pid(n) == pid]


@pytest.fixture(scope="module")
def support() -> KernelSupport:
    return detect_support()


def _require(support: KernelSupport, *needs: str) -> None:
    """Skip, saying what is missing and why, unless this machine can do ``needs``."""
    missing = [need for need in needs if not getattr(support, need)]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)} (root, iproute2): {support.detail}")


def test_tbf_shapes_a_timed_transfer_through_a_namespace_pair(support: KernelSupport) -> None:
    _require(support, "netns", "veth", "tbf")
    up, down = LinkShape(4e6), LinkShape(8e6)
    (link,) = plan_links([(up, down)], pid=os.getpid())
    links = KernelLinks([link], netem=False)
    nbytes = 600_000  # 1.2 s up at 4 Mbit/s, 0.6 s down at 8 Mbit/s
    try:
        links.create()
        assert link.namespace in list_namespaces() and link.host_if in list_links()
        server = socket.create_server((link.host_address, 0))
        result: dict[str, float] = {}
        thread = threading.Thread(target=_serve_once, args=(server, nbytes, result), daemon=True)
        thread.start()
        client = subprocess.run(
            [*link.exec_prefix(), sys.executable, "-c", CLIENT, link.host_address,
             str(server.getsockname()[1]), str(nbytes)],
            capture_output=True, timeout=60, check=True,
        )
        thread.join(timeout=30)
        server.close()
        down_bytes, down_s = client.stdout.split()
        down_rate, down_waits = _qdisc_stats(link.host_if)
        up_rate, up_waits = _qdisc_stats(link.site_if, link.namespace)
    finally:
        links.close()
    assert result["up_bytes"] == nbytes and int(down_bytes) == nbytes
    # The kernel shapes at the rates asked for, and both transfers had to wait for its tokens.
    assert (up_rate, down_rate) == ("4Mbit", "8Mbit")
    assert up_waits > 0 and down_waits > 0
    # Goodput is below the line rate by the TCP/IP/Ethernet headers (~4.5 %) tbf counts too, and
    # each time runs from before its first byte could be sent, so a loaded machine only lowers the
    # ratio: the upper bound is strict (an unshaped veth would be hundreds of times faster); the
    # lower one only catches a rate off by a unit (bytes taken for bits: 0.125).
    up_ratio = nbytes * 8 / result["up_s"] / up.bandwidth_bps
    down_ratio = nbytes * 8 / float(down_s) / down.bandwidth_bps
    assert 0.25 < up_ratio < 1.05, up_ratio
    assert 0.25 < down_ratio < 1.05, down_ratio
    assert _leftovers(os.getpid()) == []


def test_sweep_removes_what_a_killed_emulator_left(support: KernelSupport) -> None:
    _require(support, "netns", "veth")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    namespace, host_if, site_if = names_for(dead.pid, 1)
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    subprocess.run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", site_if], check=True)
    try:
        removed = sweep_stale()
        assert namespace in removed and host_if in removed
        assert _leftovers(dead.pid) == []
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)


TINY_TOML = """
[workload]
name = "mlp"
[algorithm]
inner_steps = 5
uplink_codec = "int8"
[run]
rounds = 2
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 2.0
timeout_s = 120.0
[[sites]]
name = "a"
uplink_bps = 4e6
downlink_bps = 8e6
latency_s = 0.02
[[sites]]
name = "b"
uplink_bps = 2e6
downlink_bps = 4e6
latency_s = 0.05
"""


def test_emulate_with_kernel_shaping_completes_and_names_the_shaping_used(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY_TOML)
    out = tmp_path / "run"
    expected = choose_shaping("kernel", detect_support())
    process = subprocess.Popen(
        [sys.executable, "-m", "geoloco.scenarios.cli", "emulate", str(scenario), "--out", str(out),
         "--shaping", "kernel"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        stdout, stderr = process.communicate(timeout=300)
    finally:  # a run that hung is not left training
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    output = stdout.decode() + stderr.decode()
    assert process.returncode == 0, output
    assert f"link shaping: {expected.description}" in output
    if expected.fallback:
        assert expected.fallback in output
    summary = (out / "summary.md").read_text()
    assert f"- link shaping: {expected.description}" in summary
    assert "status: **completed**" in summary
    site_log = (out / "logs" / "a.log").read_text()
    # Each site ran inside its own namespace exactly when the plan uses namespaces.
    assert ("ip netns exec geoloco-" in site_log) == expected.uses_namespaces
    assert _leftovers(process.pid) == []


def test_without_ip_and_tc_kernel_shaping_falls_back_to_the_relay_and_says_why(tmp_path: Path) -> None:
    """The fallback on a machine without iproute2 (here: a PATH where neither ``ip`` nor ``tc`` is
    found), whatever this machine has."""
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY_TOML)
    done = subprocess.run(
        [sys.executable, "-m", "geoloco.scenarios.cli", "emulate", str(scenario), "--shaping", "kernel", "--check"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "--shaping kernel: network namespaces not available here (the 'ip' command (iproute2) is not "
        "installed); falling back to portable relay shaping" in done.stderr
    )
    assert "link shaping: relay (portable)" in done.stdout
    assert "(kernel shaping unavailable: no network namespaces)" in done.stdout


START_UP_BOUND_S = 300.0
"""Seconds the emulator may take to create its namespaces: start-up took over 60 s on a loaded
machine (imports, the shaping probe), so only a hang exceeds this."""
STOP_BOUND_S = 120.0
"""Seconds a SIGTERMed emulator may take to stop every child, remove its namespaces and write its
report: about 20 s seen under heavy load; a lost signal never ends."""


@contextmanager
def _kernel_emulation(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], list[str], Path]]:
    """``geoloco emulate --shaping kernel``, its namespaces (once they exist) and its output file;
    killed and swept afterwards whatever the test did, so a failure leaves nothing running."""
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY_TOML.replace("rounds = 2", "rounds = 100000"))
    log = tmp_path / "emulator.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "geoloco.scenarios.cli", "emulate", str(scenario), "--out",
             str(tmp_path / "run"), "--shaping", "kernel"],
            stdout=output, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + START_UP_BOUND_S
        while len(ours := [n for n in list_namespaces() if owner_pid(n) == process.pid]) < 2:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"no namespaces within {START_UP_BOUND_S:g} s:\n{log.read_text()}"
            time.sleep(0.05)
        yield process, ours, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        sweep_stale()


def test_sigterm_during_start_up_removes_every_namespace(tmp_path: Path, support: KernelSupport) -> None:
    _require(support, "netns", "veth", "tbf")
    with _kernel_emulation(tmp_path) as (process, namespaces, log):
        process.terminate()
        try:
            process.wait(timeout=STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {STOP_BOUND_S:g} s after SIGTERM:\n{log.read_text()}") from None
        assert process.returncode == 130, log.read_text()
        assert not set(namespaces) & set(list_namespaces())
        assert _leftovers(process.pid) == []


def test_a_sigkilled_emulator_leaves_namespaces_that_the_next_run_sweeps(
    tmp_path: Path, support: KernelSupport
) -> None:
    _require(support, "netns", "veth", "tbf")
    with _kernel_emulation(tmp_path) as (process, namespaces, _):
        process.kill()
        process.wait(timeout=30)
        # Nothing could clean up after SIGKILL; the names carry the dead pid, so a later run can.
        assert set(namespaces) <= set(list_namespaces())
        removed = sweep_stale()
        assert set(namespaces) <= set(removed)
        assert _leftovers(process.pid) == []
