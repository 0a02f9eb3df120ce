"""One rank of a sharded site: a Llama-style decoder trained with FSDP2 through geoloco.

Run it on every rank of the site with torchrun (one process per GPU, or per CPU slot):

    torchrun --standalone --nproc_per_node=2 examples/llama_fsdp/train_site.py \
        --coordinator localhost:7000 --site dc-east --certs certs

Every rank holds only its rows of every parameter (FSDP2's dim-0 shard), trains with its own
AdamW and LR schedule, and between rounds uploads the pseudo-gradient of its own rows to the
coordinator itself, in parallel with the other ranks. The inner loop below is ordinary PyTorch;
the only geoloco parts are ``ShardedSite`` and its ``rounds()`` loop.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from model import ModelSize, TextBatches, build_model, eval_loss, eval_windows  # model.py, beside this file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import get_cosine_schedule_with_warmup

from geoloco.protos.transport_tls import TLSFiles
from geoloco.site_agent.sharded import ShardedSite


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    parser.add_argument("--site", required=True, help="this site's name (its certificate's name)")
    parser.add_argument("--certs", type=Path, required=True, help="folder with ca.crt and SITE.crt/SITE.key")
    parser.add_argument("--site-index", type=int, default=0, help="which share of the corpus this site trains on")
    parser.add_argument("--num-sites", type=int, default=2, help="how many shares the corpus is cut into")
    parser.add_argument("--schedule-rounds", type=int, default=10,
                        help="LR schedule length in rounds when the run has no total_rounds (unbounded)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the data order (the weights come from the coordinator)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--clip", type=float, default=1.0, help="max gradient norm (over the whole model)")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                        help="bf16 autocast for forward and loss (where the device supports it)")
    parser.add_argument("--eval-windows", type=int, default=8, help="held-out windows scored at every round start")
    parser.add_argument("--offload", action="store_true",
                        help="keep the global rows and residual in CPU memory (GPU sites)")
    parser.add_argument("--round-log", type=Path, default=None,
                        help="append one JSON line per round of this rank to ROUND_LOG/rank<r>.jsonl")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous. On GPUs, FSDP's collectives
    # (CUDA tensors) go over NCCL; gloo beside it carries CPU-tensor collectives if the loop
    # has any (ShardedSite's own run on the model's device under NCCL); CPU-only machines use
    # gloo alone.
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timedelta(minutes=10))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()

    # The same model as the coordinator's (its values are replaced by the coordinator's weights
    # at join), then sharded: one FSDP unit per decoder layer (all-gathered one at a time during
    # forward and backward), the embedding, final norm and head in the root unit.
    model = build_model(ModelSize(), seed=args.seed).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    # The inner optimizer and its schedule are the user's; they live across rounds (DiLoCo keeps
    # the inner optimizer state from round to round), and the schedule runs over the whole run.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule: torch.optim.lr_scheduler.LambdaLR | None = None

    site = ShardedSite(
        model, optimizer, coordinator=args.coordinator, site=args.site,
        tls=TLSFiles.from_dir(args.certs, args.site), offload=args.offload,
    )
    batches = TextBatches(args.site_index, args.num_sites, batch_size=args.batch_size, seq_len=args.seq_len,
                          seed=1000 * args.seed + 100 * args.site_index + rank)
    held_out = eval_windows(args.eval_windows, args.seq_len).to(device)
    bf16 = args.bf16 and (device.type == "cpu" or torch.cuda.is_bf16_supported())
    log = None
    if args.round_log is not None:
        args.round_log.mkdir(parents=True, exist_ok=True)
        log = (args.round_log / f"rank{rank}.jsonl").open("a")

    for rnd in site.rounds():
        # The model's local rows now hold the round's global weights.
        if schedule is None:  # the coordinator sets the rounds and inner steps; the schedule spans them all
            total_steps = (rnd.total_rounds or args.schedule_rounds) * rnd.inner_steps
            schedule = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)
        # Held-out loss of the global weights, in fp32: the number the coordinator logged as the
        # previous round's eval_loss. Every rank runs it (FSDP's all-gathers must match).
        start_loss = eval_loss(model, held_out)
        losses: list[float] = []
        for _ in range(rnd.inner_steps):
            tokens = next(batches).to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            rnd.samples += tokens.numel()  # the site's weight: tokens trained on, summed over ranks
        record = {
            "round": rnd.number, "rank": rank, "eval_loss": start_loss, "train_loss": sum(losses) / len(losses),
            "grad_norm": float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm),
            "lr": schedule.get_last_lr()[0], "tokens": rnd.samples, "shard_numel": site.shard_numel,
            "shard_ranges": site.ranges,
        }
        if rank == 0:
            print(f"round {rnd.number}: held-out loss {start_loss:.3f}, train loss {record['train_loss']:.3f}, "
                  f"lr {record['lr']:.2e}", flush=True)
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()

    print(f"rank {rank}: {site.summary}", flush=True)
    if log is not None:
        log.write(json.dumps({"rank": rank, "summary": {
            "rounds_trained": site.summary.rounds_trained, "rounds_included": site.summary.rounds_included,
            "final_round": site.summary.final_round, "run_finished": site.summary.run_finished,
        }}) + "\n")
        log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
