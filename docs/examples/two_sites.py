"""Bring your own model: simulate it with two sites, then train it on two real sites over gRPC.

The tutorial docs/tutorials/bring-your-own-model.md explains it part by part. Run it with
`python docs/examples/two_sites.py` (about ten seconds on a laptop CPU; tests run it too).
"""
# ruff: noqa: E402  (each part imports what it uses, so the tutorial can show the parts one by one)

# --8<-- [start:workload]
import threading
from collections.abc import Iterator

import torch
from torch import nn


class MyWorkload:
    """Your model, your data and your loss: what the simulator and every site train."""

    name = "my-regression"

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)  # the same seed gives the same initial weights everywhere
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def site_batches(self, site: int, num_sites: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(1000 * seed + site)
        shift = float(site) - (num_sites - 1) / 2  # every site sees other inputs (non-IID)
        while True:
            x = torch.randn(64, 8, generator=generator) + shift
            yield x, x.sum(dim=1, keepdim=True).sin()

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def eval_loss(self, model: nn.Module) -> float:
        x = torch.randn(512, 8, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin()))


workload = MyWorkload()
# --8<-- [end:workload]

# --8<-- [start:simulate]
from geoloco.algorithms import SimulatorConfig, simulate

sim_config = SimulatorConfig.from_dict({
    "algorithm": {"inner_steps": 20, "uplink_codec": "int8"},
    "sites": {"count": 2, "uplink_bps": 1e7, "latency_s": 0.08},  # 10 Mbit/s, 80 ms one way
    "run": {"rounds": 5, "eval_every": 1},
    "simulation": {"device": "cpu"},
})
for record in simulate(sim_config, workload):
    simulated = record
    print(f"simulated round {record.round}: eval loss {record.eval_loss:.4f}, "
          f"{sum(record.bytes_up.values())} bytes up, {record.wall_clock_s:.2f} s on the virtual clock")
# --8<-- [end:simulate]

# --8<-- [start:real]
import json

from geoloco.algorithms import AlgorithmConfig, ParamLayout
from geoloco.coordinator import CoordinatorConfig, CoordinatorServer
from geoloco.site_agent import RoundResult, SiteAgent, SiteAgentConfig, SiteHooks

# The coordinator: the run's settings, the initial weights, and how to score the global weights.
config = CoordinatorConfig(
    algorithm=AlgorithmConfig(inner_steps=20, uplink_codec="int8"),
    total_rounds=5, min_sites=2, insecure=True, metrics_path="runs/two_sites/metrics.jsonl",
)
scored = workload.build_model(0)
layout = ParamLayout.from_model(scored)


def eval_fn(flat_weights: torch.Tensor) -> float:
    layout.load_(scored, flat_weights)
    return workload.eval_loss(scored)


server = CoordinatorServer.from_model(config, workload.build_model(0), eval_fn=eval_fn)
port = server.start()  # port 0 in the config: a free port, returned here


# Each site (here two threads of this process; in production one process per data center, with
# tls=TLSFiles.from_dir("certs", NAME) instead of insecure=True).
def run_site(k: int) -> None:
    model = workload.build_model(0)
    # Your own optimizer; these are the simulator's default [inner_optimizer] settings.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    agent = SiteAgent(
        model, optimizer, workload.site_batches(k, 2, 0), workload.loss,
        coordinator=f"127.0.0.1:{port}", site=str(k), insecure=True,
        config=SiteAgentConfig(device="cpu"),
        hooks=SiteHooks(on_round_end=lambda r: print_round(k, r)),
    )
    print(f"site {k}: {agent.run()}")


def print_round(k: int, result: RoundResult) -> None:
    print(f"site {k} round {result.round}: train loss {result.train_loss:.4f}, included {result.included}")


sites = [threading.Thread(target=run_site, args=(k,)) for k in range(2)]
for thread in sites:
    thread.start()
for thread in sites:
    thread.join()
server.wait_until_finished()
server.stop()
with open("runs/two_sites/metrics.jsonl") as records:  # one JSON object per round
    last = json.loads(records.readlines()[-1])
print(f"real round {last['round']}: eval loss {last['eval_loss']:.4f}, participants {last['participants']}")
print("the same weights as the simulator's:", last["weights_digest"] == simulated.weights_digest)
# --8<-- [end:real]
