"""examples/llama_fsdp run as a user runs it, for two rounds on CPU: the example's coordinator
(its ``start_coordinator``, port 0, mutual TLS with certificates from its ``make_certs``, temp
dirs) and its site script under torchrun with 2 gloo ranks (FSDP2, AdamW, warmup+cosine
schedule, bf16 autocast, gradient clipping), as a real subprocess.

What could go wrong and is checked: the site counted once per round with the tokens of both
ranks; the coordinator's weights moved and stayed finite; the ranks' rows tile the model exactly
once; every rank starts round 1 from the coordinator's weights after round 0 (its fp32 held-out
loss equals the coordinator's, the same fixed windows through the sharded model: equal on this
machine, compared within 1e-5 relative for another float order of the sharded forward), and
round 0 from the coordinator's initial weights although the site built its model from another
seed; the held-out loss fell.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from _torchrun import finish, torchrun

from geoloco.coordinator.metrics import read_metrics

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama_fsdp"
SITE = "dc-east"
ROUNDS = 2
INNER_STEPS = 3
BATCH_SIZE = 4
SEQ_LEN = 64
RANKS = 2
EVAL_WINDOWS = 4
SITE_SEED = 7
"""The site's own initial weights differ from the coordinator's (seed 0): the join replaces them."""
LAUNCH_TIMEOUT_S = 300.0
"""Upper bound for the torchrun launch (about 20 s on an idle 2-core machine); only a hang nears it."""


def _load(name: str, monkeypatch: pytest.MonkeyPatch, *, as_name: str) -> ModuleType:
    """Import an example file as ``as_name``; every module it adds is removed after the test."""
    spec = importlib.util.spec_from_file_location(as_name, EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, as_name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def example(require_extra: Callable[[str, str], ModuleType], monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The example's coordinator module (its ``from model import ...`` sees the example's model)."""
    require_extra("transformers", "hf")
    _load("model", monkeypatch, as_name="model")  # what coordinator.py's ``from model import`` finds
    return _load("coordinator", monkeypatch, as_name="llama_fsdp_coordinator")  # not geoloco's folder


def _run_site(port: int, certs: Path, log_dir: Path) -> tuple[int, str]:
    command = [
        str(EXAMPLE / "train_site.py"),
        "--coordinator", f"localhost:{port}", "--site", SITE, "--certs", str(certs),
        "--batch-size", str(BATCH_SIZE), "--seq-len", str(SEQ_LEN),
        "--eval-windows", str(EVAL_WINDOWS), "--warmup-steps", "2", "--round-log", str(log_dir),
        "--seed", str(SITE_SEED),
    ]
    proc = torchrun(command, nproc=RANKS, CUDA_VISIBLE_DEVICES="")  # gloo on CPU, also on a GPU machine
    output = finish(proc, LAUNCH_TIMEOUT_S)
    return proc.returncode, output


def _rank_log(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [line for line in lines if "round" in line], lines[-1]["summary"]


def test_llama_fsdp_example_trains_two_rounds_through_a_sharded_site(example: ModuleType, tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    example.make_certs(certs, [SITE], [])
    metrics = tmp_path / "metrics.jsonl"
    server = example.start_coordinator(certs, [SITE], rounds=ROUNDS, inner_steps=INNER_STEPS, metrics=metrics,
                                       eval_windows_count=EVAL_WINDOWS, seq_len=SEQ_LEN)
    initial = server.rounds.weights.clone()
    try:
        returncode, output = _run_site(server.port, certs, tmp_path / "logs")
        assert returncode == 0, f"the site failed:\n{output[-6000:]}"
        # The ranks saw the last broadcast and rank 0 left the run (no heartbeat timeout).
        assert server.rounds.finished and SITE not in server.rounds.members
        final = server.rounds.weights.clone()
    finally:
        server.stop(grace=0)

    assert bool(torch.isfinite(final).all())
    assert not torch.equal(final, initial), "the coordinator's weights did not move"

    records = read_metrics(metrics)
    assert [r["round"] for r in records] == list(range(ROUNDS))
    assert [r["participants"] for r in records] == [[SITE]] * ROUNDS
    # One site, counted once per round, weighing the tokens of both ranks' inner steps.
    tokens_per_rank = INNER_STEPS * BATCH_SIZE * SEQ_LEN
    assert [r["sample_weights"] for r in records] == [{SITE: float(RANKS * tokens_per_rank)}] * ROUNDS
    assert all(math.isfinite(r["eval_loss"]) for r in records)

    model = sys.modules["model"]  # the example's model.py, as the fixture loaded it
    windows = model.eval_windows(EVAL_WINDOWS, SEQ_LEN)
    initial_loss = model.eval_loss(model.build_model(model.ModelSize(), seed=0), windows)
    site_seed_loss = model.eval_loss(model.build_model(model.ModelSize(), seed=SITE_SEED), windows)
    covered = torch.zeros(final.numel(), dtype=torch.int64)
    for rank in range(RANKS):
        rounds, summary = _rank_log(tmp_path / "logs" / f"rank{rank}.jsonl")
        assert [r["round"] for r in rounds] == list(range(ROUNDS))
        assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["grad_norm"]) for r in rounds)
        assert all(r["tokens"] == tokens_per_rank for r in rounds)
        assert summary == {"rounds_trained": ROUNDS, "rounds_included": ROUNDS, "final_round": ROUNDS,
                           "run_finished": True}
        assert 0 < rounds[0]["shard_numel"] < final.numel()  # a shard, not the model
        for offset, n in rounds[0]["shard_ranges"]:
            covered[offset : offset + n] += 1
        # Round 0 started from the coordinator's initial weights, not the site's own seed's ...
        assert rounds[0]["eval_loss"] == pytest.approx(initial_loss, rel=1e-5)
        assert rounds[0]["eval_loss"] != pytest.approx(site_seed_loss, rel=1e-5)
        # ... and round 1 from the weights the coordinator scored after round 0.
        assert rounds[1]["eval_loss"] == pytest.approx(records[0]["eval_loss"], rel=1e-5)
        # Two rounds of training lowered the held-out loss from the initial weights'.
        assert records[-1]["eval_loss"] < rounds[0]["eval_loss"] - 0.05
    assert bool((covered == 1).all()), "the ranks' rows must tile the model exactly once"
