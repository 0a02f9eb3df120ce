"""``geoloco plan``: flags and scenario files in, tables or JSON out, clear errors on bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.simulation.planner import plan
from geoloco.scenarios.cli import main
from geoloco.scenarios.plan_cmd import parse_link
from geoloco.scenarios.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_compare_prints_one_line_per_algorithm(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--params", "1e6", "--sites", "3", "--link", "100mbit,20ms", "--step-time", "0.1",
            "--inner-steps", "20", "--codec", "int8", "--total-steps", "200", "--compare", "diloco,streaming,ddp"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "1,000,000 parameters, 3 sites" in out
    rows = [line.split() for line in out.splitlines()]
    lines = {row[0]: row for row in rows if row[:1] in (["diloco"], ["streaming"], ["ddp"])}
    assert lines["diloco"][1] == "10" and lines["streaming"][1] == "40" and lines["ddp"][1] == "200"
    assert all(lines[a][2] == "200" for a in lines)  # the same inner steps per site
    assert "peak memory at coordinator" in out


def test_flags_json_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "--params", "1M", "--sites", "2", "--link", "8mbit,0ms", "--step-time", "1",
                 "--inner-steps", "10", "--rounds", "3")
    (p,) = data["plans"]
    # 1e6 fp32 elements uncompressed = 4e6 bytes (+ header) at 8 Mbit/s: 4 s each way, 10 s compute.
    assert p["algorithm"] == "diloco" and p["rounds"] == 3
    assert p["mean_round_s"] == pytest.approx(18.0, rel=1e-4)
    assert p["utilization"]["site-0"] == pytest.approx(10 / 18, rel=1e-4)
    # Encoded.nbytes of "none": 21 + len("none") + 8 header bytes + 4 per element, three rounds.
    assert p["bytes"]["site-1"] == {"up": 3 * 4_000_033, "down": 3 * 4_000_033}


def test_scenario_file_matches_the_planner_on_its_sites(capsys: pytest.CaptureFixture[str]) -> None:
    path = SCENARIOS / "quickstart.toml"
    data = _json(capsys, str(path), "--params", "20000", "--step-time", "0.2")
    scenario = load_scenario(path)
    expected = plan(scenario.training, numel=20000, sites=[s.clock_site() for s in scenario.sites], step_time_s=0.2)
    (p,) = data["plans"]
    assert p["rounds"] == scenario.run.rounds
    assert p["total_s"] == pytest.approx(expected.total_s)
    assert list(p["utilization"]) == [s.name for s in scenario.sites]


def test_streaming_scenario_uses_its_fragments(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, str(SCENARIOS / "streaming.toml"), "--params", "40000", "--step-time", "0.1")
    (p,) = data["plans"]
    assert p["algorithm"] == "streaming"
    assert p["rounds"] == load_scenario(SCENARIOS / "streaming.toml").run.rounds


def test_a_secure_scenario_is_planned_stage_by_stage(capsys: pytest.CaptureFixture[str]) -> None:
    """Its uploads are the masked vector (4 bytes a parameter at 32-bit modulus) and the
    protocol's messages; its rounds are longer than the same sites' plain rounds by at least
    four one-way latencies of the slowest site (the survivor list, the signature, the unmask
    request and its answer come after the uploads close)."""
    path = SCENARIOS / "secure.toml"
    (p,) = _json(capsys, str(path), "--params", "40000", "--step-time", "0.05")["plans"]
    scenario = load_scenario(path)
    up = p["bytes"]["boston"]["up"]
    assert 4 * 40000 * scenario.run.rounds < up < (4 * 40000 + 8000) * scenario.run.rounds
    plain = plan(
        dataclasses.replace(scenario.training, privacy=PrivacyConfig()), numel=40000,
        sites=[s.clock_site() for s in scenario.sites], step_time_s=0.05,
    )
    slowest = max(s.latency_s for s in scenario.sites)
    assert p["mean_round_s"] > plain.mean_round_s + 4 * slowest
    compared = _json(capsys, str(path), "--params", "40000", "--step-time", "0.05", "--compare", "diloco,streaming")
    assert [q["algorithm"] for q in compared["plans"]] == ["diloco", "streaming"]


def test_parse_link_units() -> None:
    assert parse_link("1gbit,50ms") == (1e9, pytest.approx(0.05))
    assert parse_link("1e8,0.03") == (1e8, 0.03)
    assert parse_link("100Mbit/s, 2s") == (1e8, 2.0)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--step-time", "0.1"], "--params"),
        (["--params", "1e6", "--step-time", "0.1", "--link", "fast", "--rounds", "1"], "--link"),
        (["--params", "1e6", "--step-time", "0.1", "--link", "1gbit,5parsecs", "--rounds", "1"], "latency units"),
        (["--params", "1e6", "--step-time", "0.1", "--sites", "3", "--link", "1gbit,1ms", "--link", "1gbit,2ms",
          "--rounds", "1"], "one per site"),
        (["--params", "1e6", "--step-time", "measure", "--rounds", "1"], "measure"),
        (["--params", "1e6", "--step-time", "0.1"], "--total-steps"),
        (["--params", "1e6", "--step-time", "0.1", "--rounds", "1", "--algorithm", "streaming", "--inner-steps", "10",
          "--fragments", "3"], "must divide inner_steps"),
        (["--params", "1e6", "--step-time", "0.1", "--rounds", "1", "--codec", "int9"], "uplink_codec"),
        ([str(SCENARIOS / "quickstart.toml"), "--params", "1e6", "--step-time", "0.1", "--sites", "2"], "[[sites]]"),
        (["missing.toml", "--params", "1e6", "--step-time", "0.1"], "file not found"),
    ],
)
def test_bad_input_exits_2_naming_the_problem(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("geoloco plan: error:") and expected in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["--params", "lots", "--step-time", "1"],
        ["--params", "1e6", "--step-time", "-1"],
        ["--params", "1e6", "--step-time", "1", "--compare", "diloco,allreduce"],
        ["--params", "1e6", "--step-time", "1", "--rounds", "2", "--total-steps", "10"],
    ],
)
def test_bad_flag_values_are_argparse_errors(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", *argv])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Every config file that describes a run: an emulate scenario, a simulate file, a coordinator file


def _simulate_config(path: Path) -> Any:
    from geoloco.scenarios.config_file import read_toml
    from geoloco.scenarios.research import load_run_config, prepare_raw

    return load_run_config(prepare_raw(read_toml(path), [], str(path)), str(path))[1]


def test_a_simulate_file_plans_its_sites_rounds_and_step_time(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --step-time the file's step_time_s, so the plan is `geoloco simulate`'s clock."""
    path = SCENARIOS / "simulate.toml"
    data = _json(capsys, str(path), "--params", "20000")
    config = _simulate_config(path)
    expected = plan(config.training, numel=20000, sites=config.sites, step_time_s=config.simulation.step_time_s)
    (p,) = data["plans"]
    assert data["step_time_s"] == config.simulation.step_time_s
    assert p["rounds"] == config.run_rounds
    assert p["total_s"] == pytest.approx(expected.total_s)
    assert p["bytes"] == expected.to_dict()["bytes"]
    assert list(p["utilization"]) == config.site_names
    # `--config FILE`, as simulate, coordinator and relay spell it, is the same file.
    assert _json(capsys, "--config", str(path), "--params", "20000") == data


