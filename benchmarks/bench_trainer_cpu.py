"""Trainer-process CPU per trace: ``TraceSession`` → Trackio vs calling Trackio directly.

The same traces (``--steps`` steps of ``--per-step`` 2.5 KB chat samples, 150 x 128 = 19,200 by
default) go into a fresh Trackio project under a temporary ``TRACKIO_DIR`` in three ways:

- "trackio direct", what an RL trainer does today: ``trackio.init(project=...)``, then per step
  ``trackio.log({"train/traces": [trackio.Trace(messages, metadata), ...]}, step=s)`` (the
  traces of a step as one list, Trackio's cheapest documented form), then ``trackio.finish()``.
  Trackio serialises on the calling thread and does its SQLite work on a thread of its own,
  inside the trainer's process.
- "asynctrace": ``TraceSession`` with the default ``TrackioSink`` (Trackio in a writer process),
  ``await session.log_samples([asynctrace.Sample(messages, metadata), ...], step=s)`` per step,
  then ``finish``. The writer commits through Trackio's storage class (the private path).
- "asynctrace, public path": the same, with the writer process's Trackio changed at start-up
  (a ``sitecustomize`` on its ``PYTHONPATH`` gives ``SQLiteStorage.bulk_log`` a signature the
  sink does not recognise, as a later release's might), so it writes through Trackio's public
  ``run.log`` and reads each batch back (docs/sinks/trackio.md, "How the sink writes to Trackio").
  Each session variant checks that it wrote the way it is named.

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

Variants take turns over ``--rounds`` rounds, each round starting with the next; the table
shows the median round, and each ratio is the median of per-round ratios.

    python benchmarks/bench_trainer_cpu.py
    python benchmarks/bench_trainer_cpu.py --quick
"""

from __future__ import annotations

import os
import tempfile

os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="asynctrace-bench-")

import argparse
import contextlib
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common as common
import anyio

GOAL = 25.0  # the trainer process must spend at least this many times less CPU than direct Trackio
AIM = 50.0
KEY = "train/traces"
VARIANTS = ("asynctrace", "public", "direct")
# The writer process's start-up hook for the public-path variant: Trackio's own `run.log` still
# calls `bulk_log` by name, so the commit keeps working; only the sink no longer recognises it.
CHANGED_BULK_LOG = """\
from trackio.sqlite_storage import SQLiteStorage

_bulk_log = SQLiteStorage.bulk_log
SQLiteStorage.bulk_log = staticmethod(lambda *args, **kwargs: _bulk_log(*args, **kwargs))
"""


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


@contextlib.contextmanager
def writer_path(public: bool) -> Iterator[None]:
    """Writer processes started inside write through Trackio's public API when `public`."""
    if not public:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="asynctrace-bench-site-") as site:
        Path(site, "sitecustomize.py").write_text(CHANGED_BULK_LOG)
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, before) if p)
        try:
            yield
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before


async def session_round(
    bodies: list[dict[str, Any]], steps: int, per_step: int, gap: float, public: bool
) -> Round:
    import asynctrace as at

    project = common.project_name("cpu")
    children0 = children_cpu_seconds()
    sink = at.TrackioSink()  # the default sink, made here to see how it wrote
    # The environment only matters when the writer process starts, as the session opens.
    with writer_path(public):
        async with at.TraceSession(project, sinks=[sink], finish_timeout=600.0) as session:
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
    expected = "public" if public else "private"
    _check(sink.trackio_path == expected, f"the sink wrote the {sink.trackio_path} way, not {expected}")
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


LABELS = {
    "asynctrace": "asynctrace: TraceSession + TrackioSink (private path)",
    "public": "asynctrace, public path: TrackioSink via run.log, read back",
    "direct": "trackio direct: trackio.log(list of traces)",
}


async def one_round(variant: str, bodies: list[dict[str, Any]], args: argparse.Namespace) -> Round:
    if variant == "direct":
        return await direct_round(bodies, args.steps, args.per_step, args.gap)
    return await session_round(bodies, args.steps, args.per_step, args.gap, public=variant == "public")


