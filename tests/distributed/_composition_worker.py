"""The rank side of the cross-rank composition test: every case on two gloo ranks, one process
group for all of them. The cases' data is made here, from seeds, so the test recomputes it."""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict
from typing import Any

from tests._composition import WATCHED, Row, sample

STEPS = 4
GROUP_SIZE = 4
WATCH_BUDGET = 3  # below the watched rows of a step, so "the first max_per_step" is exercised
TIER = 4
GROUP_SEED = 7

# (name, mode, cap): a cap is (sampler, k), or None for no cap (each rank's own session).
CAPS: dict[str, tuple[str, tuple[str, int] | None]] = {
    "no-cap": ("per_rank_stream", None),
    "first": ("global", ("first", 5)),
    "top_bottom": ("global", ("top_bottom", 6)),
    "group-top": ("global", ("group-top", 8)),
    "group-random": ("global", ("group-random", 8)),
    "per-rank-top_bottom": ("per_rank", ("top_bottom", 5)),
}
CASES: list[tuple[str, bool, bool]] = [
    (cap, watch, tier) for cap in CAPS for watch in (False, True) for tier in (False, True)
]


def case_id(case: tuple[str, bool, bool]) -> str:
    cap, watch, tier = case
    return f"{cap}-{'watch' if watch else 'no-watch'}-{'tier' if tier else 'no-tier'}"


def case_steps(index: int, cap: str) -> list[list[Row]]:
    """A case's rows per step, in no particular order; distinct rewards, some rows watched.
    The group caps get whole groups of `GROUP_SIZE` (a watched prompt is one of them)."""
    rng = random.Random(f"composition:{index}")
    out = []
    rewards = iter(rng.sample(range(100_000), 200 * STEPS))
    for step in range(STEPS):
        if cap.startswith("group"):
            rows = []
            for g in range(rng.randint(3, 5)):
                prompt = WATCHED if g == 0 and rng.random() < 0.7 else f"g{step}-{g}"
                # In even steps the watched prompt scores lowest: no cap would keep it there.
                sign = -1 if prompt == WATCHED and step % 2 == 0 else 1
                rows += [
                    Row(f"s{step}-{g}-{j}", prompt, sign * next(rewards) / 7.0) for j in range(GROUP_SIZE)
                ]
        else:
            rows = [
                Row(f"s{step}-{j}", WATCHED if rng.random() < 0.3 else f"p{j % 3}", next(rewards) / 7.0)
                for j in range(rng.randint(6, 14))
            ]
        out.append(rows)
    return out


def shares(index: int, steps: list[list[Row]]) -> list[tuple[list[Row], list[Row]]]:
    """Each step's rows shuffled, each dealt to a random rank: (rank 0's, rank 1's), in the order
    each rank logs them."""
    rng = random.Random(f"shares:{index}")
    out = []
    for rows in steps:
        order = list(rows)
        rng.shuffle(order)
        dealt: tuple[list[Row], list[Row]] = ([], [])
        for r in order:
            dealt[rng.randrange(2)].append(r)
        out.append(dealt)
    return out


def sampler_of(cap: tuple[str, int] | None) -> Any:
    import asynctrace as at

    if cap is None:
        return "first"
    name = cap[0]
    if name.startswith("group-"):
        return at.GroupSampler(
            name.removeprefix("group-"),  # type: ignore[arg-type]
            key="prompt_id",
            group_size=GROUP_SIZE,
            seed=GROUP_SEED,
        )
    return name


def _by_step(records: Any, only_watched: bool = False) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in records:
        if only_watched and not r.watched:
            continue
        out.setdefault(str(r.step), []).append(r.sample.metadata["uid"])
    return {step: sorted(uids) for step, uids in out.items()}


def run(rank: int, world_size: int, port: int, project: str, out_dir: str) -> None:
    import torch.distributed as dist

    import asynctrace as at
    from asynctrace.distributed import DistributedTraceLogger
    from asynctrace.testing import MemorySink

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    results: dict[str, Any] = {}
    try:
        for index, case in enumerate(CASES):
            cap_name, watch, tier = case
            mode, cap = CAPS[cap_name]
            plain, tracker = MemorySink("archive"), MemorySink("tracker")
            sinks: list[Any] = [plain]
            if tier:
                sinks.append(at.Selected(tracker, max_traces_per_step=TIER, sampler="top_bottom"))
            logger = DistributedTraceLogger(
                project,
                f"c{index}",
                mode=mode,  # type: ignore[arg-type]
                max_traces_per_step=None if cap is None else cap[1],
                sampler=sampler_of(cap),
                sinks=sinks,
                watch=at.Watch(ids=[WATCHED], max_per_step=WATCH_BUDGET) if watch else None,
                health_metrics=False,
            )
            for step, dealt in enumerate(shares(index, case_steps(index, cap_name))):
                mine = dealt[rank]
                for part in (mine[: len(mine) // 2], mine[len(mine) // 2 :]):
                    if part:
                        logger.log_samples([sample(r) for r in part], step=step)
                if mode != "per_rank_stream":
                    logger.end_step(step)
            stats = logger.finish(60.0)
            gathered = logger.gather_stats()
            session = stats.session
            results[case_id(case)] = {
                "plain": _by_step(plain.records),
                "watched": _by_step(plain.records, only_watched=True),
                "tracker": _by_step(tracker.records),
                "rank": {**asdict(stats), "session": None, "check": stats.check()},
                "session": None if session is None else {**asdict(session), "check": session.check()},
                "gathered": None if gathered is None else [asdict(s) for s in gathered],
            }
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"compose{rank}.json"), "w") as f:
        json.dump(results, f)
