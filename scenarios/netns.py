"""Kernel link shaping (``geoloco emulate --shaping kernel``): a network namespace per site.

Each site process runs inside its own network namespace (``ip netns exec NS ...``), joined to the
emulator's namespace by a veth pair with a ``/30`` of its own. The site dials its relay at the
emulator's end of the pair, so every byte crosses the veth, where ``tc`` shapes it:

- **uplink** (site -> emulator): qdiscs on the site's end, inside its namespace;
- **downlink** (emulator -> site): qdiscs on the emulator's end.

``tbf`` enforces the bandwidth. ``netem`` adds one-way latency, jitter (uniform in
``[latency, latency + jitter]``, as the relay draws it) and packet loss (real drops that TCP
retransmits), with ``tbf`` as its child. Where the kernel has ``tbf`` but no ``netem`` (common in
containers), the bandwidth is shaped by the kernel and latency, jitter and loss stay in the
portable relay; without namespace permissions the emulator falls back to the relay entirely.
``detect_support`` finds out which by trying, on a throw-away namespace, and ``choose_shaping``
turns that into a ``ShapingPlan`` whose one-line description goes to the log and ``summary.md``.

The relay stays in the path in every mode: it measures each site's bytes and transfer bursts
(progress, report) and implements link cuts. In kernel modes it forwards unshaped what the kernel
shapes.

Only namespaces and links this module creates are touched. Their names carry the owning process's
pid (``geoloco-PID-K`` namespaces, ``glPID-Kh`` / ``glPID-Ks`` links) so that ``sweep_stale``
can remove what an emulator killed by SIGKILL left behind, and nothing that belongs to a live one.

Pure command building (``*_commands``, ``plan_links``, ``stale_names``) is separate from running
the commands (``run_command``, ``KernelLinks``), so the former is tested without privileges.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from geoloco.scenarios.shaping import LinkShape

__all__ = [
    "MODE_KERNEL",
    "MODE_KERNEL_RATE",
    "MODE_RELAY",
    "CommandResult",
    "KernelLinkError",
    "KernelLinks",
    "KernelSupport",
    "ShapingPlan",
    "SiteLink",
    "choose_shaping",
    "detect_support",
    "free_blocks",
    "list_links",
    "list_namespaces",
    "names_for",
    "netem_args",
    "owner_pid",
    "plan_links",
    "relay_send_buffer",
    "relay_shape",
    "run_command",
    "setup_commands",
    "stale_names",
    "sweep_stale",
    "tbf_args",
    "teardown_commands",
    "used_networks",
]

logger = logging.getLogger(__name__)

ShapingMode = Literal["relay", "kernel-rate", "kernel"]
MODE_RELAY: ShapingMode = "relay"
"""Everything in the userspace relay (portable, no privileges)."""
MODE_KERNEL_RATE: ShapingMode = "kernel-rate"
"""Bandwidth by ``tbf`` in the kernel; latency, jitter and loss in the relay (no ``netem``)."""
MODE_KERNEL: ShapingMode = "kernel"
"""Bandwidth by ``tbf``, latency, jitter and loss by ``netem``; the relay only measures."""

NETNS_PREFIX = "geoloco-"
"""Namespace names: ``geoloco-PID-K``."""
LINK_PREFIX = "gl"
"""Link names: ``glPID-Kh`` (emulator end) and ``glPID-Ks`` (site end); at most 15 characters."""
IFNAMSIZ = 15
LINK_COUNTER_MODULO = 10_000
"""K wraps here so that names stay within ``IFNAMSIZ`` (links of finished runs are gone)."""

ADDRESS_POOL = ipaddress.IPv4Network("10.201.0.0/16")
"""Private addresses for the veth pairs, one ``/30`` per site; blocks already in use on this
machine (addresses or routes) are skipped."""
LINK_PREFIX_LEN = 30

UNSHAPED_BPS = 100e9
"""Relay bandwidth when the kernel shapes the rate: far above any emulated link."""
TBF_MIN_BURST_BYTES = 3028
"""Bucket depth floor: two full-size Ethernet frames (tbf needs at least one MTU)."""
TBF_BURST_S = 0.005
"""Bucket depth in seconds of traffic at the link's rate (above the floor)."""
TBF_QUEUE_S = 0.25
"""Queue in seconds of traffic at the link's rate before tbf drops (a WAN router's buffer)."""
TBF_MIN_QUEUE_BYTES = 128 * 1024
"""Queue floor: more than one 64 KiB GSO packet."""
NETEM_LIMIT_PACKETS = 100_000
"""netem's queue in packets: large enough for the bandwidth-delay product of any scenario."""
RELAY_MIN_SEND_BUFFER_BYTES = 16 * 1024
"""Floor of ``relay_send_buffer`` (the kernel doubles it for its own bookkeeping)."""
COMMAND_TIMEOUT_S = 30.0


