"""The rank side of the torch.distributed tests: run under torch.multiprocessing.spawn with gloo."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

from tests.distributed._helpers import make_samples

K = 8
# Samples per rank for each step: the bytes a rank sends must not grow with these.
SAMPLES_PER_STEP = (20, 400, 2000, 60)


def _log_steps(logger: Any, tag: str, rank: int, *, end_steps: bool = True) -> list[int]:
    """Log every step in chunks; returns the bytes this rank sent in each step's reduction."""
    sent = []
    for step, n in enumerate(SAMPLES_PER_STEP):
        samples = make_samples(f"{tag}{rank}", step, n, seed=rank)
        for i in range(0, n, 50):
            logger.log_samples(samples[i : i + 50], step=step)
        if end_steps:
            logger.end_step(step)
            sent.append(logger.stats().last_reduction_bytes)
    return sent


def run(rank: int, world_size: int, port: int, project: str, out_dir: str) -> None:
    import torch.distributed as dist

    from asynctrace.distributed import DistributedTraceLogger

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    result: dict[str, Any] = {"rank": rank}
    try:
        for sampler in ("top_bottom", "first"):
            logger = DistributedTraceLogger(
                project, f"global-{sampler}", mode="global", max_traces_per_step=K, sampler=sampler
            )
            result[f"bytes_{sampler}"] = _log_steps(logger, "g", rank)
            # A straggling sample for an ended step is late on its own rank, never sent.
            logger.log_samples(make_samples("late", 0, 3, seed=rank), step=0)
            logger.finish()
            gathered = logger.gather_stats()
            if gathered is not None:
                result[f"stats_{sampler}"] = [asdict(s) for s in gathered]

        per_rank = DistributedTraceLogger(
            project, "per-rank", mode="per_rank", max_traces_per_step=K, sampler="top_bottom"
        )
        _log_steps(per_rank, "p", rank)
        result["per_rank_run"] = per_rank.run_name
        result["per_rank_stats"] = asdict(per_rank.finish())

        stream = DistributedTraceLogger(project, "stream", mode="per_rank_stream")
        _log_steps(stream, "s", rank, end_steps=False)
        result["stream_run"] = stream.run_name
        result["stream_stats"] = asdict(stream.finish())
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