def test_a_simulate_file_without_params_plans_its_workloads_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from geoloco.algorithms.params import ParamLayout
    from geoloco.scenarios.workloads import parse_workload

    path = tmp_path / "sim.toml"
    path.write_text(
        '[workload]\nname = "mlp"\n[algorithm]\ninner_steps = 10\n[sites]\ncount = 2\n'
        "[simulation]\nrounds = 3\nstep_time_s = 0.05\n"
    )
    data = _json(capsys, str(path), "--compare", "diloco,ddp")
    config = _simulate_config(path)
    model = parse_workload({"name": "mlp"}).build().build_model(config.simulation.seed)
    numel = ParamLayout.from_model(model).numel
    assert [p["numel"] for p in data["plans"]] == [numel, numel]
    assert [p["algorithm"] for p in data["plans"]] == ["diloco", "ddp"]
    assert data["plans"][0]["rounds"] == 3 and data["step_time_s"] == 0.05


def test_a_coordinator_file_plans_with_the_links_of_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from geoloco.algorithms.simulation.clock import SiteConfig
    from geoloco.scenarios.config_file import read_toml
    from geoloco.scenarios.coordinator_cmd import parse_config

    path = SCENARIOS / "coordinator.toml"
    data = _json(capsys, str(path), "--params", "20000", "--step-time", "0.2", "--link", "100mbit,40ms")
    config, _ = parse_config(read_toml(path), str(path))
    assert config.allowed_sites
    sites = [SiteConfig(name=n, uplink_bps=1e8, downlink_bps=1e8, latency_s=0.04) for n in config.allowed_sites]
    expected = plan(config.training, numel=20000, sites=sites, step_time_s=0.2)
    (p,) = data["plans"]
    assert list(p["utilization"]) == config.allowed_sites  # the sites the file names
    assert p["rounds"] == config.total_rounds
    assert p["total_s"] == pytest.approx(expected.total_s)
    assert _json(capsys, str(path), "--params", "20000", "--step-time", "0.2", "--sites", "5")["plans"][0][
        "sites"
    ] == [f"site-{k}" for k in range(5)]


