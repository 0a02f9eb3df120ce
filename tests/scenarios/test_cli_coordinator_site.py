"""``geoloco coordinator`` and ``geoloco site``: help, config errors, flags, plain-text warning,
graceful stop, and how a site resolves what it trains.

Most cases run the CLI entry point in-process (``main([...])``) with
``GEOLOCO_NO_MALLOC_REEXEC=1``, since re-executing would replace the test process; two cases run a
real process (a bad config, and a coordinator stopped by SIGTERM) to check exit status, stderr and
stdout as a user sees them. Training runs of real processes are in
tests/integration/test_processes.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from geoloco.algorithms.params import ParamLayout
from geoloco.coordinator.config import COORDINATOR_RUN, CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site
from geoloco.scenarios.cli import build_parser, main
from geoloco.scenarios.coordinator_cmd import EXAMPLE_CONFIG, STOP_GRACE_S, load_config
from geoloco.scenarios.site_cmd import SiteCommandError, _option, build_agent_config, resolve_plan
from geoloco.scenarios.workloads import WorkloadSpec, build_workload

CLI = [sys.executable, "-m", "geoloco.scenarios.cli"]
PROCESS_TIMEOUT_S = 120.0
"""Generous: a fresh process imports torch (seconds on a loaded machine); only a hang gets near it."""

MLP_CONFIG = """
total_rounds = 3
min_sites = 2
insecure = false

[workload]
name = "mlp"
hidden_dim = 16

[algorithm]
inner_steps = 5
uplink_codec = "int8"

