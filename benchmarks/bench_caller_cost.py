"""Caller cost per sample: ``await session.log_samples(batch of 32)`` vs Trackio's ``run.log``.

Both variants get the same 32-sample batches (``asynctrace.Sample`` for the session,
``trackio.Trace`` for Trackio), built in two ways, each measured: all before timing starts
(``--inputs ahead``: by the time a batch is logged, its data has long left the CPU caches),
or each from a fresh decode of its JSON right before its call, untimed (``--inputs fresh``:
as a trainer builds its samples from a rollout just before logging them). Only the time
spent inside the caller's call is summed (``time.perf_counter`` around each call); between
calls the caller yields to the event loop for ``--gap`` seconds, standing in for the
training step, so background work (the session's writer, Trackio's sender thread) runs as
it would in a trainer. The session has a queue large enough that ``on_full="block"`` never
waits, and the default ``TrackioSink`` (Trackio in a writer process). Variants alternate
over ``--rounds`` rounds; the median round is reported and the ratio is the median of
per-round ratios. Two "floor" variants (``--no-floors`` leaves them out) time only
``orjson.dumps`` of each sample's body, with and without the exact-size copy the session
keeps, paced the same way: the least any design that encodes in the caller must spend, so
run.log's cost over a floor's is the most such a design could reach in that run (the
``ceiling`` lines). Last (``--no-cold`` leaves it out), it times three calls with nothing
to do, a Python function that returns 0, taking and releasing a ``threading.Lock`` (the
buffer holds one for every admission) and ``log_samples([])``, paced the same way and back
to back: what running code cold after a training step costs on the machine. Before timing,
the script touches and frees ``--prefault-mb`` of memory, so that neither variant pays a
VM's first touch of guest memory (several times a normal page fault on the machine these
were written on).

    python benchmarks/bench_caller_cost.py            # default sizes
    python benchmarks/bench_caller_cost.py --quick    # smoke run
"""

from __future__ import annotations

import os
import tempfile

os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="asynctrace-bench-")

import argparse
import collections
import functools
import resource
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import _common as common
import anyio
import orjson

GOAL = 1.2  # the session may cost the caller at most this many times the check + encode + admit floor
BATCH = 32
LABELS = {
    "session": "await session.log_samples(32)",
    "trackio": "run.log({key: [Trace x32]})",
    "encode": "floor: orjson.dumps + copy x32",
    "dumps": "floor: orjson.dumps x32",
    "admit": "floor: check + encode + admit x32",
    "beside": "floor beside a session's writer",
}


def minor_faults() -> int:
    """Minor page faults of the calling thread so far (Linux; the process's elsewhere)."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


class Meter:
    """Wall and on-CPU seconds and the calling thread's minor page faults inside the calls it
    times (``with meter(timed): call``); untimed calls (the warm-up) are run but not counted."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.faults = 0
        self._timed = False
        self._start = (0.0, 0.0, 0)

    def __call__(self, timed: bool) -> Meter:
        self._timed = timed
        return self

    def __enter__(self) -> None:
        faults = minor_faults()  # its system call stays outside the timed span
        self._start = (time.perf_counter(), time.thread_time(), faults)

    def __exit__(self, *exc: object) -> None:
        wall, cpu, faults = time.perf_counter(), time.thread_time(), minor_faults()
        if self._timed:
            self.wall += wall - self._start[0]
            self.cpu += cpu - self._start[1]
            self.faults += faults - self._start[2]


def batches(
    bodies: list[dict[str, Any]], build: Callable[[list[dict[str, Any]]], list[Any]], fresh: bool
) -> Callable[[int], list[Any]]:
    """Call c's batch: built up front ("ahead"), or built from a fresh decode of the JSON right
    before the call ("fresh"), as a trainer builds its samples just before logging them."""
    if not fresh:
        built = build(bodies)
        return lambda c: built[c * BATCH : (c + 1) * BATCH]
    raw = [orjson.dumps(b) for b in bodies]
    return lambda c: build([orjson.loads(r) for r in raw[c * BATCH : (c + 1) * BATCH]])


