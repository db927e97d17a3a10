"""End-to-end throughput, first submit to ``finish`` returning.

Trackio: ``TraceSession`` with the default ``TrackioSink`` (writer process) vs direct batched
Trackio (``run.log`` with lists of 32 ``trackio.Trace``, then ``run.finish()``). Opening the
session / ``trackio.init`` is outside the timed window; the data being in SQLite is inside
it. Counts are verified with a COUNT query on Trackio's ``traces`` table.

JSONL: ``TraceSession`` with only a ``JsonlSink`` vs a bare loop that orjson-encodes each
record dict (the same fields ``JsonlSink`` writes) and appends it to a buffered file. Counts
are verified by counting lines.

Variants alternate over ``--rounds`` rounds; the median round is reported.

    python benchmarks/bench_throughput.py
    python benchmarks/bench_throughput.py --quick
"""

from __future__ import annotations

import os
import tempfile

os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="asynctrace-bench-")

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as common
import orjson

GOAL_TRACKIO = 0.9
GOAL_JSONL = 0.5
BATCH = 32
Results = list[tuple[str, float, list[float], float]]  # name, median ratio, per round, goal


async def session_trackio(samples: list[Any]) -> float:
    import asynctrace as at

    project = common.project_name("tput")
    async with at.TraceSession(project, finish_timeout=600.0) as session:
        await session.flush()  # writer process up and the run open: not part of the window
        t0 = time.perf_counter()
        for c in range(0, len(samples), BATCH):
            await session.log_samples(samples[c : c + BATCH], step=c // BATCH)
        stats = await session.finish()
        elapsed = time.perf_counter() - t0
    _check(stats.written == len(samples) and stats.check(), f"session: {stats.summary()}")
    stored = common.count_trackio_traces(project, session.run)
    _check(stored == len(samples), f"session stored {stored} traces, expected {len(samples)}")
    return elapsed


def direct_trackio(traces: list[Any]) -> float:
    import trackio

    project = common.project_name("tput-direct")
    with common.quiet():
        run = trackio.init(project, embed=False, auto_log_cpu=False, auto_log_gpu=False)
        t0 = time.perf_counter()
        for c in range(0, len(traces), BATCH):
            run.log({"train/traces": traces[c : c + BATCH]}, step=c // BATCH)
        run.finish()
        elapsed = time.perf_counter() - t0
    stored = common.count_trackio_traces(project, run.name)
    _check(stored == len(traces), f"direct Trackio stored {stored} traces, expected {len(traces)}")
    return elapsed


def jsonl_sinks() -> dict[str, tuple[Callable[[Path], Any], dict[str, Any]]]:
    """The session's sink (and session options) for the JSONL rounds, and (--diagnose)
    stand-ins that show where the time goes: a sink that does nothing, one that only hands each
    batch to a worker thread and back (no file), JsonlSink's own lines written on the event loop,
    which the library never does (a file write can block) and which is here for reference only,
    and JsonlSink with batches four times as large."""
    import anyio

    import asynctrace as at

    class NothingSink(at.Sink):
        name = "nothing"

        async def write(self, records: Any) -> None:
            pass

    class ThreadHopSink(at.Sink):
        name = "thread-hop"

        async def write(self, records: Any) -> None:
            await anyio.to_thread.run_sync(lambda: None)

    class OnLoopJsonlSink(at.JsonlSink):
        async def write(self, records: Any) -> None:
            self._write_lines(self._lines(records), 3)

    return {
        "TraceSession + JsonlSink": (at.JsonlSink, {}),
        "(diagnose) session + sink doing nothing": (lambda path: NothingSink(), {}),
        "(diagnose) session + empty thread hop per batch": (lambda path: ThreadHopSink(), {}),
        "(diagnose) session + JsonlSink lines written on the loop": (OnLoopJsonlSink, {}),
        "(diagnose) session + JsonlSink, batch_size=1024": (at.JsonlSink, {"batch_size": 1024}),
    }


async def session_jsonl(
    samples: list[Any], workdir: Path, make_sink: Callable[[Path], Any], options: dict[str, Any]
) -> tuple[float, float]:
    """Seconds from the first submit to `finish` returning, and the event loop's thread's CPU
    seconds in that window."""
    import asynctrace as at

    path = workdir / f"session-{uuid.uuid4().hex[:8]}.jsonl"
    async with at.TraceSession(
        common.project_name("jsonl"), sinks=[make_sink(path)], finish_timeout=600.0, **options
    ) as session:
        await session.flush()
        t0 = time.perf_counter()
        c0 = time.thread_time()
        for c in range(0, len(samples), BATCH):
            await session.log_samples(samples[c : c + BATCH], step=c // BATCH)
        stats = await session.finish()
        elapsed = time.perf_counter() - t0
        cpu = time.thread_time() - c0
    _check(stats.written == len(samples) and stats.check(), f"session: {stats.summary()}")
    if path.exists() or isinstance(make_sink, type):
        lines = common.count_jsonl_lines(path)
        _check(lines == len(samples), f"session JSONL has {lines} lines, expected {len(samples)}")
        path.unlink()
    return elapsed, cpu


def bare_jsonl(bodies: list[dict[str, Any]], workdir: Path) -> tuple[float, float]:
    """The floor: encode each record dict with orjson and append it to a buffered file
    (seconds, and CPU seconds of this thread)."""
    path = workdir / f"bare-{uuid.uuid4().hex[:8]}.jsonl"
    prefix = uuid.uuid4().hex[:12]
    t0 = time.perf_counter()
    c0 = time.thread_time()
    with open(path, "ab") as f:
        for i, body in enumerate(bodies):
            record = {
                "id": f"{prefix}-{i}",
                "step": i // BATCH,
                "split": "train",
                "key": "train/traces",
                "timestamp": time.time(),
                "sample": body,
            }
            f.write(orjson.dumps(record) + b"\n")
    elapsed = time.perf_counter() - t0
    cpu = time.thread_time() - c0
    lines = common.count_jsonl_lines(path)
    _check(lines == len(bodies), f"bare JSONL has {lines} lines, expected {len(bodies)}")
    path.unlink()
    return elapsed, cpu


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise SystemExit(f"verification failed: {message}")


async def main_async(args: argparse.Namespace) -> int:
    common.print_machine("start")
    size = common.SIZES[args.size]
    rows: list[list[str]] = []
    results: Results = []

    if "trackio" in args.sinks:
        await trackio_part(args, size, rows, results)
    if "jsonl" in args.sinks:
        await jsonl_part(args, size, rows, results)
    print(
        f"end-to-end throughput, {args.size} samples, batches of {BATCH}, {args.rounds} alternating "
        f"rounds; samples/s is the median round; ratios are the median of per-round ratios "
        f"(counts verified)"
    )
    if "jsonl" in args.sinks:
        print(
            "(loop CPU: CPU time of the event loop's thread, which also runs the caller, over the "
            "timed window, per sample; median round)"
        )
    common.print_table(
        ["sink", "variant", "samples", "samples/s (median)", "rounds (samples/s)", "loop CPU us/sample"], rows
    )
    print()
    ok = True
    for name, ratio, pairs, goal in results:
        met = ratio >= goal
        ok &= met
        print(
            f"ratio {name} = {ratio:.3f}x (per round: {', '.join(f'{x:.2f}x' for x in pairs)}; "
            f"goal >= {goal}x: {'met' if met else 'NOT met'})"
        )
    common.print_machine("end")
    return 0 if ok or not args.strict else 1


async def trackio_part(args: argparse.Namespace, size: int, rows: list[list[str]], results: Results) -> None:
    bodies = common.sample_bodies(args.trackio_samples, size)
    samples = common.to_samples(bodies)
    traces = common.to_traces(bodies)
    times: dict[str, list[float]] = {"session": [], "direct": []}
    for r in range(args.rounds):
        for variant in ("session", "direct") if r % 2 == 0 else ("direct", "session"):
            if variant == "session":
                times[variant].append(await session_trackio(samples))
            else:
                times[variant].append(direct_trackio(traces))
    n = len(samples)
    s_rate = n / statistics.median(times["session"])
    d_rate = n / statistics.median(times["direct"])
    pairs = [d / s for s, d in zip(times["session"], times["direct"], strict=True)]
    rows.append(
        [
            "Trackio",
            "TraceSession + TrackioSink",
            f"{n}",
            f"{s_rate:,.0f}",
            " / ".join(f"{n / t:,.0f}" for t in times["session"]),
            "",
        ]
    )
    rows.append(
        [
            "Trackio",
            "direct run.log(lists of 32) + finish",
            f"{n}",
            f"{d_rate:,.0f}",
            " / ".join(f"{n / t:,.0f}" for t in times["direct"]),
            "",
        ]
    )
    results.append(
        ("Trackio: session / direct batched Trackio", statistics.median(pairs), pairs, GOAL_TRACKIO)
    )


async def jsonl_part(args: argparse.Namespace, size: int, rows: list[list[str]], results: Results) -> None:
    sinks = jsonl_sinks()
    if not args.diagnose:
        sinks = dict(list(sinks.items())[:1])
    workdir = Path(tempfile.mkdtemp(prefix="asynctrace-bench-jsonl-"))
    times: dict[str, list[float]] = {name: [] for name in [*sinks, "bare"]}
    cpus: dict[str, list[float]] = {name: [] for name in [*sinks, "bare"]}
    try:
        bodies = common.sample_bodies(args.jsonl_samples, size)
        samples = common.to_samples(bodies)
        for r in range(args.rounds):
            order = [*sinks, "bare"] if r % 2 == 0 else ["bare", *sinks]
            for variant in order:
                if variant == "bare":
                    elapsed, cpu = bare_jsonl(bodies, workdir)
                else:
                    make_sink, options = sinks[variant]
                    elapsed, cpu = await session_jsonl(samples, workdir, make_sink, options)
                times[variant].append(elapsed)
                cpus[variant].append(cpu)
    finally:
        for p in workdir.glob("*"):
            p.unlink()
        workdir.rmdir()
    n = len(samples)
    for variant, label in [*((name, name) for name in sinks), ("bare", "bare orjson + buffered append")]:
        rows.append(
            [
                "JSONL",
                label,
                f"{n}",
                f"{n / statistics.median(times[variant]):,.0f}",
                " / ".join(f"{n / t:,.0f}" for t in times[variant]),
                f"{statistics.median(cpus[variant]) / n * 1e6:.2f}",
            ]
        )
    for variant in sinks:
        pairs = [b / s for s, b in zip(times[variant], times["bare"], strict=True)]
        if variant.startswith("(diagnose)"):
            print(f"{variant} / bare loop = {statistics.median(pairs):.3f}x (for reference, no goal)")
        else:
            results.append(
                ("JSONL: session / bare orjson-and-write loop", statistics.median(pairs), pairs, GOAL_JSONL)
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trackio-samples", type=int, default=20_000, help="samples per Trackio round")
    p.add_argument("--jsonl-samples", type=int, default=100_000, help="samples per JSONL round")
    p.add_argument(
        "--sinks", nargs="+", default=["trackio", "jsonl"], choices=["trackio", "jsonl"], help="parts to run"
    )
    p.add_argument(
        "--diagnose",
        action="store_true",
        help="JSONL: also run stand-in sinks that show where the session's time goes",
    )
    p.add_argument("--size", default="2.5KB", choices=list(common.SIZES))
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per variant")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--verbose", action="store_true", help="show Trackio's and the writer's stderr")
    p.add_argument("--strict", action="store_true", help="exit 1 when a goal is not met")
    args = p.parse_args(argv)
    if args.quick:
        args.trackio_samples, args.jsonl_samples, args.rounds = 640, 3_200, 1
    return args


def main(argv: list[str] | None = None) -> int:
    return common.run_main(main_async, parse_args, argv)


if __name__ == "__main__":
    sys.exit(main())