[inner_optimizer]
lr = 0.01
"""


@pytest.fixture(autouse=True)
def _no_reexec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEOLOCO_NO_MALLOC_REEXEC", "1")


def _coordinator_args(config: Path, **kwargs: object) -> argparse.Namespace:
    base: dict[str, object] = {
        "config": config, "host": None, "port": None, "certs": None, "cert_name": None,
        "insecure": False, "metrics": None, "checkpoint_dir": None,
    }
    return argparse.Namespace(**{**base, **kwargs})


def test_help_of_both_commands_documents_the_contract(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["coordinator", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for expected in (
        "--config FILE", "--port", "--certs DIR", "--insecure", "--metrics", "--checkpoint-dir",
        "GLIBC_TUNABLES", f"running calls get {STOP_GRACE_S:g} s", "listening on HOST:PORT",
        "resumes from checkpoint_dir", str(EXAMPLE_CONFIG),
    ):
        assert expected in text, expected
    with pytest.raises(SystemExit) as exit_info:
        main(["site", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for expected in (
        "--coordinator HOST:PORT", "--name", "--certs DIR", "--insecure", "--workload-option KEY=VALUE",
        "--seed", "--site-index", "--num-sites", "--device {auto,cpu,cuda}", "--bf16", "--max-rounds",
        "torchrun", "GLIBC_TUNABLES",
    ):
        assert expected in text, expected


def test_shipped_example_config_is_valid_and_every_key_is_commented() -> None:
    config, workload = load_config(_coordinator_args(EXAMPLE_CONFIG))
    assert workload.name == "gpt" and workload.options["size"] == "small"
    assert config.workload == {"name": "gpt", **workload.options}
    assert config.min_sites == 3 and config.allowed_sites == ["0", "1", "2"]
    assert config.algorithm.uplink_codec == "int8" and config.inner_optimizer.lr == 3e-3
    lines = EXAMPLE_CONFIG.read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped and not stripped.startswith(("#", "[")):
            # A key sits right under its comment, or under a sibling key sharing that comment.
            above = lines[i - 1].strip()
            assert above.startswith("#") or "=" in above, f"line {i + 1} has no comment: {line}"
    # Every key appears, set or (optional ones) commented out as `# key = value`: the top-level
    # fields, and under [run] the run's fields by their [run] names (`rounds`, not `total_rounds`).
    shown = {m[1] for line in lines if (m := re.match(r"^#? ?([a-z_]+) = ", line))}
    fields = {f.name for f in dataclasses.fields(CoordinatorConfig)}
    top_level = (fields - set(COORDINATOR_RUN.fields.values()) | set(COORDINATOR_RUN.fields)) - {
        "algorithm", "outer_optimizer", "inner_optimizer", "workload", "http", "adaptive_deadline",
        "privacy", "admission", "update_guard", "relays",
    }
    assert "total_rounds" not in shown and "[run]" in lines
    assert top_level <= shown, f"keys missing from the example: {top_level - shown}"
    tables = {m[1] for line in lines if (m := re.match(r"^\[([a-z_.]+)\]$", line))}
    assert {"admission", "update_guard", "run", "run.adaptive_deadline", "http"} <= tables
    # Optional tables are shown commented out.
    assert {"# [privacy]", "# [relays]"} <= {line.strip() for line in lines}


def test_flags_override_the_file(tmp_path: Path) -> None:
    config = tmp_path / "coordinator.toml"
    config.write_text(MLP_CONFIG.replace("insecure = false", 'certs_dir = "somewhere"'))
    resolved, _ = load_config(
        _coordinator_args(
            config, host="0.0.0.0", port=4321, metrics=tmp_path / "m.jsonl",
            checkpoint_dir=tmp_path / "ck", certs=tmp_path / "certs",
        )
    )
    assert (resolved.host, resolved.port) == ("0.0.0.0", 4321)
    assert resolved.metrics_path == str(tmp_path / "m.jsonl")
    assert resolved.checkpoint_dir == str(tmp_path / "ck")
    assert resolved.certs_dir == str(tmp_path / "certs") and not resolved.insecure
    insecure, _ = load_config(_coordinator_args(config, insecure=True))
    assert insecure.insecure and insecure.certs_dir is None


@pytest.mark.parametrize(
    ("replace", "flags", "key", "allowed"),
    [
        (("inner_steps = 5", "inner_stepz = 5"), [], "algorithm.inner_stepz", "allowed keys: "),
        (("min_sites = 2", "min_sitez = 2"), [], "min_sitez", "allowed keys: "),
        (("min_sites = 2", "min_sites = 0"), [], "min_sites", "must be >= 1"),
        (("min_sites = 2", 'min_sites = "two"'), [], "min_sites", "expected an integer"),
        (('uplink_codec = "int8"', 'uplink_codec = "int9"'), [], "algorithm.uplink_codec", "int8"),
        (('name = "mlp"', 'name = "resnet"'), [], "workload.name", "allowed values: gpt, mlp"),
        (("hidden_dim = 16", "hidden_dims = 16"), [], "workload.hidden_dims", "allowed options"),
        (("hidden_dim = 16", 'hidden_dim = "16"'), [], "workload.hidden_dim", "must be int"),
        (("insecure = false", "insecure = true"), [], "insecure", "add --insecure"),
        (("insecure = false", "insecure = false"), [], "certs_dir", "insecure = true"),
        (("insecure = false", 'port = 70000\ninsecure = true'), ["--insecure"], "port", "0..65535"),
        (("[algorithm]", "[algorithm"), [], "", "not valid TOML"),
    ],
)
def test_bad_config_exits_2_naming_file_key_and_what_is_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replace: tuple[str, str], flags: list[str],
    key: str, allowed: str,
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(MLP_CONFIG.replace(*replace))
    assert main(["coordinator", "--config", str(config), *flags]) == 2
    err = capsys.readouterr().err
    assert f"{config}: {key}" in err and allowed in err, err


def test_missing_config_file_and_conflicting_flags_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.toml"
    assert main(["coordinator", "--config", str(missing)]) == 2
    assert f"{missing}: file not found" in capsys.readouterr().err
    config = tmp_path / "c.toml"
    config.write_text(MLP_CONFIG)
    assert main(["coordinator", "--config", str(config), "--insecure", "--certs", str(tmp_path)]) == 2
    assert "--insecure: cannot be combined with --certs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["coordinator", "--config", str(config), "--port", "-1"])
    assert exit_info.value.code == 2
    assert "must be an integer in 0..65535" in capsys.readouterr().err


def test_missing_tls_files_exit_2_saying_how_to_make_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(MLP_CONFIG)
    empty = tmp_path / "empty"
    empty.mkdir()
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert main(["coordinator", "--config", str(config), "--certs", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "certs_dir" in err and "geoloco certs init" in err
    # The command installed its SIGTERM/SIGINT handlers only while it ran.
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers


def test_bad_config_in_a_real_process_exits_2_without_traceback(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(MLP_CONFIG.replace("inner_steps = 5", "inner_steps = 0"))
    proc = subprocess.run(
        [*CLI, "coordinator", "--config", str(config)],
        capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S, check=False,
        env={k: v for k, v in os.environ.items() if k != "GEOLOCO_NO_MALLOC_REEXEC"},
    )
    assert proc.returncode == 2
    assert f"{config}: algorithm.inner_steps: must be >= 1" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


LONG_ROUND_CONFIG = """
total_rounds = 2
min_sites = 1
insecure = true