class KernelLinkError(RuntimeError):
    """A namespace / link / qdisc command failed; the message has the command and its error."""


@dataclass(frozen=True, slots=True)
class CommandResult:
    returncode: int
    stderr: str


Runner = Callable[[Sequence[str]], CommandResult]
"""Runs one command line and returns its status and error text (injectable for tests)."""


def run_command(argv: Sequence[str]) -> CommandResult:
    """Run ``argv`` (no shell); a missing program is status 127 with a message, as in a shell.
    A Ctrl-C / SIGTERM while it runs is raised once it ended: killed half way (``subprocess.run``
    waits a quarter second), it could make its namespace or link after the clean-up ran."""
    try:
        process = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except FileNotFoundError:
        return CommandResult(127, f"{argv[0]}: command not found")
    deadline, interrupted = time.monotonic() + COMMAND_TIMEOUT_S, None
    with process:
        while True:
            try:
                stderr = process.communicate(timeout=max(0.0, deadline - time.monotonic()))[1]
                result = CommandResult(process.returncode, stderr.decode(errors="replace").strip())
                break
            except KeyboardInterrupt as err:
                interrupted = interrupted or err
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                result = CommandResult(124, f"{' '.join(argv)}: timed out after {COMMAND_TIMEOUT_S:g} s")
                break
    if interrupted is not None:
        raise interrupted
    return result


def _check(runner: Runner, argv: Sequence[str]) -> None:
    result = runner(argv)
    if result.returncode != 0:
        raise KernelLinkError(f"`{' '.join(argv)}` failed (status {result.returncode}): {result.stderr}")


# -- names ---------------------------------------------------------------------------------------

_counter = itertools.count()
_active: set[str] = set()
"""Names of namespaces and links this process created and has not removed yet."""


def _next_token() -> int:
    return next(_counter) % LINK_COUNTER_MODULO


def names_for(pid: int, token: int) -> tuple[str, str, str]:
    """(namespace, emulator-side link, site-side link) for link number ``token`` of ``pid``."""
    namespace = f"{NETNS_PREFIX}{pid}-{token}"
    host_if, site_if = f"{LINK_PREFIX}{pid}-{token}h", f"{LINK_PREFIX}{pid}-{token}s"
    if len(host_if) > IFNAMSIZ:
        raise ValueError(f"link name {host_if!r} is longer than the kernel's {IFNAMSIZ} characters")
    return namespace, host_if, site_if


def owner_pid(name: str) -> int | None:
    """The pid encoded in one of our namespace or link names; None for any other name."""
    if name.startswith(NETNS_PREFIX):
        rest = name[len(NETNS_PREFIX) :]
    elif name.startswith(LINK_PREFIX):
        rest = name[len(LINK_PREFIX) :]
    else:
        return None
    pid, sep, tail = rest.partition("-")
    if not (sep and pid.isdigit() and tail):
        return None
    return int(pid)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_names(
    names: Iterable[str], *, alive: Callable[[int], bool], own_pid: int, active: set[str]
) -> list[str]:
    """Our names whose owner is dead, or that carry our pid but are not ours (a previous
    process with the same pid): safe to remove. Foreign names are never returned."""
    stale = []
    for name in names:
        pid = owner_pid(name)
        if pid is None:
            continue
        if (pid == own_pid and name not in active) or (pid != own_pid and not alive(pid)):
            stale.append(name)
    return stale


