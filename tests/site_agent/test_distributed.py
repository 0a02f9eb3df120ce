"""Intra-site data parallelism: the single-process group, input validation, and a real 2-rank site.

The multi-process tests launch ``torchrun --standalone`` (the command users run; its rendezvous
store binds a free port, so no port is fixed) on CPU with gloo and check what the worker script
saved: DDP really averaged gradients (against a single-process computation of the mean-gradient
step), the leader's broadcast leaves every rank with bit-identical weights, and control messages
arrive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from geoloco.algorithms.params import ParamLayout
from geoloco.scenarios.workloads import MLPWorkload
from geoloco.site_agent.distributed import (
    BACKENDS,
    IntraSiteGroup,
    init_from_env,
    rank_data_seed,
    shard_range,
    unwrap_model,
)

WORKER = Path(__file__).with_name("_distributed_worker.py")
WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 120.0
"""Upper bound for one torchrun launch (about 5 s when idle); only a hang gets near it."""

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A process that was not started by torchrun (whatever launched pytest)."""
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _set_env(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, value)


# --- single process: the same code path without torchrun -------------------------------------


def test_single_process_group_without_torchrun(no_torchrun_env: pytest.MonkeyPatch) -> None:
    group = init_from_env(device="cpu")
    assert (group.rank, group.world_size, group.local_rank) == (0, 1, 0)
    assert group.is_leader and not group.is_distributed
    assert group.device == torch.device("cpu") and group.backend == "gloo"
    assert not dist.is_initialized()

    model = nn.Linear(3, 2)
    wrapped = group.wrap_model(model)
    assert wrapped is model and unwrap_model(wrapped) is model

    flat = torch.arange(5, dtype=torch.float32)
    assert group.broadcast_flat_(flat) is flat
    assert torch.equal(flat, torch.arange(5, dtype=torch.float32))
    control = {"round": 3, "action": "stop"}
    assert group.broadcast_object(control) is control
    total = torch.tensor([2.0])
    assert torch.equal(group.all_reduce_(total, "mean"), torch.tensor([2.0]))
    group.barrier()
    assert group.data_seed(42) == 42
    assert group.shard(10) == range(10)

    with group:
        pass
    group.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        group.broadcast_flat_(flat)
    with pytest.raises(RuntimeError, match="closed"):
        group.wrap_model(model)


def test_default_device_and_backend_follow_cuda(no_torchrun_env: pytest.MonkeyPatch) -> None:
    with init_from_env() as group:
        if torch.cuda.is_available():
            assert group.device == torch.device("cuda", 0) and group.backend == "nccl"
            assert torch.cuda.current_device() == 0
            model = group.wrap_model(nn.Linear(3, 2))
            assert next(model.parameters()).device == group.device
        else:
            assert group.device == torch.device("cpu") and group.backend == "gloo"


def test_torchrun_with_one_process_needs_no_process_group(
    no_torchrun_env: pytest.MonkeyPatch,
) -> None:
    _set_env(no_torchrun_env, RANK="0", WORLD_SIZE="1")
    group = init_from_env(device="cpu")
    assert group.world_size == 1 and group.is_leader and not group.is_distributed
    assert not dist.is_initialized()


# --- errors that say what to change ------------------------------------------------------------


def test_unknown_backend_lists_valid_ones(no_torchrun_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown backend 'mpi'") as info:
        init_from_env("mpi", device="cpu")
    for name in BACKENDS:
        assert name in str(info.value)


def test_nccl_on_cpu_points_to_gloo(no_torchrun_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="nccl.*needs CUDA.*backend='gloo'"):
        init_from_env("nccl", device="cpu")


def test_nccl_without_cuda_points_to_gloo(no_torchrun_env: pytest.MonkeyPatch) -> None:
    no_torchrun_env.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="nccl.*needs CUDA.*backend='gloo'"):
        init_from_env("nccl")
    with pytest.raises(ValueError, match="CUDA is not available.*device='cpu'"):
        init_from_env(device="cuda")


def test_unsupported_device_type(no_torchrun_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="'meta' is not supported.*'cuda'.*'cpu'"):
        init_from_env(device="meta")