def test_every_kind_of_run_file_prints_a_plan(capsys: pytest.CaptureFixture[str]) -> None:
    for name, extra in (
        ("quickstart.toml", ["--step-time", "0.1"]),
        ("simulate.toml", []),
        ("coordinator.toml", ["--step-time", "0.1"]),
    ):
        assert main(["plan", str(SCENARIOS / name), "--params", "1e5", *extra]) == 0, name
        out = capsys.readouterr().out
        assert out.startswith("plan: 100,000 parameters"), out
        assert "peak memory at coordinator" in out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([str(SCENARIOS / "simulate.toml"), "--params", "1e6", "--sites", "2"], "a simulate file brings its own sites"),
        ([str(SCENARIOS / "quickstart.toml"), "--params", "1e6"], "--step-time: give the seconds per inner step"),
        ([str(SCENARIOS / "regions.toml"), "--params", "1e6", "--step-time", "0.1", "--compare", "diloco,ddp"],
         "algorithm ddp: with regions or a shaped coordinator link"),
        ([str(SCENARIOS / "uneven_links.toml"), "--params", "1e6", "--step-time", "0.1"], None),
    ],
)
def test_what_a_run_file_cannot_be_planned_with_is_named(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str | None
) -> None:
    code = main(["plan", *argv])
    err = capsys.readouterr().err
    if expected is None:  # a simulate file with [[sites]] plans like a scenario
        assert code == 0, err
        return
    assert code == 2 and err.startswith("geoloco plan: error:") and expected in err, err


def test_a_scenario_with_regions_is_planned_on_both_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    """The relays and the coordinator's shared 2 Mbit/s link are on the plan's clock (the
    simulator's two-tier clock); the same sites flat would be faster."""
    path = SCENARIOS / "regions.toml"
    assert main(["plan", str(path), "--step-time", "0.02"]) == 0
    out = capsys.readouterr().out
    assert "two tiers: sites -> relays eu, us, then the coordinator's link (2 Mbit/s in / 2 Mbit/s out" in out
    tiered = _json(capsys, str(path), "--step-time", "0.02")["plans"][0]
    scenario = load_scenario(path)
    flat = plan(
        scenario.training, numel=tiered["numel"], sites=[s.clock_site() for s in scenario.sites], step_time_s=0.02
    )
    assert tiered["total_s"] > flat.total_s * 1.2


def test_a_scenario_with_faults_says_the_plan_leaves_them_out(capsys: pytest.CaptureFixture[str]) -> None:
    path = SCENARIOS / "flaky.toml"
    faults = len(load_scenario(path).faults)
    assert faults > 0
    assert main(["plan", str(path), "--step-time", "0.01"]) == 0
    assert f"the scenario's {faults} [[faults]] are not on the planner's clock" in capsys.readouterr().out
    assert _json(capsys, str(path), "--step-time", "0.01")["faults_left_out"] == faults
    assert _json(capsys, str(SCENARIOS / "quickstart.toml"), "--step-time", "0.01")["faults_left_out"] == 0