def roomy_session(bodies: list[dict[str, Any]], project: str) -> Any:
    """A session whose queue holds every body, so ``on_full="block"`` never waits."""
    import asynctrace as at

    size = max(len(orjson.dumps(b)) for b in bodies[:64])
    return at.TraceSession(
        project,
        queue_size=len(bodies) + 1,
        max_queue_bytes=len(bodies) * (size + 1024) + 2**20,
        finish_timeout=300.0,
    )


async def session_round(
    bodies: list[dict[str, Any]], calls: int, warmup: int, gap: float, fresh: bool
) -> tuple[float, float, int, int]:
    """Wall and on-CPU seconds and minor page faults inside ``log_samples`` over `calls` timed
    calls, and the traces found in SQLite afterwards."""
    batch_for = batches(bodies, common.to_samples, fresh)
    project = common.project_name("caller")
    meter = Meter()
    async with roomy_session(bodies, project) as session:
        await session.flush()  # the writer process is up before timing starts
        for c in range(warmup + calls):
            batch = batch_for(c)
            with meter(c >= warmup):
                await session.log_samples(batch, step=c)
            await anyio.sleep(gap)
        run = session.run
    stats = session.stats()
    if stats.written != len(bodies) or stats.dropped:
        raise SystemExit(f"session round lost samples: {stats.summary()}")
    return meter.wall, meter.cpu, meter.faults, common.count_trackio_traces(project, run)


async def trackio_round(
    bodies: list[dict[str, Any]], calls: int, warmup: int, gap: float, fresh: bool
) -> tuple[float, float, int, int]:
    """Wall and on-CPU seconds and minor page faults inside ``run.log`` over `calls` timed calls,
    and the traces found in SQLite afterwards."""
    import trackio

    batch_for = batches(bodies, common.to_traces, fresh)
    project = common.project_name("caller-direct")
    with common.quiet():
        run = trackio.init(project, embed=False, auto_log_cpu=False, auto_log_gpu=False)
    meter = Meter()
    for c in range(warmup + calls):
        batch = batch_for(c)
        with meter(c >= warmup):
            run.log({"train/traces": batch}, step=c)
        await anyio.sleep(gap)
    with common.quiet():
        await anyio.to_thread.run_sync(run.finish)
    return meter.wall, meter.cpu, meter.faults, common.count_trackio_traces(project, run.name)


async def floor_round(
    bodies: list[dict[str, Any]], calls: int, warmup: int, gap: float, fresh: bool, *, copy: bool
) -> tuple[float, float, int, int]:
    """The least any encode in the caller costs: only ``orjson.dumps`` of each sample's body
    (and, with `copy`, the exact-size copy the session keeps so that what it holds is what its
    byte bound counts), paced like the other variants, with nothing running in the background.
    The encodings are kept until the next call, as a queue would keep them."""
    batch_for = batches(bodies, common.to_samples, fresh)
    meter = Meter()
    dumps = orjson.dumps
    kept: list[bytes] = []
    for c in range(warmup + calls):
        batch = batch_for(c)
        with meter(c >= warmup):
            if copy:  # each copy made at once, freeing orjson's buffer, as the session does
                kept = [
                    bytes(memoryview(dumps({"messages": s.messages, "metadata": s.metadata}))) for s in batch
                ]
            else:
                kept = [dumps({"messages": s.messages, "metadata": s.metadata}) for s in batch]
        await anyio.sleep(gap)
    del kept
    return meter.wall, meter.cpu, meter.faults, len(bodies)