def test_local_rank_beyond_visible_gpus(no_torchrun_env: pytest.MonkeyPatch) -> None:
    no_torchrun_env.setattr(torch.cuda, "is_available", lambda: True)
    no_torchrun_env.setattr(torch.cuda, "device_count", lambda: 1)
    _set_env(no_torchrun_env, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    with pytest.raises(ValueError, match=r"CUDA device 1 \(LOCAL_RANK=1\).*--nproc_per_node <= 1"):
        init_from_env(device="cuda")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WORLD_SIZE": "2"}, "RANK is not set; launch the site with torchrun"),
        ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE must be an integer, got 'two'"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE must be >= 1"),
        ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"}, r"RANK=2 must be in \[0"),
        ({"WORLD_SIZE": "2", "RANK": "1"}, "LOCAL_RANK is not set"),
        ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "-1"}, "LOCAL_RANK must be >= 0"),
        (
            {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_PORT": "1"},
            "MASTER_ADDR is not set but WORLD_SIZE=2; launch the site with torchrun",
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"},
            "MASTER_PORT is not set",
        ),
    ],
)
def test_bad_torchrun_environment(
    no_torchrun_env: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    _set_env(no_torchrun_env, **env)
    with pytest.raises(ValueError, match=message):
        init_from_env(device="cpu")
    assert not dist.is_initialized()


def test_collective_argument_errors(no_torchrun_env: pytest.MonkeyPatch) -> None:
    group = init_from_env(device="cpu")
    with pytest.raises(ValueError, match=r"src must be a rank in \[0, 1\), got 1"):
        group.broadcast_flat_(torch.zeros(2), src=1)
    with pytest.raises(ValueError, match=r"src must be a rank"):
        group.broadcast_object("x", src=-1)
    with pytest.raises(ValueError, match="unknown reduce op 'avg'.*'max', 'mean', 'min', 'sum'"):
        group.all_reduce_(torch.zeros(2), "avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'mean' needs a floating-point tensor.*op='sum'"):
        group.all_reduce_(torch.zeros(2, dtype=torch.int64), "mean")


def test_group_repr_names_rank_and_device() -> None:
    group = IntraSiteGroup(
        rank=1,
        world_size=4,
        local_rank=1,
        device=torch.device("cpu"),
        backend="gloo",
        owns_process_group=False,
    )
    assert repr(group) == (
        "IntraSiteGroup(rank=1, world_size=4, local_rank=1, device=cpu, backend='gloo')"
    )
    assert not group.is_leader and group.shard(10) == range(3, 6)


# --- per-rank data ------------------------------------------------------------------------------


def test_rank_data_seeds_keep_rank0_and_separate_the_rest() -> None:
    assert rank_data_seed(7, 0) == 7
    seeds = [rank_data_seed(7, rank) for rank in range(16)]
    assert len(set(seeds)) == 16
    assert seeds == [rank_data_seed(7, rank) for rank in range(16)]
    # Hashing, unlike site_seed + rank, keeps site 7's rank 1 apart from site 8's rank 0.
    assert rank_data_seed(7, 1) != rank_data_seed(8, 0)
    assert all(0 <= seed < 2**63 for seed in seeds)
    with pytest.raises(ValueError, match="rank must be >= 0"):
        rank_data_seed(7, -1)


@pytest.mark.parametrize("num_items", [0, 1, 5, 10, 17])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_shards_are_disjoint_complete_and_balanced(num_items: int, world_size: int) -> None:
    shards = [shard_range(num_items, rank, world_size) for rank in range(world_size)]
    assert [i for shard in shards for i in shard] == list(range(num_items))
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1


def test_shard_errors() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        shard_range(4, 0, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        shard_range(4, 2, 2)
    with pytest.raises(ValueError, match="num_items must be >= 0"):
        shard_range(-1, 0, 2)


# --- a real two-rank site under torchrun --------------------------------------------------------


def _kill_process_group(proc: subprocess.Popen[str]) -> None:
    """Kill torchrun and any worker it left behind (they share its new session's group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run_site(mode: str, out_dir: Path) -> dict[int, dict[str, Any]]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={WORLD_SIZE}",
        "--max-restarts=0",
        str(WORKER),
        mode,
        str(out_dir),
    ]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_process_group(proc)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun {mode} ran over {LAUNCH_TIMEOUT_S} s; output:\n{output[-6000:]}")
    finally:
        _kill_process_group(proc)
    assert proc.returncode == 0, f"torchrun {mode} failed:\n{output[-6000:]}"
    return {
        rank: torch.load(out_dir / f"rank{rank}.pt", weights_only=False)
        for rank in range(WORLD_SIZE)
    }


def _local_gradient(
    workload: MLPWorkload, weights: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """One rank's gradient at ``weights`` on ``batch``, computed in this (single) process."""
    model = workload.build_model(seed=0)
    layout = ParamLayout.from_model(model)
    layout.load_(model, weights)
    workload.loss(model, batch).backward()
    return layout.flatten_grads(model)


def _assert_averaged_step(
    workload: MLPWorkload,
    ranks: dict[int, dict[str, Any]],
    start: torch.Tensor,
    step_index: int,
    result_key: str,
    result_index: int | None,
) -> None:
    """Both ranks took the mean-gradient SGD step from ``start``, not their own local step."""
    lr = ranks[0]["learning_rate"]
    results = [
        ranks[r][result_key] if result_index is None else ranks[r][result_key][result_index]
        for r in range(WORLD_SIZE)
    ]
    assert torch.equal(results[0], results[1]), "replicas diverged after a DDP step"
    gradients = [
        _local_gradient(workload, start, ranks[r]["batches"][step_index]) for r in range(WORLD_SIZE)
    ]
    expected = start - lr * (gradients[0] + gradients[1]) / WORLD_SIZE
    torch.testing.assert_close(results[0], expected, rtol=0, atol=2e-6)
    for gradient in gradients:
        local_only = start - lr * gradient
        assert (results[0] - local_only).abs().max() > 1e-3, "step used one rank's gradient"


def test_two_rank_site_averages_gradients_and_broadcasts(tmp_path: Path) -> None:
    ranks = _run_site("train", tmp_path)
    leader, other = ranks[0], ranks[1]
    workload = MLPWorkload()

    assert (leader["rank"], leader["world_size"], leader["is_leader"]) == (0, 2, True)
    assert (other["rank"], other["world_size"], other["is_leader"]) == (1, 2, False)
    assert leader["wrapped_type"] == other["wrapped_type"] == "DistributedDataParallel"

    # wrap_model made rank 0's initial weights everyone's.
    assert not torch.equal(leader["own_init"], other["own_init"])
    assert torch.equal(other["synced_init"], leader["own_init"])
    assert torch.equal(leader["synced_init"], leader["own_init"])

    # Ranks read different data.
    assert leader["data_seed"] != other["data_seed"]
    for (x0, _), (x1, _) in zip(leader["batches"], other["batches"], strict=True):
        assert not torch.equal(x0, x1)

    # Every inner step applied the mean of both ranks' gradients.
    start = leader["synced_init"]
    for step in range(leader["inner_steps"]):
        _assert_averaged_step(workload, ranks, start, step, "after_step", step)
        start = leader["after_step"][step]

    batch_size = len(leader["batches"][0][0])
    assert leader["samples"].item() == other["samples"].item() == 2 * 3 * batch_size
    assert leader["mean_rank"].item() == other["mean_rank"].item() == 0.5
    assert leader["max_rank"].item() == other["max_rank"].item() == 1

    # The leader's new weights replaced the other rank's garbage bit for bit.
    assert other["sent"].isnan().all()
    assert not torch.equal(leader["sent"], leader["after_step"][-1])
    assert torch.equal(leader["after_broadcast"], leader["sent"])
    assert torch.equal(other["after_broadcast"], leader["sent"])
    assert torch.equal(other["strided_received"], leader["sent"])
    assert leader["control"] == other["control"] == {"round": 1, "action": "continue"}

    # Training resumed from the broadcast weights, still averaged and in lockstep.
    _assert_averaged_step(
        workload, ranks, leader["sent"], leader["inner_steps"], "after_resume", None
    )

    # A wrongly sized buffer failed on both ranks with the same advice, instead of hanging.
    for rank in ranks.values():
        assert "rank 1 passed a different shape or dtype" in rank["mismatch_error"]
        assert "ParamLayout" in rank["mismatch_error"]
        assert rank["closed_after_with"]
        assert "once per process" in rank["second_init_error"]


def test_two_rank_site_adopts_an_existing_process_group(tmp_path: Path) -> None:
    ranks = _run_site("adopt", tmp_path)
    for rank in ranks.values():
        assert rank["backend"] == "gloo"
        assert rank["control"] == "stop"
        assert rank["left_open"], "close() destroyed a process group it did not create"
