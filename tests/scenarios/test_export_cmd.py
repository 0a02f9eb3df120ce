"""The trained model out: ``geoloco export``, ``export_model`` and ``geoloco site --save-final``.

A two-round run of the built-in ``mlp`` workload (a coordinator in this process, one site through
the ``geoloco site`` command in-process): the exported file is a normal ``state_dict`` that loads
into a fresh workload model with ``strict=True`` and scores the coordinator's own eval loss; the
site's ``--save-final`` file holds the same tensors bit for bit.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.record import RoundRecord
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.export import export_model
from geoloco.coordinator.server import CoordinatorServer
from geoloco.scenarios.cli import main
from geoloco.scenarios.config_file import EXIT_OK, EXIT_RUNTIME_ERROR
from geoloco.scenarios.workloads import parse_workload

SEED = 3


@pytest.fixture(autouse=True)
def _no_reexec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEOLOCO_NO_MALLOC_REEXEC", "1")  # re-executing would replace pytest


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Checkpoints of a finished two-round mlp run, its last eval loss and digest, and the
    site's ``--save-final`` file."""
    folder = tmp_path_factory.mktemp("run")
    spec = parse_workload({"name": "mlp", "hidden_dim": 16})
    workload = spec.build()
    model = workload.build_model(SEED)
    layout = ParamLayout.from_model(model)

    def eval_fn(flat: torch.Tensor) -> float:
        layout.load_(model, flat)
        return float(workload.eval_loss(model))

    records: list[RoundRecord] = []
    done = threading.Event()

    def on_round_end(record: RoundRecord) -> None:
        records.append(record)
        if record.round == 1:
            done.set()

    config = CoordinatorConfig(
        insecure=True, port=0, total_rounds=2, min_sites=1, seed=SEED, eval_every=1,
        algorithm=AlgorithmConfig(inner_steps=3), workload=spec.to_table(),
        checkpoint_dir=str(folder / "checkpoints"),
    )
    server = CoordinatorServer(config, layout.flatten(model), layout, eval_fn, on_round_end=on_round_end)
    port = server.start()
    site_file = folder / "site-final.safetensors"
    try:
        with pytest.MonkeyPatch.context() as patch:  # module scope: before the autouse fixture
            patch.setenv("GEOLOCO_NO_MALLOC_REEXEC", "1")
            status = main([
                "site", "--coordinator", f"127.0.0.1:{port}", "--name", "0", "--insecure", "--device", "cpu",
                "--give-up-after", "30", "--save-final", str(site_file),
            ])
        assert status == EXIT_OK
        assert done.wait(30)
        assert server.wait_until_finished(timeout=30)
    finally:
        server.stop(grace=0)
    return {
        "checkpoints": folder / "checkpoints", "eval_loss": records[-1].eval_loss,
        "digest": server.rounds.digest_hex, "site_file": site_file, "spec": spec,
    }


def test_export_loads_strictly_into_the_workloads_model_and_gives_the_coordinators_eval_loss(
    finished_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.safetensors"
    assert main(["export", str(finished_run["checkpoints"]), "--out", str(out)]) == EXIT_OK
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"geoloco-export wrote {out}: round=2 ")
    assert line.endswith(f"digest={finished_run['digest']}")

    workload = finished_run["spec"].build()
    fresh = workload.build_model(SEED + 100)  # other initial weights: all of them must come from the file
    fresh.load_state_dict(load_file(str(out)), strict=True)
    assert float(workload.eval_loss(fresh)) == pytest.approx(finished_run["eval_loss"], rel=1e-6, abs=0.0)
    with safe_open(str(out), framework="pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt" and metadata["geoloco_weights_digest"] == finished_run["digest"]
    assert metadata["geoloco_round"] == "2"


def test_the_sites_save_final_file_is_the_coordinators_model(
    finished_run: dict[str, Any], tmp_path: Path
) -> None:
    exported = load_file(str(export_model(finished_run["checkpoints"], tmp_path / "m.safetensors").path))
    saved = load_file(str(finished_run["site_file"]))
    assert saved.keys() == exported.keys()
    assert all(torch.equal(saved[k], exported[k]) for k in saved)


def test_export_from_python_names_the_parameters_with_or_without_the_model(
    finished_run: dict[str, Any], tmp_path: Path
) -> None:
    workload = finished_run["spec"].build()
    model = workload.build_model(SEED)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    without = export_model(finished_run["checkpoints"], tmp_path / "params.safetensors")
    assert sorted(load_file(str(without.path))) == sorted(name for name, _ in model.named_parameters())
    with_model = export_model(finished_run["checkpoints"], tmp_path / "full.safetensors", model=model)
    assert with_model.weights_digest == finished_run["digest"] and with_model.round == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is not changed


def test_export_of_a_folder_without_a_checkpoint_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "m.safetensors")]) == EXIT_RUNTIME_ERROR
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("geoloco export: error: ") and "no checkpoint" in errors[0]
    assert not (tmp_path / "m.safetensors").exists()
