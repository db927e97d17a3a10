"""Caller cost of tiered capture: a per-sink selection beside a full archive.

A trainer logs 1024 samples per step (``log_samples`` of 64 at a time, ``--gap`` seconds
yielded between calls as a training step would) to an archive sink that keeps everything and a
tracker sink. Variants, all with in-memory sinks (``asynctrace.testing.MemorySink``) so only
the session's own work is measured:

- ``one``: the archive alone;
- ``two``: the archive and a tracker that gets everything;
- ``selected``: the archive and ``Selected(tracker, max_traces_per_step=16, sampler="top_bottom")``;
- ``groups``: as ``selected``, with ``group_key="group_uid"`` (per-step group metrics).

Reported: the time inside ``log_samples`` per 1024-sample step (the caller's cost), and the
wall time of the whole run including ``finish()`` (the writer's work, selection included, runs
on the same event loop). Variants alternate over ``--rounds`` rounds; medians are reported and
ratios are medians of per-round ratios against ``two``. Every round checks that the archive
holds every sample and the tracker exactly 16 per step (for ``selected``).

    python benchmarks/bench_tiered.py
    python benchmarks/bench_tiered.py --quick
"""

from __future__ import annotations

import os
import tempfile

os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="asynctrace-bench-")

import argparse
import random
import statistics
import sys
import time
from typing import Any

import _common as common
import anyio

PER_STEP = 1024
CALL = 64
K = 16
VARIANTS = ("one", "two", "selected", "groups")


def make_samples(steps: int) -> list[list[Any]]:
    import asynctrace as at

    rng = random.Random(0)
    out = []
    for step in range(steps):
        bodies = common.sample_bodies(PER_STEP, 2_560, seed=step)
        samples = []
        for i, b in enumerate(bodies):
            meta = dict(b["metadata"], reward=rng.random(), group_uid=f"{step}:{i // 8}")
            samples.append(at.Sample(messages=b["messages"], metadata=meta))
        out.append(samples)
    return out


async def one_round(variant: str, steps: list[list[Any]], gap: float) -> tuple[float, float]:
    """(seconds inside log_samples per step, wall seconds of the whole run)."""
    import asynctrace as at
    from asynctrace.sinks import Selected

    archive, tracker = at.testing.MemorySink("archive"), at.testing.MemorySink("tracker")
    sinks: list[at.Sink] = [archive]
    if variant == "two":
        sinks.append(tracker)
    elif variant in ("selected", "groups"):
        sinks.append(Selected(tracker, max_traces_per_step=K, sampler="top_bottom"))
    spent = 0.0
    t_start = time.perf_counter()
    async with at.TraceSession(
        "bench",
        sinks=sinks,
        finish_timeout=300.0,
        group_key="group_uid" if variant == "groups" else None,
    ) as session:
        for step, samples in enumerate(steps):
            for c in range(0, PER_STEP, CALL):
                t0 = time.perf_counter()
                await session.log_samples(samples[c : c + CALL], step=step)
                spent += time.perf_counter() - t0
                await anyio.sleep(gap)
    wall = time.perf_counter() - t_start
    n = len(steps) * PER_STEP
    stats = session.stats()
    assert stats.written == n and stats.check(), stats.summary()
    assert len(archive.records) == n
    if variant in ("selected", "groups"):
        per_step = {r.step: 0 for r in tracker.records}
        for r in tracker.records:
            per_step[r.step] += 1
        assert per_step == dict.fromkeys(range(len(steps)), K), per_step
    return spent / len(steps), wall


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--gap", type=float, default=0.0005)
    p.add_argument("--quick", action="store_true", help="3 steps, 3 rounds")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 3, 3
    return args


async def main_async(args: argparse.Namespace) -> int:
    common.print_machine("start")
    steps = make_samples(args.steps)
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    await one_round("two", steps[:1], args.gap)  # warm-up
    for _ in range(args.rounds):
        for v in VARIANTS:
            results[v].append(await one_round(v, steps, args.gap))
    base = results["two"]
    rows = []
    for v in VARIANTS:
        call = statistics.median(r[0] for r in results[v]) * 1e3
        wall = statistics.median(r[1] for r in results[v])
        call_ratio = statistics.median(r[0] / b[0] for r, b in zip(results[v], base, strict=True))
        wall_ratio = statistics.median(r[1] / b[1] for r, b in zip(results[v], base, strict=True))
        rows.append(
            [v, f"{call:.2f}", common.fmt_ratio(call_ratio), f"{wall:.2f}", common.fmt_ratio(wall_ratio)]
        )
    print(
        f"{args.steps} steps x {PER_STEP} samples of 2.5 KB, log_samples({CALL}), k={K} top_bottom, "
        f"{args.rounds} rounds, gap {args.gap * 1e3:.1f} ms"
    )
    common.print_table(
        ["variant", "ms in log_samples per step", "vs two", "run wall s (incl. finish)", "vs two"], rows
    )
    common.print_machine("end")
    return 0


if __name__ == "__main__":
    sys.exit(common.run_main(main_async, parse_args))