[workload]
name = "mlp"

[algorithm]
inner_steps = 1000000
"""
"""One round is a million inner steps (minutes): a site stopped promptly was interrupted mid-round."""


def _read_until(proc: subprocess.Popen[str], marker: str) -> list[str]:
    """stdout lines up to the first containing ``marker`` (blocking reads; EOF if it dies)."""
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if marker in line:
            return lines
    raise AssertionError(f"process ended before printing {marker!r}: {lines}")


def _popen(args: list[str], stderr_path: Path) -> subprocess.Popen[str]:
    with stderr_path.open("w") as stderr:
        return subprocess.Popen(
            [*CLI, *args], stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
            text=True, start_new_session=True,
        )


def test_sigterm_stops_a_training_site_and_the_insecure_coordinator_gracefully(
    tmp_path: Path,
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(LONG_ROUND_CONFIG)
    coordinator = _popen(
        ["coordinator", "--config", str(config), "--insecure", "--port", "0", "--http-port", "0"], tmp_path / "c.log"
    )
    site: subprocess.Popen[str] | None = None
    try:
        lines = _read_until(coordinator, "listening on")
        assert lines[0] == "geoloco-coordinator starting at round 0 (new run)"
        assert lines[-1].startswith("geoloco-coordinator listening on 127.0.0.1:"), lines
        port = int(lines[-1].rsplit(":", 1)[1])
        site = _popen(
            ["site", "--coordinator", f"127.0.0.1:{port}", "--name", "0", "--insecure", "--device", "cpu"],
            tmp_path / "s.log",
        )
        _read_until(site, "geoloco-site 0 round 0 training")  # drawing its first batch
        site.send_signal(signal.SIGTERM)
        site_rest, _ = site.communicate(timeout=60)
        assert site.returncode == 0
        assert site_rest.strip().startswith(
            "geoloco-site 0 stopped (SIGTERM): final_round=0 rounds_trained=0"
        )
        coordinator.send_signal(signal.SIGTERM)
        rest, _ = coordinator.communicate(timeout=STOP_GRACE_S + 60)
    finally:
        for proc in (site, coordinator):
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait()
    assert coordinator.returncode == 0
    assert rest.strip().startswith("geoloco-coordinator stopped (SIGTERM): round=0 digest=")
    log = (tmp_path / "c.log").read_text()
    assert "WARNING: --insecure: plain-text gRPC without authentication" in log
    assert "site 0 left (stopped)" in log
    assert "SIGTERM received: stopping (grace 5 s)" in log and "Traceback" not in log
    site_log = (tmp_path / "s.log").read_text()
    assert "WARNING: --insecure" in site_log and "Traceback" not in site_log


# ---------------------------------------------------------------------------------------------
# geoloco site


def _site_args(**kwargs: object) -> argparse.Namespace:
    base: dict[str, object] = {
        "name": "0", "workload": None, "workload_option": [], "seed": None, "site_index": None,
        "num_sites": None, "inner_lr": None,
    }
    return argparse.Namespace(**{**base, **kwargs})


ADVERTISED = {
    "workload": {"name": "mlp", "hidden_dim": 16},
    "seed": 7,
    "min_sites": 3,
    "allowed_sites": None,
    "inner_optimizer": {"name": "adamw", "lr": 0.01},
}


def test_site_takes_workload_seed_shard_and_optimizer_from_the_coordinator() -> None:
    plan = resolve_plan(_site_args(name="2"), ADVERTISED)
    assert (plan.workload, plan.seed) == (WorkloadSpec(name="mlp", options={"hidden_dim": 16}), 7)
    assert (plan.site_index, plan.num_sites) == (2, 3)
    assert plan.inner_optimizer == {"name": "adamw", "lr": 0.01}
    listed = resolve_plan(_site_args(name="paris"), {**ADVERTISED, "allowed_sites": ["tokyo", "paris"]})
    assert (listed.site_index, listed.num_sites) == (1, 2)


def test_site_flags_override_what_the_coordinator_advertises() -> None:
    plan = resolve_plan(
        _site_args(
            name="x", seed=1, site_index=4, num_sites=5, inner_lr=0.5,
            workload_option=[("batch_size", 8)],
        ),
        ADVERTISED,
    )
    assert plan.workload.options == {"hidden_dim": 16, "batch_size": 8} and plan.seed == 1
    assert (plan.site_index, plan.num_sites) == (4, 5) and plan.inner_optimizer["lr"] == 0.5
    other = resolve_plan(_site_args(workload="gpt", workload_option=[("size", "tiny")]), ADVERTISED)
    assert other.workload == WorkloadSpec(name="gpt", options={"size": "tiny"})


@pytest.mark.parametrize(
    ("args", "advertised", "message"),
    [
        ({"name": "alpha"}, ADVERTISED, "pass --site-index I"),
        ({"name": "3"}, ADVERTISED, "site index 3 is outside the 3 data shards"),
        ({"name": "0"}, {**ADVERTISED, "workload": {}}, "names no workload"),
        ({"workload_option": [("hidden_dim", "x")]}, ADVERTISED, "command line: workload.hidden_dim: "),
        (
            {},
            {**ADVERTISED, "workload": {"name": "mlp", "hidden_dims": 3}},
            "the coordinator's config: workload.hidden_dims",
        ),
        ({"workload": "resnet"}, ADVERTISED, "command line: workload.name: got 'resnet'"),
    ],
)
def test_site_plan_errors_say_what_to_pass(args: dict[str, object], advertised: dict, message: str) -> None:
    with pytest.raises(SiteCommandError, match=message.replace("[", r"\[")):
        resolve_plan(_site_args(**args), advertised)


def test_workload_option_values_are_toml_or_bare_strings() -> None:
    assert _option("seq_len=64") == ("seq_len", 64)
    assert _option("site_shift=0.5") == ("site_shift", 0.5)
    assert _option("size=small") == ("size", "small")
    assert _option("bias=false") == ("bias", False)
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        _option("size")


def test_site_threshold_flags_set_the_agents_own_secure_aggregation_bound() -> None:
    """The least threshold a site accepts comes from its own flags, never from the coordinator."""
    from geoloco.algorithms.privacy.secagg_crypto import ThresholdPolicy

    base = ["site", "--coordinator", "h:1", "--name", "0", "--insecure"]
    default = build_agent_config(build_parser().parse_args(base))
    assert default.threshold_policy() == ThresholdPolicy(colluding_sites=1, min_threshold=None)
    own = build_agent_config(build_parser().parse_args([*base, "--colluding-sites", "2", "--min-threshold", "4"]))
    assert own.threshold_policy() == ThresholdPolicy(colluding_sites=2, min_threshold=4)


def test_site_needs_certs_or_insecure(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["site", "--coordinator", "localhost:1", "--name", "0"])
    assert exit_info.value.code == 2
    assert "one of the arguments --certs --insecure is required" in capsys.readouterr().err


def test_site_without_a_certificate_for_its_name_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A site presents the certificate of the name it claims; with only site A's certificate it
    cannot even try to be site B (the coordinator's refusal of a mismatched identity is tested
    over raw gRPC in tests/coordinator/test_bad_input_grpc.py)."""
    certs = tmp_path / "certs"
    init_ca(certs)
    issue_coordinator(certs)
    issue_site(certs, "a")
    assert main(["site", "--coordinator", "localhost:1", "--name", "b", "--certs", str(certs)]) == 2
    err = capsys.readouterr().err
    assert "b.crt not found" in err and "geoloco certs issue" in err


