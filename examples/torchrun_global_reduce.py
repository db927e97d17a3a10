"""An SPMD trainer that keeps the top and bottom 4 rewards of each step across all ranks.

Run it with: torchrun --nproc-per-node 2 examples/torchrun_global_reduce.py
(add --mode per_rank or --mode per_rank_stream to compare the other modes).

Each rank selects its own candidates as it goes (O(k) per step, whatever the batch size); at the
end of a step the candidates are gathered to rank 0, which picks over the whole step and writes
one Trackio run. Open the dashboard with: trackio show --project "asynctrace-torchrun"
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import torch
import torch.distributed as dist

from asynctrace.distributed import DistributedTraceLogger

STEPS = 5
BATCH_PER_RANK = 256


def rollouts(rank: int, step: int) -> list[dict[str, Any]]:
    """Stands in for this rank's share of a step's generations."""
    rng = random.Random(f"{rank}:{step}")
    rewards = torch.rand(BATCH_PER_RANK, generator=torch.Generator().manual_seed(rank * 1000 + step))
    return [
        {
            "prompt": f"rank {rank} prompt {i}: name a prime above {rng.randint(10, 99)}",
            "response": str(rng.choice([97, 98, 101, 103])),
            "reward": reward,  # a 0-d tensor: converted to a float when encoded
            "rank": rank,
        }
        for i, reward in enumerate(rewards)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="global", choices=["global", "per_rank", "per_rank_stream"])
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun provides rank, world size and the rendezvous
    rank = dist.get_rank()
    cap = None if args.mode == "per_rank_stream" else 8
    with DistributedTraceLogger(
        "asynctrace-torchrun",
        mode=args.mode,
        max_traces_per_step=cap,
        sampler="top_bottom",
    ) as traces:
        for step in range(STEPS):
            traces.log_samples(rollouts(rank, step), step=step)  # local: no communication
            # ... forward, backward, optimizer step ...
            traces.end_step(step)  # a collective in "global" mode: every rank calls it
        stats = traces.finish()  # drains and finishes the run before the process group goes
    print(f"rank {rank}: {stats.submitted} samples, {stats.bytes_sent} bytes sent in reductions")
    if stats.session is not None:
        print(f"rank {rank} wrote run {traces.run_name!r}: {stats.session.summary()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
