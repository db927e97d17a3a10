"""Which group sampler keeps the groups that carry signal in the tracker.

A GRPO step learns nothing from a prompt group whose samples all got the same reward (spread
0: every advantage is 0). This simulates a GRPO run and sends each step through the group
sampler (the selection a session or a ``Selected`` tier runs: ``new_step``, ``offer_all`` in
calls of whole groups, ``close``), for every policy and statistic, and counts how many of the
groups each keeps have a non-zero reward spread.

The run: ``--steps`` steps of ``--prompts`` prompts with ``--group`` samples each. A prompt's
chance of success is drawn per prompt from a mixture that drifts over the run as the policy
learns (a third of prompts are too hard, a third too easy at the start; the easy share grows),
which is where zero-spread groups come from. Two reward kinds:

- ``binary``: 1 if correct, else 0;
- ``graded``: the mean of four binary checks (partial credit: 0, 0.25, ..., 1), plus a
  format bonus of 0.1 that most samples get.

The cap is ``--cap`` samples a step (``count="samples"``; 16 with groups of 8: two groups).
Every policy sees the same rewards (one seed). Printed: per variant and reward kind, the
groups kept, the share with signal, and the ratio of that share to the share of all the
run's groups with signal (1.00x: no better than chance); the last lines give that share.

    python benchmarks/bench_group_signal.py
    python benchmarks/bench_group_signal.py --quick
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

VARIANTS: tuple[tuple[str, str], ...] = (
    ("top_bottom", "mean"),
    ("top_bottom", "spread"),
    ("top", "mean"),
    ("bottom", "mean"),
    ("top", "spread"),
    ("first", "mean"),
    ("random", "mean"),
)


def success_rate(rng: random.Random, progress: float) -> float:
    """A prompt's chance of success: too hard, in reach or too easy, the easy share growing."""
    easy = 0.3 + 0.3 * progress
    hard = 0.35 - 0.2 * progress
    u = rng.random()
    if u < hard:
        return rng.betavariate(1, 12)
    if u < hard + easy:
        return rng.betavariate(12, 1)
    return rng.betavariate(2, 2)


def reward(rng: random.Random, p: float, kind: str) -> float:
    if kind == "binary":
        return 1.0 if rng.random() < p else 0.0
    checks = sum(1 for _ in range(4) if rng.random() < p) / 4
    return checks + (0.1 if rng.random() < 0.9 else 0.0)


def make_run(steps: int, prompts: int, size: int, kind: str, seed: int) -> list[list[list[float]]]:
    """Rewards per step, per prompt group."""
    rng = random.Random(f"{seed}:{kind}")
    run = []
    for step in range(steps):
        progress = step / max(1, steps - 1)
        run.append([])
        for _ in range(prompts):
            p = success_rate(rng, progress)
            run[-1].append([reward(rng, p, kind) for _ in range(size)])
    return run


def select(
    run: Sequence[Sequence[Sequence[float]]], policy: str, stat: str, cap: int, call: int
) -> list[list[float]]:
    """The groups the group sampler keeps at each step; `call` groups a call."""
    from asynctrace import GroupSampler
    from asynctrace._select.base import Entry

    sampler = GroupSampler(policy, stat=stat)  # type: ignore[arg-type]
    kept: list[list[float]] = []
    for step, groups in enumerate(run):
        selection = sampler.new_step("train", step, cap)
        seq = 0
        for start in range(0, len(groups), call):
            entries = []
            for g in range(start, min(start + call, len(groups))):
                for r in groups[g]:
                    seq += 1
                    entries.append(Entry(r, seq, group=f"{step}:{g}"))
            selection.offer_all(entries)
        chosen, _ = selection.close()
        by_group: dict[Any, list[float]] = {}
        for e in chosen:
            by_group.setdefault(e.group, []).append(e.score or 0.0)
        kept.extend(by_group.values())
    return kept


def has_signal(rewards: Sequence[float]) -> bool:
    return max(rewards) != min(rewards)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--prompts", type=int, default=64, help="prompt groups per step")
    p.add_argument("--group", type=int, default=8, help="samples per group")
    p.add_argument("--cap", type=int, default=16, help="max_traces_per_step (samples)")
    p.add_argument("--call", type=int, default=4, help="groups per log_samples call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 20
    print(
        f"# {args.steps} steps x {args.prompts} groups of {args.group}, cap {args.cap} samples, "
        f"{args.call} groups a call, seed {args.seed}"
    )
    print()
    print("| rewards | policy | stat | groups kept | with signal | share | vs the run's share |")
    print("|---|---|---|---:|---:|---:|---:|")
    overall = {}
    t0 = time.perf_counter()
    for kind in ("binary", "graded"):
        run = make_run(args.steps, args.prompts, args.group, kind, args.seed)
        every = [g for step in run for g in step]
        overall[kind] = sum(map(has_signal, every)) / len(every)
        for policy, stat in VARIANTS:
            kept = select(run, policy, stat, args.cap, args.call)
            signal = sum(map(has_signal, kept))
            share = signal / len(kept) if kept else 0.0
            ratio = share / overall[kind]
            print(f"| {kind} | {policy} | {stat} | {len(kept)} | {signal} | {share:.1%} | {ratio:.2f}x |")
    print()
    for kind, share in overall.items():
        print(f"all groups with signal ({kind}): {share:.1%}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
