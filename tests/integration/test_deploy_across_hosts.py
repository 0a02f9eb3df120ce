"""The deployment guide (docs/how-to/deploy-across-hosts.md) followed across three "hosts".

Three network namespaces stand in for a coordinator host and two data centers, each joined to
the coordinator's by its own veth pair; each has its own hosts file (``ip netns exec`` mounts
``/etc/netns/NAME/hosts`` over ``/etc/hosts``), in which ``coord.example.org`` is the
coordinator's address on that link, so the sites dial a name that is not ``localhost`` and that
only the coordinator's certificate names. The commands are the guide's: the certificates, a
coordinator listening on every interface on port 7000, and ``geoloco site --coordinator
coord.example.org:7000 --name N --certs certs --state-dir ... --save-final ...``; only the run
is made tiny (a few rounds of the MLP workload). Needs root and iproute2; skips, saying why,
without them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from _processes import CLI, COORDINATOR_END, LISTENING, SITE_END, Processes

from geoloco.scenarios.netns import detect_support, free_blocks, run_command, used_networks

COORDINATOR_NAME = "coord.example.org"
PORT = 7000
ROUNDS = 3
CONFIG = f"""
min_sites = 2
total_rounds = {ROUNDS}
heartbeat_interval_s = 1.0

[algorithm]
inner_steps = 2

[workload]
name = "mlp"
"""


def _run(*argv: str) -> None:
    result = run_command(list(argv))
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


@pytest.fixture
def hosts() -> Iterator[dict[str, tuple[str, str]]]:
    """host -> (network namespace, the coordinator's address as that host sees it); the
    coordinator's host maps to its own namespace and an empty address."""
    support = detect_support()
    missing = [need for need in ("netns", "veth") if not getattr(support, need)]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)} (root, iproute2): {support.detail}")
    tag = f"{os.getpid() % 100000}"
    coordinator_ns = f"glc-coord-{tag}"
    sites = {"0": f"glc-dc0-{tag}", "1": f"glc-dc1-{tag}"}
    blocks = free_blocks(used_networks(), len(sites), start=os.getpid())
    created: list[str] = []
    try:
        for namespace in (coordinator_ns, *sites.values()):
            _run("ip", "netns", "add", namespace)
            created.append(namespace)
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
        addresses: dict[str, tuple[str, str]] = {"coordinator": (coordinator_ns, "")}
        for (name, namespace), block in zip(sites.items(), blocks, strict=True):
            near, far = (str(a) for a in list(block.hosts())[:2])
            inside, outside = f"gc{name}{tag}", f"gs{name}{tag}"
            _run("ip", "link", "add", inside, "type", "veth", "peer", "name", outside)
            _run("ip", "link", "set", inside, "netns", coordinator_ns)
            _run("ip", "link", "set", outside, "netns", namespace)
            _run("ip", "-n", coordinator_ns, "addr", "add", f"{near}/{block.prefixlen}", "dev", inside)
            _run("ip", "-n", namespace, "addr", "add", f"{far}/{block.prefixlen}", "dev", outside)
            _run("ip", "-n", coordinator_ns, "link", "set", inside, "up")
            _run("ip", "-n", namespace, "link", "set", outside, "up")
            etc = Path("/etc/netns") / namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{near} {COORDINATOR_NAME}\n")
            addresses[name] = (namespace, near)
        yield addresses
    finally:
        for namespace in created:
            run_command(["ip", "netns", "delete", namespace])  # its veth ends go with it
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)


def _in(namespace: str) -> list[str]:
    """The CLI, run in ``namespace`` (with its hosts file)."""
    return ["ip", "netns", "exec", namespace, *CLI]


def test_a_run_across_three_hosts_follows_the_deployment_guide(
    hosts: dict[str, tuple[str, str]], tmp_path: Path
) -> None:
    # Certificates, as the guide writes them (on any machine; then copied to each host).
    certs = tmp_path / "certs"
    for argv in (
        ["certs", "init", str(certs)],
        ["certs", "issue", str(certs), "coordinator", "--coordinator", "--host", COORDINATOR_NAME],
        ["certs", "issue", str(certs), "0"],
        ["certs", "issue", str(certs), "1"],
    ):
        subprocess.run([*CLI, *argv], check=True, capture_output=True, timeout=120)
    config = tmp_path / "coordinator.toml"
    config.write_text(CONFIG)
    with Processes(tmp_path) as processes:
        coordinator_ns, _ = hosts["coordinator"]
        coordinator = processes.start(
            "coordinator", "coordinator", "--config", str(config), "--certs", str(certs),
            "--host", "0.0.0.0", "--port", str(PORT), command=_in(coordinator_ns),
        )
        coordinator.wait_line(LISTENING, what="listening")
        sites = {}
        for name in ("0", "1"):
            namespace, _ = hosts[name]
            sites[name] = processes.start(
                f"site-{name}", "site", "--coordinator", f"{COORDINATOR_NAME}:{PORT}", "--name", name,
                "--certs", str(certs), "--state-dir", str(tmp_path / f"state-{name}"),
                "--save-final", str(tmp_path / f"final-{name}.safetensors"), "--device", "cpu",
                command=_in(namespace),
            )
        end = coordinator.wait_line(COORDINATOR_END, what="the run's end", timeout_s=240)[1]
        assert end["how"] == "finished" and int(end["round"]) == ROUNDS
        for name, site in sites.items():
            done = site.wait_line(SITE_END, what=f"site {name}'s end", timeout_s=120)[1]
            assert done["how"] == "finished" and done["run_finished"] == "yes", site.describe()
            assert int(done["rounds_included"]) >= 1
            assert done["digest"] == end["digest"]  # every host ends on the coordinator's weights
            assert (tmp_path / f"final-{name}.safetensors").stat().st_size > 0
