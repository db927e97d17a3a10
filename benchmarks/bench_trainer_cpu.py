"""Trainer-process CPU per trace: ``TraceSession`` → Trackio vs calling Trackio directly.

The same traces (``--steps`` steps of ``--per-step`` 2.5 KB chat samples, 150 x 128 = 19,200 by
default) go into a fresh Trackio project under a temporary ``TRACKIO_DIR`` in two ways:

- "trackio direct", what an RL trainer does today: ``trackio.init(project=...)``, then per step
  ``trackio.log({"train/traces": [trackio.Trace(messages, metadata), ...]}, step=s)`` (the
  traces of a step as one list, Trackio's cheapest documented form), then ``trackio.finish()``.
  Trackio serialises on the calling thread and does its SQLite work on a thread of its own,
  inside the trainer's process.
- "asynctrace": ``TraceSession`` with the default ``TrackioSink`` (Trackio in a writer process),
  ``await session.log_samples([asynctrace.Sample(messages, metadata), ...], step=s)`` per step,
  then ``finish``.

Both open the run with ``embed=False, auto_log_cpu=False, auto_log_gpu=False`` (no dashboard, no
system-metrics thread: the session's writer opens its run so). Each step's objects are built
from the step's dicts inside the measured window, as a trainer builds them after its rollout;
between steps the caller sleeps ``--gap`` seconds on the event loop, standing in for the
training step. The trainer's CPU is ``time.process_time()`` (every thread of this process) from
just before the first step's objects are built until ``finish`` has returned; opening the run
(``trackio.init``, the session start and its writer process's start-up) is outside the window.
The writer process's CPU is reported separately: its total from ``RUSAGE_CHILDREN`` once it
has exited and been waited for, less what it had used by the start of the window (read from
``/proc``; where there is no ``/proc`` its start-up is included and the script says so). The
same child-CPU delta is taken around the direct variant (Trackio starts no process there: 0).
Every trace is counted in Trackio's ``traces`` table afterwards, in both variants.

Variants alternate over ``--rounds`` rounds; the table shows the median round, and each ratio
is the median of per-round ratios.

    python benchmarks/bench_trainer_cpu.py
    python benchmarks/bench_trainer_cpu.py --quick
"""

from __future__ import annotations

import os
import tempfile

os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="asynctrace-bench-")

import argparse
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common as common
import anyio

GOAL = 25.0  # the trainer process must spend at least this many times less CPU than direct Trackio
AIM = 50.0
KEY = "train/traces"


@dataclass
class Round:
    """One variant's round: CPU seconds of this process and of its child processes in the window,
    the child's start-up CPU (before the window) and the wall seconds of the window."""

    trainer: float
    writer: float
    writer_startup: float
    wall: float


def children_cpu_seconds() -> float:
    """CPU seconds of this process's children that have exited and been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def live_children_cpu() -> float | None:
    """CPU seconds used so far by this process's live children (Linux ``/proc``); None without it."""
    tasks = Path(f"/proc/{os.getpid()}/task")
    if not tasks.is_dir():
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for task in tasks.iterdir():
        try:
            pids = (task / "children").read_text().split()
        except OSError:
            return None
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue  # exited meanwhile
            # The fields after the command name (which may hold spaces) end it in ")".
            fields = stat.rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def step_bodies(bodies: list[dict[str, Any]], step: int, per_step: int) -> list[dict[str, Any]]:
    return bodies[step * per_step : (step + 1) * per_step]


async def session_round(bodies: list[dict[str, Any]], steps: int, per_step: int, gap: float) -> Round:
    import asynctrace as at

    project = common.project_name("cpu")
    children0 = children_cpu_seconds()
    async with at.TraceSession(project, finish_timeout=600.0) as session:
        await session.flush()  # writer process up and the run open: outside the window
        startup = live_children_cpu()
        t0, c0 = time.perf_counter(), time.process_time()
        for s in range(steps):
            batch = [
                at.Sample(messages=b["messages"], metadata=b["metadata"])
                for b in step_bodies(bodies, s, per_step)
            ]
            await session.log_samples(batch, step=s)
            await anyio.sleep(gap)
        stats = await session.finish()
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    writer_total = children_cpu_seconds() - children0
    n = steps * per_step
    _check(stats.written == n and stats.check(), f"session: {stats.summary()}")
    stored = common.count_trackio_traces(project, session.run)
    _check(stored == n, f"session stored {stored} traces, expected {n}")
    _check(writer_total > 0, "the writer process was not waited for: its CPU time is unknown")
    if startup is None:
        return Round(cpu, writer_total, float("nan"), wall)
    return Round(cpu, writer_total - startup, startup, wall)


