"""Plug-ins (examples/plugins/signsgd_plugin.py: a sign-SGD outer optimizer, a codec, a workload)
through ``research.run``, ``sweep`` in spawned workers, ``tune`` and the commands; workload
objects with run folders and resume; the torch thread count in ``config.json`` and the folder hash."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.optimizers import OuterOptimizerConfig
from geoloco.compression import codec as codec_module
from geoloco.compression import parse_codec
from geoloco.scenarios.cli import main
from geoloco.scenarios.config_file import ConfigFileError
from geoloco.scenarios.research import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, RunResult, run
from geoloco.scenarios.sweep import sweep

PLUGINS = Path(__file__).resolve().parents[2] / "examples" / "plugins"
PLUGIN = "signsgd_plugin"

BASE: dict[str, Any] = {
    "workload": {"name": "mlp", "batch_size": 8, "hidden_dim": 8, "eval_size": 64},
    "algorithm": {"name": "diloco", "inner_steps": 5},
    "inner_optimizer": {"lr": 0.01},
    "sites": {"count": 2},
    "simulation": {"total_inner_steps": 10, "eval_every_steps": 5, "device": "cpu"},
    "research": {"plugins": [PLUGIN]},
}
NO_WORKLOAD = {k: v for k, v in BASE.items() if k not in ("workload", "research")}


@pytest.fixture(autouse=True)
def _plugin_on_path(example_plugin: Path) -> None:
    """Every test here may import the example plug-in (``example_plugin``)."""


def _plugin() -> ModuleType:
    import signsgd_plugin

    return signsgd_plugin


def test_a_plugin_optimizer_in_spawned_workers_equals_research_run_byte_for_byte(tmp_path: Path) -> None:
    """The sweep's worker processes know the plug-in's name only by importing it themselves; the
    same point then gives the same bytes in a worker as in this process."""
    threads = torch.get_num_threads()
    grid = {"outer_optimizer.name": ["nesterov", "signsgd"]}
    swept = sweep(BASE, grid=grid, seeds=[0], out=tmp_path / "sweep", jobs=2, plots=False)
    assert (swept.ran, swept.failed) == (2, 0)
    assert PLUGIN in sys.modules  # the driver imported it to check every run's config
    for point in swept.points:
        (result,) = point.runs
        assert result.folder is not None
        alone = run(BASE, overrides=[f"{k}={v}" for k, v in point.point] + ["simulation.seed=0"],
                    out=tmp_path / point.label)
        for name in (CONFIG_FILE, METRICS_FILE):
            assert (result.folder / name).read_bytes() == (tmp_path / point.label / name).read_bytes(), name
        assert alone.config["research"] == {"plugins": [PLUGIN], "threads": 1}
        (plugin,) = alone.config["plugins"]
        assert plugin["module"] == PLUGIN and plugin["version"] == "0.1.0" and len(plugin["source_sha256"]) == 64
    sign, nesterov = (p.runs[0].totals["weights_digest"] for p in reversed(swept.points))
    assert sign != nesterov
    assert torch.get_num_threads() == threads, "a run restores the caller's thread count"


def test_unknown_names_list_the_registered_ones_and_a_missing_plugin_says_why(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="valid names: nesterov, sgd, fedadam, fedyogi, adam") as info:
        OuterOptimizerConfig(name="signsgd")
    assert "[research] plugins" in str(info.value)
    _plugin()
    with pytest.raises(ConfigError, match="adam, signsgd"):
        OuterOptimizerConfig(name="signsdg")
    with pytest.raises(ConfigFileError) as missing:
        run(BASE, plugins=["no_such_plugin"])
    assert missing.value.key == "research.plugins" and "PYTHONPATH" in missing.value.message
    with pytest.raises(ConfigFileError) as unknown:
        run(BASE, overrides=["workload.name=sin"])
    assert unknown.value.key == "workload.name" and "sine" in unknown.value.message


def test_a_plugin_codec_composes_with_the_built_in_stages() -> None:
    plugin = _plugin()
    codec = parse_codec("topk:0.5|scaledsign")
    values = torch.tensor([0.5, -2.0, 0.1, -0.05, 3.0, 0.0, -1.0, 0.25])
    encoded = codec.encode(values)
    assert encoded.nbytes == len(encoded.to_bytes())
    decoded = codec.decode(encoded.to_bytes())
    kept = decoded != 0
    assert int(kept.sum()) == 4 and torch.equal(decoded[kept].sign(), values[kept].sign())
    assert "scaledsign" in codec_module.CODEC_NAMES and "scaledsign" in codec_module.codec_names("values")
    from geoloco.compression import register_codec

    register_codec(plugin.ScaledSign)  # the same class again: a module imported twice
    with pytest.raises(ValueError, match="already registered"):
        register_codec(type("ScaledSign", (plugin.ScaledSign,), {"__module__": "elsewhere"}))


def test_a_workload_object_gets_a_run_folder_resumes_and_sweeps(tmp_path: Path) -> None:
    plugin = _plugin()
    workload = plugin.SineWorkload(plugin.SineConfig(hidden_dim=8))
    folder = tmp_path / "run"
    first = run(NO_WORKLOAD, workload=workload, out=folder)
    assert RunResult.load(folder) == first and first.final_eval_loss is not None
    table = first.config["workload"]
    assert table["name"] == "sine" and table["class"] == f"{PLUGIN}.SineWorkload" and table["hidden_dim"] == 8
    assert [p["module"] for p in first.config["plugins"]] == [PLUGIN]  # the workload's module
    stamp = (folder / SUMMARY_FILE).stat().st_mtime_ns
    again = run(NO_WORKLOAD, workload=workload, out=folder, resume=True)
    assert again == first and (folder / SUMMARY_FILE).stat().st_mtime_ns == stamp, "resumed, not run again"
    with pytest.raises(ConfigFileError, match="differs in algorithm") as other:
        run(NO_WORKLOAD, workload=workload, out=folder, resume=True, overrides=["algorithm.inner_steps=2"])
    assert other.value.key == "out"
    with pytest.raises(ConfigFileError, match="drop the table") as both:
        run(BASE, workload=workload)
    assert both.value.key == "workload"
    with pytest.raises(ConfigFileError, match="lacks name, build_model"):
        run(NO_WORKLOAD, workload=object())

    swept = sweep(NO_WORKLOAD, seeds=[0], out=tmp_path / "sweep", workload=workload, plots=False)
    assert (swept.ran, swept.failed) == (1, 0)
    assert (swept.points[0].runs[0].folder / METRICS_FILE).read_bytes() == (folder / METRICS_FILE).read_bytes()
    resumed = sweep(NO_WORKLOAD, seeds=[0], out=tmp_path / "sweep", workload=workload, plots=False)
    assert (resumed.ran, resumed.resumed) == (0, 1) and resumed.table() == swept.table()
    wider = sweep(NO_WORKLOAD, seeds=[0], out=tmp_path / "sweep", plots=False,
                  workload=plugin.SineWorkload(plugin.SineConfig(hidden_dim=12)))
    assert (wider.ran, wider.resumed) == (1, 0), "another workload object is another run"


def test_the_thread_count_is_recorded_and_part_of_the_folder_hash(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    one = sweep(BASE, seeds=[0], out=out, plots=False)
    two = sweep(BASE, seeds=[0], out=out, plots=False, overrides=["research.threads=2"])
    assert (two.ran, two.resumed) == (1, 0), "another thread count is another run, never a resumed one"
    folders = sorted((out / "runs").iterdir())
    assert len(folders) == 2
    written = {json.loads((f / CONFIG_FILE).read_text())["research"]["threads"]: f for f in folders}
    assert sorted(written) == [1, 2]
    for threads, folder in written.items():
        config = json.loads((folder / CONFIG_FILE).read_text())
        assert config["torch_threads"] == threads  # what torch computed with, not only what was asked
    assert one.points[0].runs[0].folder == written[1]
    with pytest.raises(ConfigFileError) as bad:
        sweep(BASE, seeds=[0], out=out, plots=False, overrides=["research.threads=0"])
    assert bad.value.key == "research.threads"


def test_an_edited_plugin_gets_new_run_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "plugins"
    copy.mkdir()
    shutil.copy(PLUGINS / f"{PLUGIN}.py", copy / f"{PLUGIN}.py")
    monkeypatch.syspath_prepend(str(copy))
    out = tmp_path / "sweep"
    base = {**BASE, "outer_optimizer": {"name": "signsgd"}}
    assert sweep(base, seeds=[0], out=out, plots=False).ran == 1
    with (copy / f"{PLUGIN}.py").open("a") as source:
        source.write("\n# edited\n")
    sys.modules.pop(PLUGIN)
    again = sweep(base, seeds=[0], out=out, plots=False)
    assert (again.ran, again.resumed) == (1, 0)
    configs = [json.loads((f / CONFIG_FILE).read_text()) for f in (out / "runs").iterdir()]
    assert len({c["plugins"][0]["source_sha256"] for c in configs}) == 2


def test_the_commands_take_plugin(
    tmp_path: Path, capsys: Any, require_extra: Callable[[str, str], ModuleType]
) -> None:
    config = tmp_path / "base.toml"
    config.write_text(
        '[workload]\nname = "sine"\nhidden_dim = 8\n[algorithm]\ninner_steps = 5\n'
        '[sites]\ncount = 2\n[simulation]\ntotal_inner_steps = 5\neval_every_steps = 5\ndevice = "cpu"\n'
    )
    assert main(["sweep", str(config), "--out", str(tmp_path / "x"), "--no-plots"]) == 2
    assert "[research] plugins" in capsys.readouterr().err  # `sine` is unknown without the plug-in
    sweep_argv = ["sweep", str(config), "--plugin", PLUGIN, "--grid", "outer_optimizer.name=signsgd",
                  "--out", str(tmp_path / "sweep"), "--no-plots"]
    assert main(sweep_argv) == 0
    (folder,) = (tmp_path / "sweep" / "runs").iterdir()
    written = json.loads((folder / CONFIG_FILE).read_text())
    assert written["research"]["plugins"] == [PLUGIN] and written["outer_optimizer"]["name"] == "signsgd"
    assert main(["simulate", "--config", str(config), "--plugin", PLUGIN, "--out", str(tmp_path / "sim"),
                 "--set", "outer_optimizer.name=signsgd"]) == 0
    assert (tmp_path / "sim" / METRICS_FILE).read_bytes() == (folder / METRICS_FILE).read_bytes()
    require_extra("optuna", "optuna")
    assert main(["tune", str(config), "--plugin", PLUGIN, "--param", "outer_optimizer.lr=0.0001:0.01:log",
                 "--trials", "1", "--out", str(tmp_path / "tune"), "--no-plots",
                 "--set", "outer_optimizer.name=signsgd"]) == 0
