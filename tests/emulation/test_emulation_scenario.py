"""Scenario files: the shipped ones load; every error names the file, the key and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from geoloco.scenarios.cli import main
from geoloco.scenarios.scenario import ScenarioError, load_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"
SHIPPED = ["quickstart", "transatlantic", "heterogeneous", "flaky", "compare_ddp", "compare_diloco"]

BASE = """
[workload]
name = "mlp"
[algorithm]
inner_steps = 5
[run]
rounds = 3
[[sites]]
name = "a"
[[sites]]
name = "b"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scenario.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_scenarios_load_and_say_what_they_show(name: str) -> None:
    path = SCENARIOS / f"{name}.toml"
    scenario = load_scenario(path)
    assert scenario.sites
    first_comment = path.read_text().splitlines()[0]
    assert first_comment.startswith("# "), "each shipped scenario opens with a comment block"
    assert "What it shows" in path.read_text()


def test_quickstart_has_four_sites_with_tls_links() -> None:
    scenario = load_scenario(SCENARIOS / "quickstart.toml")
    assert len(scenario.sites) == 4
    assert len({s.latency_s for s in scenario.sites}) == 4


def test_defaults_and_derived_values(tmp_path: Path) -> None:
    scenario = load_scenario(write(tmp_path, BASE))
    assert scenario.quorum == 2
    assert [scenario.shard_of(i) for i in range(2)] == [0, 1]
    clock = scenario.sites[0].clock_site()
    assert clock.speed_factor == 1.0 and clock.name == "a"


@pytest.mark.parametrize(
    ("text", "key", "allowed"),
    [
        (BASE + "[extra]\nx = 1\n", "extra", "allowed: workload, algorithm"),
        (BASE.replace('name = "a"', 'name = "a"\nbandwidth = 5'), "sites[0].bandwidth", "allowed keys:"),
        (BASE.replace('name = "a"', 'name = "a"\nlatency_s = "fast"'), "sites[0].latency_s", "expected a number"),
        (BASE.replace('name = "a"', 'name = "a"\nlatency_s = -0.1'), "sites[0].latency_s", "0..10 seconds"),
        (BASE.replace('name = "a"', 'name = "a"\nspeed_factor = 2.0'), "sites[0].speed_factor", "(0, 1]"),
        (BASE.replace('name = "a"', 'name = "a"\nloss = 0.7'), "sites[0].loss", "[0, 0.5)"),
        (BASE.replace('name = "a"', 'name = "a"\nuplink_bps = 10'), "sites[0].uplink_bps", ">= 1000"),
        (BASE.replace('name = "a"', 'name = "a"\ndata_shard = 5'), "sites[0].data_shard", "0..1"),
        (BASE.replace('name = "b"', 'name = "a"'), "sites[1].name", "used twice"),
        (BASE.replace('name = "b"', 'name = "b/c"'), "sites[1].name", "letters, digits"),
        (BASE.replace('name = "b"', 'name = "coordinator"'), "sites[1].name", "pick another"),
        (BASE.replace("rounds = 3", "rounds = 0"), "run.rounds", "time_budget_s"),
        (BASE.replace("rounds = 3", "rounds = 3\nmin_sites = 3"), "run.min_sites", "<= the number of sites (2)"),
        (BASE.replace("rounds = 3", "rounds = 3\nheartbeat_timeout_s = 1.0"), "run.heartbeat_timeout_s", "twice"),
        (BASE.replace("inner_steps = 5", 'inner_steps = 5\nname = "ddp"'), "algorithm.name", "fedavg"),
        (BASE.replace("inner_steps = 5", "inner_steps = 0"), "algorithm.inner_steps", ">= 1"),
        (BASE.replace('name = "mlp"', 'name = "resnet"'), "workload.name", "gpt, mlp"),
        (BASE.replace('name = "mlp"', 'name = "mlp"\nwidth = 3'), "workload.width", "allowed options"),
        (BASE + '[[faults]]\nkind = "explode"\nat_round = 1\nsite = "a"\n', "faults[0].kind", "kill_site"),
        (BASE + '[[faults]]\nkind = "kill_site"\nat_round = 1\nsite = "zz"\n', "faults[0].site", "sites: a, b"),
        (BASE + '[[faults]]\nkind = "kill_site"\nat_round = 1\n', "faults[0].site", "needs the name"),
        (BASE + '[[faults]]\nkind = "cut_link"\nat_round = 3\nsite = "a"\n', "faults[0].at_round", "< run.rounds (3)"),
        (BASE + '[[faults]]\nkind = "kill_coordinator"\nat_round = 1\nsite = "a"\n', "faults[0].site", "takes no site"),
        (BASE + '[[faults]]\nkind = "cut_link"\nat_round = 1\nsite = "a"\ndown_s = -1\n', "faults[0].down_s", "0..600"),
        (BASE + '[faults]\nkind = "cut_link"\n', "faults", "double brackets"),
        (BASE.replace("[[sites]]\nname = \"a\"\n[[sites]]\nname = \"b\"\n", ""), "sites", "at least one"),
    ],
)
def test_errors_name_file_key_and_what_is_allowed(tmp_path: Path, text: str, key: str, allowed: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    err = info.value
    assert err.source == str(path)
    assert err.key == key, str(err)
    assert allowed in err.message, str(err)
    assert str(err).startswith(f"{path}: {key}: ")


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="file not found"):
        load_scenario(tmp_path / "missing.toml")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(write(tmp_path, "[run\nrounds = 1"))


def test_cli_rejects_a_bad_scenario_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, BASE.replace('name = "a"', 'name = "a"\nspeed_factor = 0'))
    out = tmp_path / "run"
    assert main(["emulate", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: sites[0].speed_factor: must be in (0, 1]" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_cli_kernel_shaping_says_what_it_falls_back_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from geoloco.scenarios import netns

    denied = netns.KernelSupport(False, False, False, False, "`ip netns add`: Operation not permitted")
    monkeypatch.setattr(netns, "detect_support", lambda: denied)
    out = tmp_path / "run"
    args = ["emulate", str(write(tmp_path, BASE)), "--shaping", "kernel", "--check", "--out", str(out)]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert (
        "--shaping kernel: network namespaces not available here (`ip netns add`: Operation not "
        "permitted); falling back to portable relay shaping" in captured.err
    )
    assert "link shaping: relay (portable)" in captured.out
    assert not out.exists()


def test_cli_check_validates_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["emulate", str(write(tmp_path, BASE)), "--check", "--out", str(out)]) == 0
    assert "scenario is valid" in capsys.readouterr().out
    assert not out.exists()