async def direct_round(bodies: list[dict[str, Any]], steps: int, per_step: int, gap: float) -> Round:
    import trackio

    project = common.project_name("cpu-direct")
    children0 = children_cpu_seconds()
    with common.quiet():
        run = trackio.init(project=project, embed=False, auto_log_cpu=False, auto_log_gpu=False)
        t0, c0 = time.perf_counter(), time.process_time()
        for s in range(steps):
            traces = [trackio.Trace(b["messages"], b["metadata"]) for b in step_bodies(bodies, s, per_step)]
            trackio.log({KEY: traces}, step=s)
            await anyio.sleep(gap)
        trackio.finish()
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    n = steps * per_step
    stored = common.count_trackio_traces(project, run.name)
    _check(stored == n, f"direct Trackio stored {stored} traces, expected {n}")
    return Round(cpu, children_cpu_seconds() - children0, 0.0, wall)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise SystemExit(f"verification failed: {message}")


def _us(seconds: float, n: int) -> str:
    return f"{seconds / n * 1e6:,.1f}"


async def main_async(args: argparse.Namespace) -> int:
    common.print_machine("start")
    n = args.steps * args.per_step
    bodies = common.sample_bodies(n, common.SIZES[args.size])
    rounds: dict[str, list[Round]] = {"asynctrace": [], "direct": []}
    for r in range(args.rounds):
        for variant in ("asynctrace", "direct") if r % 2 == 0 else ("direct", "asynctrace"):
            if variant == "asynctrace":
                rounds[variant].append(await session_round(bodies, args.steps, args.per_step, args.gap))
            else:
                rounds[variant].append(await direct_round(bodies, args.steps, args.per_step, args.gap))

    def med(variant: str, field: str) -> float:
        return statistics.median(getattr(x, field) for x in rounds[variant])

    print(
        f"trainer-process CPU, first step to finish returning: {args.steps} steps x {args.per_step} "
        f"{args.size} traces = {n}, gap {args.gap * 1000:g} ms, {args.rounds} alternating rounds; "
        f"medians of rounds (counts verified)"
    )

    def row(variant: str, label: str, writer_note: str | None) -> list[str]:
        writer = med(variant, "writer")
        return [
            label,
            f"{med(variant, 'trainer'):.3f}",
            _us(med(variant, "trainer"), n),
            f"{writer:.3f} ({writer_note or _us(writer, n)})",
            _us(statistics.median(x.trainer + x.writer for x in rounds[variant]), n),
            f"{med(variant, 'wall'):.2f}",
            " / ".join(f"{x.trainer:.3f}" for x in rounds[variant]),
        ]

    common.print_table(
        [
            "variant",
            "trainer CPU s",
            "trainer CPU us/trace",
            "writer process CPU s (us/trace)",
            "trainer + writer us/trace",
            "wall s",
            "trainer CPU s per round",
        ],
        [
            row("asynctrace", "asynctrace: TraceSession + TrackioSink", None),
            row("direct", "trackio direct: trackio.log(list of traces)", "no writer process"),
        ],
    )
    startup = med("asynctrace", "writer_startup")
    if startup == startup:  # not NaN
        print(f"(the writer process's start-up before the window, not counted above: {startup:.3f} s CPU)")
    else:
        print("(no /proc here: the writer process's CPU above includes its start-up)")
    print()
    pairs = [d.trainer / a.trainer for a, d in zip(rounds["asynctrace"], rounds["direct"], strict=True)]
    total_pairs = [
        (d.trainer + d.writer) / (a.trainer + a.writer)
        for a, d in zip(rounds["asynctrace"], rounds["direct"], strict=True)
    ]
    ratio = statistics.median(pairs)
    met = ratio >= GOAL
    print(
        f"ratio trainer CPU, direct / asynctrace = {common.fmt_ratio(ratio)} (per round: "
        f"{', '.join(common.fmt_ratio(x) for x in pairs)}; goal >= {GOAL:g}x: "
        f"{'met' if met else 'NOT met'}; aim {AIM:g}x: {'reached' if ratio >= AIM else 'not reached'})"
    )
    print(
        f"ratio trainer + writer process CPU, direct / asynctrace = "
        f"{common.fmt_ratio(statistics.median(total_pairs))} (per round: "
        f"{', '.join(common.fmt_ratio(x) for x in total_pairs)}; no goal)"
    )
    common.print_machine("end")
    return 0 if met or not args.strict else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="steps per round")
    p.add_argument("--per-step", type=int, default=128, help="traces logged per step")
    p.add_argument("--gap", type=float, default=0.02, help="seconds the caller sleeps between steps")
    p.add_argument("--size", default="2.5KB", choices=list(common.SIZES))
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per variant")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--verbose", action="store_true", help="show Trackio's and the writer's stderr")
    p.add_argument("--strict", action="store_true", help="exit 1 when the goal is not met")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.per_step, args.rounds, args.gap = 10, 32, 1, 0.0
    return args


def main(argv: list[str] | None = None) -> int:
    return common.run_main(main_async, parse_args, argv)


if __name__ == "__main__":
    sys.exit(main())