# -- pure command building -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SiteLink:
    """One site's namespace and veth pair, and how each direction is shaped in the kernel."""

    namespace: str
    host_if: str
    """The emulator's end, in the emulator's namespace; its egress is the site's downlink."""
    site_if: str
    """The site's end, inside ``namespace``; its egress is the site's uplink."""
    host_address: str
    """What the site dials (its relay listens here); in the coordinator certificate's SANs."""
    site_address: str
    up: LinkShape
    down: LinkShape

    def exec_prefix(self) -> list[str]:
        """Prepended to a command to run it inside the namespace (``ip netns exec`` execs it,
        so the pid, and with it the parent-death signal, is kept)."""
        return ["ip", "netns", "exec", self.namespace]


def tbf_args(bandwidth_bps: float) -> list[str]:
    """``tbf`` parameters: rate in bit/s, bucket depth and queue size in bytes."""
    rate_bytes = bandwidth_bps / 8
    burst = max(TBF_MIN_BURST_BYTES, int(rate_bytes * TBF_BURST_S))
    limit = max(TBF_MIN_QUEUE_BYTES, int(rate_bytes * TBF_QUEUE_S))
    return ["tbf", "rate", f"{int(bandwidth_bps)}bit", "burst", str(burst), "limit", str(limit)]


def _usec(seconds: float) -> str:
    return f"{round(seconds * 1e6)}us"


def netem_args(shape: LinkShape) -> list[str]:
    """``netem`` parameters: delay uniform in ``[latency, latency + jitter]`` (netem draws
    ``delay ± jitter`` uniformly), loss per packet in percent."""
    args = ["netem", "limit", str(NETEM_LIMIT_PACKETS), "delay", _usec(shape.latency_s + shape.jitter_s / 2)]
    if shape.jitter_s:
        args.append(_usec(shape.jitter_s / 2))
    if shape.loss:
        args += ["loss", f"{shape.loss * 100:.6g}%"]
    return args


def shape_commands(dev: str, shape: LinkShape, *, namespace: str | None, netem: bool) -> list[list[str]]:
    """Qdiscs on ``dev``'s egress: tbf alone, or netem at the root with tbf as its child."""
    tc = ["tc", *(["-n", namespace] if namespace else []), "qdisc", "add", "dev", dev]
    if not netem:
        return [[*tc, "root", "handle", "1:", *tbf_args(shape.bandwidth_bps)]]
    return [
        [*tc, "root", "handle", "1:", *netem_args(shape)],
        [*tc, "parent", "1:1", "handle", "10:", *tbf_args(shape.bandwidth_bps)],
    ]