@contextlib.contextmanager
def _insecure_coordinator(allowed_sites: list[str] | None) -> Iterator[CoordinatorServer]:
    workload = build_workload("mlp", hidden_dim=16)
    model = workload.build_model(0)
    layout = ParamLayout.from_model(model)
    server = CoordinatorServer(
        CoordinatorConfig(
            insecure=True, allowed_sites=allowed_sites, min_sites=2, total_rounds=2,
            workload={"name": "mlp", "hidden_dim": 16},
        ),
        layout.flatten(model),
        layout,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=0)


def test_site_refused_by_the_coordinator_exits_1_with_its_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with _insecure_coordinator(["a", "b"]) as server:
        assert main(["site", "--coordinator", server.address, "--name", "mallory", "--insecure"]) == 1
        assert server.rounds.members == []
    err = capsys.readouterr().err
    assert "WARNING: --insecure" in err
    assert "PERMISSION_DENIED" in err and "not in this run's allowed_sites (a, b)" in err


def test_site_without_a_data_shard_leaves_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """The probe Join made it a member; it leaves at once instead of holding up the round until
    its heartbeat times out."""
    with _insecure_coordinator(None) as server:
        assert main(["site", "--coordinator", server.address, "--name", "alpha", "--insecure"]) == 2
        assert server.rounds.members == []
    err = capsys.readouterr().err
    assert "cannot tell which data shard site 'alpha' trains on" in err and "--site-index" in err