async def admit_floor_round(
    bodies: list[dict[str, Any]], calls: int, warmup: int, gap: float, fresh: bool, *, beside: bool = False
) -> tuple[float, float, int, int]:
    """The least a caller meeting the design's other requirements costs: an ``async def`` call
    that checks each sample's messages (a bad one must raise in the caller, naming its field),
    encodes and copies it (the byte bound counts encoded bytes), and admits the call's payloads
    into a shared bounded queue under one lock (any thread may submit). No record objects, ids,
    caps or accounting beyond two counters; nothing running in the background.

    With `beside`, the same timed calls run beside a session that is given each batch too,
    right after the timed call and untimed: its writer thread and writer process then do
    during each gap what they do in the session's round, so the floor pays what that
    background work costs the caller's next call (caches, the GIL) and the session's code
    does not."""
    batch_for = batches(bodies, common.to_samples, fresh)
    meter = Meter()
    dumps = orjson.dumps
    lock = threading.Lock()
    queue: collections.deque[bytes] = collections.deque()
    held = [0, 0]  # records, bytes

    async def admit(batch: list[Any]) -> int:
        payloads = []
        for s in batch:
            for m in s.messages:
                if type(m) is not dict or type(m.get("role")) is not str:
                    raise ValueError("bad message")
                content = m.get("content")
                if content is not None and type(content) is not str and type(content) is not list:
                    raise ValueError("bad content")
            payloads.append(bytes(memoryview(dumps({"messages": s.messages, "metadata": s.metadata}))))
        total = sum([len(p) for p in payloads])
        with lock:
            queue.extend(payloads)
            held[0] += len(payloads)
            held[1] += total
        return len(payloads)

    async def run(session: Any) -> None:
        for c in range(warmup + calls):
            batch = batch_for(c)
            with meter(c >= warmup):
                await admit(batch)
            if session is not None:
                await session.log_samples(batch, step=c)
            await anyio.sleep(gap)
            queue.clear()  # a writer took them during the training step

    if not beside:
        await run(None)
        return meter.wall, meter.cpu, meter.faults, len(bodies)
    project = common.project_name("caller-beside")
    async with roomy_session(bodies, project) as session:
        await session.flush()
        await run(session)
    return meter.wall, meter.cpu, meter.faults, common.count_trackio_traces(project, session.run)


async def cold_calls(calls: int, gap: float) -> list[list[str]]:
    """Median microseconds per call of three calls with nothing to do, paced by `gap` and back to
    back: what running code cold after a training step costs here, before any sample."""
    import asynctrace as at

    def trivial() -> int:
        return 0

    lock = threading.Lock()

    def locked() -> None:
        with lock:
            pass

    medians: dict[str, list[str]] = {"trivial": [], "lock": [], "empty": []}
    async with at.TraceSession(common.project_name("cold"), finish_timeout=60.0) as session:
        await session.flush()
        step = 0
        for pace in (gap, 0.0):
            times: dict[str, list[float]] = {"trivial": [], "lock": [], "empty": []}
            for _ in range(calls):
                start = time.perf_counter()
                trivial()
                times["trivial"].append(time.perf_counter() - start)
                if pace:
                    await anyio.sleep(pace)
                start = time.perf_counter()
                locked()
                times["lock"].append(time.perf_counter() - start)
                if pace:
                    await anyio.sleep(pace)
                start = time.perf_counter()
                await session.log_samples([], step=step)
                times["empty"].append(time.perf_counter() - start)
                step += 1
                if pace:
                    await anyio.sleep(pace)
            for name, values in times.items():
                medians[name].append(f"{statistics.median(values) * 1e6:.1f}")
    return [
        ["a Python function that returns 0", *medians["trivial"]],
        ["with a threading.Lock, nothing inside", *medians["lock"]],
        ["await session.log_samples([])", *medians["empty"]],
    ]


ROUNDS: dict[str, Callable[..., Awaitable[tuple[float, float, int, int]]]] = {
    "session": session_round,
    "trackio": trackio_round,
    "encode": functools.partial(floor_round, copy=True),
    "dumps": functools.partial(floor_round, copy=False),
    "admit": admit_floor_round,
    "beside": functools.partial(admit_floor_round, beside=True),
}