async def main_async(args: argparse.Namespace) -> int:
    common.print_machine("start")
    n = args.steps * args.per_step
    bodies = common.sample_bodies(n, common.SIZES[args.size])
    rounds: dict[str, list[Round]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        # Each round starts with the next variant, so none always runs first (or last).
        for variant in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
            rounds[variant].append(await one_round(variant, bodies, args))

    def med(variant: str, field: str) -> float:
        return statistics.median(getattr(x, field) for x in rounds[variant])

    print(
        f"trainer-process CPU, first step to finish returning: {args.steps} steps x {args.per_step} "
        f"{args.size} traces = {n}, gap {args.gap * 1000:g} ms, {args.rounds} rotating rounds; "
        f"medians of rounds (counts and write paths verified)"
    )

    def row(variant: str) -> list[str]:
        writer = med(variant, "writer")
        note = "no writer process" if variant == "direct" else _us(writer, n)
        return [
            LABELS[variant],
            f"{med(variant, 'trainer'):.3f}",
            _us(med(variant, "trainer"), n),
            f"{writer:.3f} ({note})",
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
        [row(v) for v in VARIANTS],
    )
    startup = med("asynctrace", "writer_startup")
    if startup == startup:  # not NaN
        print(f"(the writer process's start-up before the window, not counted above: {startup:.3f} s CPU)")
    else:
        print("(no /proc here: the writer process's CPU above includes its start-up)")
    print()
    met = True
    for variant in ("asynctrace", "public"):
        pairs = [d.trainer / a.trainer for a, d in zip(rounds[variant], rounds["direct"], strict=True)]
        total_pairs = [
            (d.trainer + d.writer) / (a.trainer + a.writer)
            for a, d in zip(rounds[variant], rounds["direct"], strict=True)
        ]
        ratio = statistics.median(pairs)
        met = met and ratio >= GOAL
        print(
            f"ratio trainer CPU, direct / {variant} = {common.fmt_ratio(ratio)} (per round: "
            f"{', '.join(common.fmt_ratio(x) for x in pairs)}; goal >= {GOAL:g}x: "
            f"{'met' if ratio >= GOAL else 'NOT met'}; aim {AIM:g}x: "
            f"{'reached' if ratio >= AIM else 'not reached'})"
        )
        print(
            f"ratio trainer + writer process CPU, direct / {variant} = "
            f"{common.fmt_ratio(statistics.median(total_pairs))} (per round: "
            f"{', '.join(common.fmt_ratio(x) for x in total_pairs)}; no goal)"
        )
    paths = [p.trainer / a.trainer for a, p in zip(rounds["asynctrace"], rounds["public"], strict=True)]
    walls = [p.wall / a.wall for a, p in zip(rounds["asynctrace"], rounds["public"], strict=True)]
    print(
        f"public / private path: trainer CPU {common.fmt_ratio(statistics.median(paths))}, wall "
        f"{common.fmt_ratio(statistics.median(walls))} (medians of per-round ratios; no goal)"
    )
    common.print_machine("end")
    return 0 if met or not args.strict else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="steps per round")
    p.add_argument("--per-step", type=int, default=128, help="traces logged per step")
    p.add_argument("--gap", type=float, default=0.02, help="seconds the caller sleeps between steps")
    p.add_argument("--size", default="2.5KB", choices=list(common.SIZES))
    p.add_argument("--rounds", type=int, default=3, help="rotating rounds per variant")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--verbose", action="store_true", help="show Trackio's and the writer's stderr")
    p.add_argument("--strict", action="store_true", help="exit 1 when a path misses the goal")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.per_step, args.rounds, args.gap = 10, 32, 1, 0.0
    return args


def main(argv: list[str] | None = None) -> int:
    return common.run_main(main_async, parse_args, argv)


if __name__ == "__main__":
    sys.exit(main())