def setup_commands(link: SiteLink, *, netem: bool) -> list[list[str]]:
    """Create the namespace and veth pair, address both ends, bring them up, shape them."""
    ns = link.namespace
    return [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", link.host_if, "type", "veth", "peer", "name", link.site_if, "netns", ns],
        ["ip", "addr", "add", f"{link.host_address}/{LINK_PREFIX_LEN}", "dev", link.host_if],
        ["ip", "-n", ns, "addr", "add", f"{link.site_address}/{LINK_PREFIX_LEN}", "dev", link.site_if],
        ["ip", "link", "set", link.host_if, "up"],
        ["ip", "-n", ns, "link", "set", link.site_if, "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        *shape_commands(link.site_if, link.up, namespace=ns, netem=netem),
        *shape_commands(link.host_if, link.down, namespace=None, netem=netem),
    ]


def teardown_commands(link: SiteLink) -> list[list[str]]:
    """Deleting the namespace deletes the site's end and with it the pair; the explicit link
    delete covers a namespace that was never created or a pair created outside it."""
    return [["ip", "netns", "del", link.namespace], ["ip", "link", "del", link.host_if]]


def free_blocks(
    used: Iterable[ipaddress.IPv4Network], count: int, *, start: int = 0
) -> list[ipaddress.IPv4Network]:
    """``count`` ``/30`` blocks of ``ADDRESS_POOL`` overlapping none of ``used``, searched from
    block ``start`` (the caller's pid spreads concurrent emulators over the pool)."""
    blocks = list(ADDRESS_POOL.subnets(new_prefix=LINK_PREFIX_LEN))
    used = [u for u in used if u.overlaps(ADDRESS_POOL)]
    chosen: list[ipaddress.IPv4Network] = []
    for i in range(len(blocks)):
        block = blocks[(start + i) % len(blocks)]
        if not any(block.overlaps(u) for u in used):
            chosen.append(block)
            if len(chosen) == count:
                return chosen
    raise KernelLinkError(f"only {len(chosen)} free /30 blocks left in {ADDRESS_POOL}; {count} needed")


def plan_links(
    shapes: Sequence[tuple[LinkShape, LinkShape]],
    *,
    pid: int,
    used: Iterable[ipaddress.IPv4Network] = (),
    tokens: Iterable[int] | None = None,
) -> list[SiteLink]:
    """One ``SiteLink`` per (uplink, downlink) shape, with unique names and free addresses."""
    tokens = iter(tokens) if tokens is not None else iter(_next_token, None)
    blocks = free_blocks(used, len(shapes), start=pid * 7)
    links = []
    for (up, down), block in zip(shapes, blocks, strict=True):
        namespace, host_if, site_if = names_for(pid, next(tokens))
        host, site = list(block.hosts())
        links.append(SiteLink(namespace, host_if, site_if, str(host), str(site), up, down))
    return links


def relay_shape(site_shape: LinkShape, mode: ShapingMode) -> LinkShape:
    """What the relay still shapes of a direction when the kernel does part of it."""
    if mode == MODE_RELAY:
        return site_shape
    if mode == MODE_KERNEL_RATE:
        return LinkShape(UNSHAPED_BPS, site_shape.latency_s, site_shape.jitter_s, site_shape.loss)
    return LinkShape(UNSHAPED_BPS)


def relay_send_buffer(down: LinkShape, mode: ShapingMode) -> int | None:
    """Send buffer of the relay's socket towards the site when the kernel shapes the wire after
    it (``LinkRelay(send_buffer=...)``): small, so that the relay's writes, and the downlink
    bursts it measures, follow the shaped wire; but at least the bandwidth-delay product that
    netem's delay puts in flight, so that the buffer does not cap the throughput."""
    if mode == MODE_RELAY:
        return None
    in_flight = down.bandwidth_bps / 8 * (2 * down.latency_s + down.jitter_s) if mode == MODE_KERNEL else 0.0
    return max(RELAY_MIN_SEND_BUFFER_BYTES, int(1.25 * in_flight))


# -- what the machine allows ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KernelSupport:
    """What ``detect_support`` could do on this machine."""

    netns: bool
    """Create a network namespace (root or CAP_SYS_ADMIN + CAP_NET_ADMIN, iproute2 installed)."""
    veth: bool
    """Create a veth pair into it."""
    tbf: bool
    """Attach a tbf qdisc (rate)."""
    netem: bool
    """Attach a netem qdisc (delay, jitter, loss)."""
    detail: str = ""
    """The first failing command and its error, when something is missing."""


@dataclass(frozen=True, slots=True)
class ShapingPlan:
    """How the links of a run are shaped, and why that and not what was asked for."""

    mode: ShapingMode
    description: str
    """One line for the log and ``summary.md``: what shapes what."""
    fallback: str | None = None
    """Set when ``--shaping kernel`` could not be honoured in full: what is missing."""

    @property
    def uses_namespaces(self) -> bool:
        return self.mode != MODE_RELAY


RELAY_DESCRIPTION = "relay (portable): bandwidth, latency, jitter and loss in a userspace TCP relay per site"


def choose_shaping(requested: str, support: KernelSupport | None) -> ShapingPlan:
    """The plan for ``--shaping requested`` given what the machine allows."""
    if requested == MODE_RELAY:
        return ShapingPlan(MODE_RELAY, RELAY_DESCRIPTION)
    if requested != MODE_KERNEL:
        raise ValueError(f"unknown shaping {requested!r}; choose one of: {MODE_RELAY}, {MODE_KERNEL}")
    assert support is not None
    if not (support.netns and support.veth and support.tbf):
        missing = (
            "network namespaces" if not support.netns
            else "veth pairs" if not support.veth
            else "the tbf qdisc"
        )
        return ShapingPlan(
            MODE_RELAY,
            RELAY_DESCRIPTION + f" (kernel shaping unavailable: no {missing})",
            fallback=f"--shaping kernel: {missing} not available here ({support.detail}); falling "
            "back to portable relay shaping (bandwidth, latency, jitter and loss in a userspace relay)",
        )
    if not support.netem:
        return ShapingPlan(
            MODE_KERNEL_RATE,
            "kernel-rate: bandwidth by tc tbf on a veth pair per site (network namespaces); "
            "latency, jitter and loss in the userspace relay (this kernel has no netem)",
            fallback=f"--shaping kernel: the netem qdisc is not available here ({support.detail}); "
            "bandwidth is shaped by tc tbf in the kernel, latency, jitter and loss by the relay",
        )
    return ShapingPlan(
        MODE_KERNEL,
        "kernel: bandwidth by tc tbf, latency, jitter and loss by tc netem, on a veth pair per "
        "site (network namespaces); the relay only measures",
    )


PROBE_LABELS = {
    "netns": "ip netns add",
    "veth": "ip link add ... type veth",
    "tbf": "tc qdisc add ... tbf",
    "netem": "tc qdisc add ... netem",
}
"""How a failed probe is named in messages (without the probe's pid-specific names)."""


def detect_support(runner: Runner = run_command) -> KernelSupport:
    """Try, on a throw-away namespace and veth pair, what ``KernelLinks`` will need."""
    for program in ("ip", "tc"):
        if runner is run_command and shutil.which(program) is None:
            detail = f"the '{program}' command (iproute2) is not installed"
            return KernelSupport(False, False, False, False, detail)
    namespace, host_if, site_if = names_for(os.getpid(), _next_token())
    probe_shape = LinkShape(1e6, 0.001)
    steps: list[tuple[str, list[str]]] = [
        ("netns", ["ip", "netns", "add", namespace]),
        ("veth", ["ip", "link", "add", host_if, "type", "veth", "peer", "name", site_if, "netns", namespace]),
        ("tbf", ["tc", "qdisc", "add", "dev", host_if, "root", *tbf_args(1e6)]),
        ("netem", ["tc", "-n", namespace, "qdisc", "add", "dev", site_if, "root", *netem_args(probe_shape)]),
    ]
    found: dict[str, bool] = {}
    tried: set[str] = set()
    detail = ""
    _active.update((namespace, host_if))
    try:
        for what, argv in steps:
            tried.add(what)
            result = runner(argv)
            found[what] = result.returncode == 0
            if not found[what]:
                detail = f"`{PROBE_LABELS[what]}`: {result.stderr or f'status {result.returncode}'}"
                break
    finally:
        # Interrupted (Ctrl-C / SIGTERM) by a command, its outcome is unknown: remove what it may have made.
        if "netns" in tried and found.get("netns", True):
            runner(["ip", "netns", "del", namespace])
        if "veth" in tried and found.get("veth", True):
            runner(["ip", "link", "del", host_if])  # normally gone with the namespace
        _active.difference_update((namespace, host_if))
    return KernelSupport(
        netns=found.get("netns", False),
        veth=found.get("veth", False),
        tbf=found.get("tbf", False),
        netem=found.get("netem", False),
        detail=detail,
    )


# -- running -------------------------------------------------------------------------------------


def _list_names(argv: list[str]) -> list[str]:
    """Names from ``ip netns list`` (first word of a line) or ``ip -o link show``
    (``7: glNNN-1h@if2: <...>``); empty when the command fails."""
    try:
        done = subprocess.run(argv, capture_output=True, timeout=COMMAND_TIMEOUT_S)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    names = []
    for line in done.stdout.decode(errors="replace").splitlines():
        if argv[1] == "netns":
            word = line.split()[0] if line.split() else ""
        else:
            parts = line.split(":", 2)
            word = parts[1].strip().split("@")[0] if len(parts) > 2 else ""
        if word:
            names.append(word)
    return names


def list_namespaces() -> list[str]:
    return _list_names(["ip", "netns", "list"])


def list_links() -> list[str]:
    return _list_names(["ip", "-o", "link", "show"])


def used_networks() -> list[ipaddress.IPv4Network]:
    """Networks of every IPv4 address and route in this namespace (blocks to avoid)."""
    nets: list[ipaddress.IPv4Network] = []
    for argv in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        done = subprocess.run(argv, capture_output=True, timeout=COMMAND_TIMEOUT_S)
        for line in done.stdout.decode(errors="replace").splitlines():
            words = line.split()
            for word in words[:5]:
                try:
                    nets.append(ipaddress.IPv4Network(word, strict=False))
                except ValueError:
                    continue
    return [n for n in nets if n.prefixlen > 0]


def sweep_stale(runner: Runner = run_command) -> list[str]:
    """Remove namespaces and links of emulators that died without cleaning up; returns the names
    that were there and are gone (deleting one end of a veth pair takes the other with it)."""
    own = os.getpid()
    namespaces = stale_names(list_namespaces(), alive=pid_alive, own_pid=own, active=_active)
    for name in namespaces:
        runner(["ip", "netns", "del", name])
    links = stale_names(list_links(), alive=pid_alive, own_pid=own, active=_active)
    for name in links:
        runner(["ip", "link", "del", name])
    remaining = set(list_namespaces()) | set(list_links())
    removed = [name for name in namespaces + links if name not in remaining]
    if removed:
        logger.warning("removed namespaces/links left behind by a killed emulator: %s", ", ".join(removed))
    return removed


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM (main thread only) so that a second Ctrl-C cannot interrupt tear-down
    half way; they are delivered when the block ends."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class KernelLinks:
    """Creates the namespaces and veth pairs of a run and always removes them (``close``)."""

    def __init__(self, links: Sequence[SiteLink], *, netem: bool, runner: Runner = run_command) -> None:
        self.links = list(links)
        self.netem = netem
        self.runner = runner
        self._created: list[SiteLink] = []

    def create(self) -> None:
        """Set up every link; on any failure remove what was made and raise KernelLinkError."""
        try:
            for link in self.links:
                # Registered before the first command: a Ctrl-C half way still removes it.
                self._created.append(link)
                _active.update((link.namespace, link.host_if))
                for argv in setup_commands(link, netem=self.netem):
                    _check(self.runner, argv)
                logger.debug(
                    "link %s: %s <-> %s in %s",
                    link.host_if, link.host_address, link.site_address, link.namespace,
                )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove every namespace and link created so far. Idempotent."""
        with signals_deferred():
            while self._created:
                link = self._created.pop()
                netns_gone = self.runner(teardown_commands(link)[0])
                link_gone = self.runner(teardown_commands(link)[1])
                # The link delete fails once the namespace took the pair with it: expected.
                if netns_gone.returncode != 0 and "No such file" not in netns_gone.stderr:
                    logger.warning("could not remove namespace %s: %s", link.namespace, netns_gone.stderr)
                if link_gone.returncode == 0:
                    logger.debug("removed link %s separately", link.host_if)
                _active.difference_update((link.namespace, link.host_if))
