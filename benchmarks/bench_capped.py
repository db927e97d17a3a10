"""Caller cost with a cap: what ``log_samples`` costs when most of a step's samples are refused.

A trainer that keeps 16 of the 256 samples of each step calls
``await session.log_samples(batch of 32, step=s)`` eight times per step. The session asks the
cap which samples it would keep before encoding anything, and encodes only those (the
default); the other variant encodes and checks every sample first and lets the cap refuse
them afterwards (what the session did before, forced here through its private
``_precheck_cap`` switch). Both variants run with the ``first`` and the ``top_bottom``
sampler, the default ``TrackioSink``, the same 2.5 KB samples (rewards shuffled per step), and
``--gap`` seconds yielded to the event loop between calls as a training step would. Only the
time inside each call is summed. Variants alternate over ``--rounds`` rounds; the median
round is reported and the ratio is the median of per-round ratios. Every round checks that
exactly 16 samples per step reached Trackio's SQLite store.

    python benchmarks/bench_capped.py
    python benchmarks/bench_capped.py --quick
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

BATCH = 32
VARIANTS = {"check": "cap checked before encoding (default)", "encode": "encode everything, then cap"}


async def session_round(
    samples: list[Any], *, sampler: str, precheck: bool, per_step: int, cap: int, gap: float
) -> float:
    """Seconds spent inside ``log_samples`` over every call, after checking what was stored."""
    import asynctrace as at

    project = common.project_name("capped")
    spent = 0.0
    async with at.TraceSession(
        project, max_traces_per_step=cap, sampler=sampler, finish_timeout=300.0
    ) as session:
        session._precheck_cap = precheck
        await session.flush()  # the writer process is up before timing starts
        for c in range(0, len(samples), BATCH):
            t0 = time.perf_counter()
            await session.log_samples(samples[c : c + BATCH], step=c // per_step)
            spent += time.perf_counter() - t0
            await anyio.sleep(gap)
        run = session.run
    steps = len(samples) // per_step
    stats = session.stats()
    expected = steps * cap
    if stats.written != expected or stats.dropped != {"capped": len(samples) - expected}:
        variant = "check" if precheck else "encode"
        raise SystemExit(f"{sampler} round ({variant}) kept the wrong samples: {stats.summary()}")
    stored = common.count_trackio_traces(project, run)
    if stored != expected:
        raise SystemExit(f"stored {stored} traces, expected {expected}")
    return spent


def build(steps: int, per_step: int) -> list[Any]:
    """`steps` steps of `per_step` samples, rewards shuffled within each step."""
    bodies = common.sample_bodies(steps * per_step, common.SIZES["2.5KB"])
    rng = random.Random(0)
    for s in range(steps):
        rewards = [i / per_step for i in range(per_step)]
        rng.shuffle(rewards)
        for i, r in enumerate(rewards):
            bodies[s * per_step + i]["metadata"]["reward"] = r
    return common.to_samples(bodies)


async def main_async(args: argparse.Namespace) -> int:
    common.print_machine("start")
    samples = build(args.steps, args.per_step)
    n = len(samples)
    rows: list[list[str]] = []
    ratios: list[str] = []
    for sampler in args.samplers:
        per_sample: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            order = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
            for variant in order:
                spent = await session_round(
                    samples,
                    sampler=sampler,
                    precheck=variant == "check",
                    per_step=args.per_step,
                    cap=args.cap,
                    gap=args.gap,
                )
                per_sample[variant].append(spent / n * 1e6)
        for variant, label in VARIANTS.items():
            values = per_sample[variant]
            rows.append(
                [
                    sampler,
                    label,
                    f"{statistics.median(values):.2f}",
                    " / ".join(f"{v:.2f}" for v in values),
                ]
            )
        per_round = [e / c for c, e in zip(per_sample["check"], per_sample["encode"], strict=True)]
        ratios.append(
            f"ratio {sampler}: encode everything / cap checked first = "
            f"{common.fmt_ratio(statistics.median(per_round))} "
            f"(per round: {', '.join(common.fmt_ratio(x) for x in per_round)})"
        )
    print(
        f"time inside await session.log_samples(batch of {BATCH}) per sample submitted; "
        f"{args.per_step} samples (2.5 KB) per step, max_traces_per_step={args.cap}, "
        f"{args.steps} steps, {args.gap * 1e3:.0f} ms between calls; "
        f"{args.rounds} alternating rounds (median)"
    )
    common.print_table(["sampler", "variant", "us/sample", "rounds (us/sample)"], rows)
    print()
    for line in ratios:
        print(line)
    common.print_machine("end")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=25, help="steps per round")
    p.add_argument("--per-step", type=int, default=256, help="samples logged per step")
    p.add_argument("--cap", type=int, default=16, help="max_traces_per_step")
    p.add_argument("--gap", type=float, default=0.015, help="seconds yielded between calls")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per variant")
    p.add_argument("--samplers", nargs="+", default=["first", "top_bottom"], choices=["first", "top_bottom"])
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--verbose", action="store_true", help="show Trackio's and the writer's stderr")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.gap = 3, 1, 0.002
    if args.per_step % BATCH:
        p.error(f"--per-step must be a multiple of {BATCH}")
    return args


def main(argv: list[str] | None = None) -> int:
    return common.run_main(main_async, parse_args, argv)


if __name__ == "__main__":
    sys.exit(main())