async def main_async(args: argparse.Namespace) -> int:
    common.print_machine("start")
    common.prefault(args.prefault_mb)
    plan = {"2.5KB": (args.calls, args.gap), "32KB": (args.calls_32k, args.gap_32k)}
    rows: list[list[str]] = []
    ratios: list[tuple[str, float, list[float]]] = []
    floor_ratios: list[tuple[str, float, float, list[float], float]] = []
    ceilings: list[tuple[str, str, float]] = []
    variants = ("session", "trackio", *(("encode", "dumps", "admit", "beside") if args.floors else ()))
    for size_name in args.sizes:
        calls, gap = plan[size_name]
        n = (calls + args.warmup) * BATCH
        bodies = common.sample_bodies(n, common.SIZES[size_name])
        for inputs in args.inputs:
            fresh = inputs == "fresh"
            per_sample: dict[str, list[float]] = {v: [] for v in variants}
            cpu_per_sample: dict[str, list[float]] = {v: [] for v in variants}
            faults_per_sample: dict[str, list[float]] = {v: [] for v in variants}
            for r in range(args.rounds):
                order = variants if r % 2 == 0 else variants[::-1]
                for variant in order:
                    fn = ROUNDS[variant]
                    spent, cpu, faults, stored = await fn(bodies, calls, args.warmup, gap, fresh)
                    if stored != n:
                        raise SystemExit(f"{variant} round stored {stored} traces, expected {n}")
                    per_sample[variant].append(spent / (calls * BATCH) * 1e6)
                    cpu_per_sample[variant].append(cpu / (calls * BATCH) * 1e6)
                    faults_per_sample[variant].append(faults / (calls * BATCH))
            for variant in variants[1:]:
                if variant == "trackio":
                    continue
                # run.log's cost over a floor's: the most any design that encodes in the caller
                # could reach in this run (the floors run nothing else).
                per_round = [d / f for f, d in zip(per_sample[variant], per_sample["trackio"], strict=True)]
                ceilings.append((f"{size_name}, inputs {inputs}", variant, statistics.median(per_round)))
            round_ratios = [d / s for s, d in zip(per_sample["session"], per_sample["trackio"], strict=True)]
            ratios.append((f"{size_name}, inputs {inputs}", statistics.median(round_ratios), round_ratios))
            if args.floors:
                wall = [s / a for s, a in zip(per_sample["session"], per_sample["admit"], strict=True)]
                cpu = [s / a for s, a in zip(cpu_per_sample["session"], cpu_per_sample["admit"], strict=True)]
                near = [s / b for s, b in zip(per_sample["session"], per_sample["beside"], strict=True)]
                floor_ratios.append(
                    (
                        f"{size_name}, inputs {inputs}",
                        statistics.median(wall),
                        statistics.median(cpu),
                        wall,
                        statistics.median(near),
                    )
                )
            for variant in variants:
                label = LABELS[variant]
                values = per_sample[variant]
                rows.append(
                    [
                        size_name,
                        inputs,
                        label,
                        f"{statistics.median(values):.2f}",
                        " / ".join(f"{v:.2f}" for v in values),
                        f"{statistics.median(cpu_per_sample[variant]):.2f}",
                        f"{statistics.median(faults_per_sample[variant]):.2f}",
                        f"{calls * BATCH}",
                        f"{gap * 1e3:.0f}",
                    ]
                )
    print(
        f"caller cost per sample, batches of {BATCH}; time inside the call only; "
        f"{args.rounds} alternating rounds (median)"
    )
    common.print_table(
        [
            "sample",
            "inputs",
            "call",
            "us/sample",
            "rounds (us/sample)",
            "on-CPU us/sample",
            "page faults/sample",
            "samples timed/round",
            "gap ms",
        ],
        rows,
    )
    print("(us/sample: wall time inside the call, the goal's measure; on-CPU: the calling thread's CPU")
    print(" time inside the call, which leaves out time it was preempted or waiting for the GIL;")
    print(" page faults: minor faults of the calling thread inside the call (getrusage);")
    print(" inputs ahead: every batch built before timing starts; fresh: each batch built from a")
    print(" fresh decode of its JSON just before its call, untimed, as a trainer builds samples;")
    print(" floor: only orjson.dumps of each sample (with or without the exact-size copy the session")
    print(" keeps), nothing else running: the least an encode in the caller costs; check + encode +")
    print(" admit: an async call that also checks each sample's messages and admits the payloads into")
    print(" a locked, bounded queue: the least a caller meeting the design's requirements costs)")
    print()
    ok = True
    for size_name, wall, cpu, per_round, near in floor_ratios:
        met = wall <= GOAL
        ok &= met
        print(
            f"goal {size_name}: log_samples cost / check + encode + admit floor = {common.fmt_ratio(wall)} "
            f"wall, {common.fmt_ratio(cpu)} on-CPU (per round: "
            f"{', '.join(common.fmt_ratio(x) for x in per_round)}; "
            f"goal <= {GOAL}x: {'met' if met else 'NOT met'}); "
            f"vs the floor beside a session's writer: {common.fmt_ratio(near)}"
        )
    for size_name, ratio, round_ratios in ratios:
        print(
            f"ratio {size_name}: run.log cost / log_samples cost = {common.fmt_ratio(ratio)} "
            f"(per round: {', '.join(common.fmt_ratio(x) for x in round_ratios)})"
        )
    for name, variant, ceiling in ceilings:
        print(
            f"ceiling {name}: run.log cost / {LABELS[variant].removeprefix('floor: ')} cost = "
            f"{common.fmt_ratio(ceiling)} (the most a caller that "
            f"{'checks, encodes and admits' if variant == 'admit' else 'encodes'} could reach here)"
        )
    if args.cold:
        print()
        print(
            f"a call with nothing to do, {args.calls} calls each way (median us per call; "
            "the timer's own cost included)"
        )
        common.print_table(
            ["call", f"paced ({args.gap * 1e3:.0f} ms between calls)", "back to back"],
            await cold_calls(args.calls, args.gap),
        )
    common.print_machine("end")
    return 0 if ok or not args.strict else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200, help="timed calls per round, 2.5 KB samples")
    p.add_argument("--calls-32k", type=int, default=60, help="timed calls per round, 32 KB samples")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls at the start of each round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per variant")
    p.add_argument(
        "--gap",
        type=float,
        default=0.015,
        help="seconds the caller yields between 2.5 KB calls (the training step stand-in)",
    )
    p.add_argument("--gap-32k", type=float, default=0.05, help="the same for 32 KB calls")
    p.add_argument(
        "--prefault-mb",
        type=int,
        default=512,
        help="touch and free this much memory first (VM first-touch warm-up; 0 = off)",
    )
    p.add_argument(
        "--inputs",
        nargs="+",
        default=["ahead", "fresh"],
        choices=["ahead", "fresh"],
        help="build every batch before timing (ahead) and/or each just before its call (fresh)",
    )
    p.add_argument(
        "--floors",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the encode floors (orjson.dumps with and without the copy)",
    )
    p.add_argument(
        "--cold",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time calls with nothing to do, paced and back to back",
    )
    p.add_argument("--sizes", nargs="+", default=list(common.SIZES), choices=list(common.SIZES))
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--verbose", action="store_true", help="show Trackio's and the writer's stderr")
    p.add_argument("--strict", action="store_true", help="exit 1 when a goal is not met")
    args = p.parse_args(argv)
    if args.quick:
        args.calls, args.calls_32k, args.warmup, args.rounds, args.prefault_mb = 20, 8, 2, 1, 0
    return args


def main(argv: list[str] | None = None) -> int:
    return common.run_main(main_async, parse_args, argv)


if __name__ == "__main__":
    sys.exit(main())
