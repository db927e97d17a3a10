"""The rank side of the torch.distributed tests: run under torch.multiprocessing.spawn with gloo."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

from asynctrace.testing import MemorySink
from tests.distributed._helpers import make_samples, pair_of, shared_groups

K = 8
# Samples per rank for each step: the bytes a rank sends must not grow with these.
SAMPLES_PER_STEP = (20, 400, 2000, 60)
# Checked on the two ranks of `run_pair`, into memory (the others go to Trackio in `run`).
PAIR_SAMPLERS = ("reservoir", "group")
# Every group policy, on two ranks that split some groups between them (see `shared_groups`).
GROUP_POLICIES = ("top_bottom", "top", "bottom", "first", "random")
GROUP_STEPS = 8


def sampler_for(name: str) -> Any:
    """The sampler a global run uses: groups are pairs of one rank's samples."""
    import asynctrace as at

    return at.GroupSampler("top_bottom", key=pair_of, group_size=2) if name == "group" else name


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


def run_pair(rank: int, world_size: int, port: int, project: str, out_dir: str) -> None:
    """Two ranks: a flush that ends a step only one rank had open, then a collective whose peer dies."""
    import datetime

    import torch.distributed as dist

    from asynctrace.distributed import DistributedTraceLogger

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=20),
    )
    result: dict[str, Any] = {"rank": rank}

    # The reservoir's and the group sampler's whole-step pick, merged from both ranks.
    for name in PAIR_SAMPLERS:
        memory = MemorySink()
        logger = DistributedTraceLogger(
            project,
            f"sel-{name}",
            mode="global",
            max_traces_per_step=K,
            sampler=sampler_for(name),
            sinks=[memory],
        )
        result[f"bytes_{name}"] = _log_steps(logger, "g", rank)
        logger.finish(60.0)
        result[f"written_{name}"] = {
            str(step): sorted(r.sample.metadata["uid"] for r in recs) for step, recs in memory.steps().items()
        }

    # Each group policy over two ranks, some groups split between them: the pick of one process.
    for policy in GROUP_POLICIES:
        import asynctrace as at

        memory = MemorySink()
        logger = DistributedTraceLogger(
            project,
            f"groups-{policy}",
            mode="global",
            max_traces_per_step=K,
            sampler=at.GroupSampler(policy),  # type: ignore[arg-type]
            sinks=[memory],
        )
        for step in range(GROUP_STEPS):
            rows = shared_groups(rank, step)
            logger.log_samples(rows[: len(rows) // 2], step=step)
            logger.log_samples(rows[len(rows) // 2 :], step=step)
            logger.end_step(step)
        logger.finish(60.0)
        result[f"groups_{policy}"] = {
            str(step): sorted(r.sample.metadata["uid"] for r in recs) for step, recs in memory.steps().items()
        }

    # random with seed=None: each rank's sampler drew its own seed; the logger takes rank 0's.
    import asynctrace as at

    unseeded = at.GroupSampler("random", seed=None)
    result["own_seed"] = unseeded.run_seed
    memory = MemorySink()
    logger = DistributedTraceLogger(
        project, "groups-unseeded", mode="global", max_traces_per_step=K, sampler=unseeded, sinks=[memory]
    )
    result["agreed_seed"] = unseeded.run_seed
    for step in range(GROUP_STEPS):
        logger.log_samples(shared_groups(rank, step), step=step)
        logger.end_step(step)
    logger.finish(60.0)
    result["groups_unseeded"] = {
        str(step): sorted(r.sample.metadata["uid"] for r in recs) for step, recs in memory.steps().items()
    }

    # flush() ends step 0 on rank 0 only (rank 1 has nothing of it open); rank 1's later samples
    # for step 0 must not start a second selection of the step on the writing rank.
    sink = MemorySink()
    flushed = DistributedTraceLogger(project, "flush", mode="global", max_traces_per_step=2, sinks=[sink])
    if rank == 0:
        flushed.log_samples(make_samples("f0", 0, 5, seed=0), step=0)
    flushed.flush(30.0)
    if rank == 1:
        flushed.log_samples(make_samples("f1", 0, 5, seed=1), step=0)
    flushed.finish(30.0)
    gathered = flushed.gather_stats()
    if gathered is not None:
        result["flush_stats"] = [asdict(s) for s in gathered]
        result["flush_written"] = [r.step for r in sink.records]

    # The writing rank's session_factory fails: every rank raises at construction, none waits
    # in a collective for a writer that is not there.
    def broken(rank: int, run: str) -> Any:
        raise OSError("disk full")

    try:
        DistributedTraceLogger(
            project, "broken", mode="global", max_traces_per_step=2, session_factory=broken
        )
    except Exception as exc:
        result["broken"] = f"{type(exc).__name__}: {exc}"

    # Rank 1 dies; rank 0's end_step fails in the collective.
    failing = DistributedTraceLogger(
        project, "dies", mode="global", max_traces_per_step=4, sinks=[MemorySink()]
    )
    dist.barrier()
    if rank == 1:
        _write(out_dir, rank, result)
        os._exit(0)  # the rank dies (OOM, segfault, ...) without a word to its peer
    try:
        with failing:
            failing.log_samples(make_samples("d", 0, 3, seed=0), step=0)
            failing.end_step(0)
    except Exception as exc:
        result["error"] = type(exc).__name__
    result["dies_stats"] = asdict(failing.stats())
    _write(out_dir, rank, result)
    os._exit(0)  # the process group has a dead peer: skip its teardown


def run_then_pair(
    rank: int, world_size: int, ports: tuple[int, int], projects: tuple[str, str], out_dir: str
) -> None:
    """`run` on every rank, then `run_pair` on ranks 0 and 1 in a process group of their own:
    one spawn for both, so the ranks' start-up (torch's import) is paid once."""
    run(rank, world_size, ports[0], projects[0], out_dir)
    if rank < 2:
        run_pair(rank, 2, ports[1], projects[1], out_dir)


def _write(out_dir: str, rank: int, result: dict[str, Any]) -> None:
    with open(os.path.join(out_dir, f"pair{rank}.json"), "w") as f:
        json.dump(result, f)
