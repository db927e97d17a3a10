"""WandbSink: what a persisted acknowledgement costs, side by side with the hand-off it replaced.

A `WandbSink` write returns once the run's `.wandb` file holds the batch's rows; `run.log`
returns once it has handed them to the `wandb-core` service, which writes the file every
``x_transaction_log_flush_interval`` seconds (the sink's ``log_flush_interval``). Both variants
log the same batches of table rows to offline W&B runs (``WANDB_MODE=offline``, a temporary
directory, no network), in one process, alternating:

- ``hand-off``: ``run.log`` of an incremental table with the batch's rows, timed until it returns
  (what the sink used to count as written);
- ``ack <interval>``: ``await sink.write(batch)`` on a `WandbSink` with that
  ``log_flush_interval``, timed until it returns (the rows are then in the `.wandb` file).

Reported per variant: the median and 90th percentile seconds per batch; for each interval,
the latency its acknowledgement adds (median write minus median hand-off) and that over the
interval.

A second table runs a `WandbSink` attached to a trainer's run (``attach=run``), whose rows W&B
writes only when the trainer logs its next step: a simulated trainer logs a W&B step every
``--step-seconds`` and ``--per-step`` samples through a session, for ``--steps`` steps, then
one more W&B step and a flush. Variants: ``wait_for_log=False`` (counted written once handed
to wandb-core), ``wait_for_log=True`` (each write waits until its rows are in the `.wandb`
file) and the default (handed over at once, counted written once the file holds them). Every
50 ms it compares what the session counts written with the rows the `.wandb` file holds.
Reported: the most rows counted written but not in the file at any time, what was counted
written when the last training step ended, the seconds the final flush took, the median
`log_samples` time, and the longest a 1 ms ticker task on the event loop waited (the trainer's
own `run.log` calls go to a thread, so that the ticker sees the session's work only; objects
alive before are frozen out of the garbage collector, whose full passes would show instead).

    python benchmarks/bench_wandb_ack.py            # intervals 0.05, 0.2, 1.0; 20 batches each
    python benchmarks/bench_wandb_ack.py --quick    # smoke run
"""

from __future__ import annotations

import os
import tempfile

os.environ["WANDB_DIR"] = tempfile.mkdtemp(prefix="asynctrace-bench-wandb-")
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="asynctrace-bench-")

import argparse
import atexit
import gc
import math
import shutil
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import _common as common
import anyio

# The attached variants' final flush, after the trainer's one more step.
FLUSH_TIMEOUT = 30.0

SETTINGS = {"console": "off", "x_disable_stats": True, "x_disable_meta": True, "silent": True}

atexit.register(shutil.rmtree, os.environ["WANDB_DIR"], ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=20, help="batches per variant")
    p.add_argument("--batch", type=int, default=32, help="records per batch")
    p.add_argument("--size", type=int, default=2048, help="bytes of one encoded sample")
    p.add_argument("--intervals", type=float, nargs="+", default=[0.05, 0.2, 1.0])
    p.add_argument("--quick", action="store_true", help="a smoke run: 4 batches, intervals 0.2 and 1")
    p.add_argument("--steps", type=int, default=8, help="attached: the trainer's steps")
    p.add_argument("--per-step", type=int, default=128, help="attached: samples logged a step")
    p.add_argument("--step-seconds", type=float, default=0.5, help="attached: one training step")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.intervals, args.steps = 4, [0.2, 1.0], 3
    return args


def _records(bodies: list[dict[str, Any]], step: int) -> list[Any]:
    import orjson

    from asynctrace._records.types import TraceRecord

    tag = uuid.uuid4().hex[:8]
    return [
        TraceRecord(f"{tag}-{i}", step, "train", "train/traces", orjson.dumps(body), time.time())
        for i, body in enumerate(bodies)
    ]


async def hand_off(batches: list[list[Any]]) -> list[float]:
    import wandb

    from asynctrace.sinks._wandb import WANDB_COLUMNS, record_row

    run = await anyio.to_thread.run_sync(
        lambda: wandb.init(
            project="bench", name=f"bare-{uuid.uuid4().hex[:6]}", reinit="create_new", settings=SETTINGS
        )
    )
    table = wandb.Table(columns=list(WANDB_COLUMNS), log_mode="INCREMENTAL")
    times = []
    for step, batch in enumerate(batches):
        for r in batch:
            table.add_data(*record_row(r))
        t = time.perf_counter()
        run.log({"train/traces-incr": table, "asynctrace/step": step})
        times.append(time.perf_counter() - t)
    await anyio.to_thread.run_sync(run.finish)
    return times


async def acknowledged(batches: list[list[Any]], interval: float) -> list[float]:
    import asynctrace as at

    sink = at.WandbSink(init_kwargs={"settings": dict(SETTINGS)}, log_flush_interval=interval)
    sink.bind("bench", f"ack-{uuid.uuid4().hex[:6]}")
    await sink.open()
    times = []
    for batch in batches:
        t = time.perf_counter()
        await sink.write(batch)
        times.append(time.perf_counter() - t)
    await sink.close()
    return times


def _persisted_rows(tail: Any, files: Path, seen: dict[Path, int]) -> int:
    """Rows of the table increments the `.wandb` file holds: increments 0 .. n-1 of the table,
    n being the highest increment number its history holds + 1 (logs of one W&B step are merged
    into the last one, whose history record stands for the earlier ones too)."""
    import orjson

    tail.poll()
    total = 0
    for key, reached in tail.reached.items():
        folder, _, stem = f"media/table/{key}".rpartition("/")
        for path in (files / folder).glob(f"{stem}_*.table.json"):
            if int(path.name[len(stem) + 1 :].split("_")[0]) < reached:
                if path not in seen:
                    seen[path] = len(orjson.loads(path.read_bytes())["data"])
                total += seen[path]
    return total


async def attached(
    args: argparse.Namespace, bodies: list[dict[str, Any]], wait: bool | None
) -> dict[str, float]:
    """A trainer's run, a W&B step every `step_seconds`, `per_step` samples a step through a
    session with `WandbSink(attach=run, wait_for_log=wait)`."""
    import wandb

    import asynctrace as at
    from asynctrace.sinks._wandb_txlog import LogTail

    settings = {**SETTINGS, "x_transaction_log_flush_interval": 0.2}
    run = await anyio.to_thread.run_sync(
        lambda: wandb.init(project="bench", name=f"trainer-{uuid.uuid4().hex[:6]}", settings=settings)
    )
    tail, files = LogTail(Path(run.settings.sync_file)), Path(run.dir)
    seen: dict[Path, int] = {}
    sink = at.WandbSink(attach=run, wait_for_log=wait)
    peak = 0
    caller: list[float] = []
    worst = 0.0

    async def tick() -> None:
        nonlocal worst
        last = time.monotonic()
        while True:
            await anyio.sleep(0.001)
            now = time.monotonic()
            worst, last = max(worst, now - last), now

    session = at.TraceSession(
        "bench", run="attached", sinks=[sink], batch_size=64, flush_interval=0.05, health_metrics=False
    )
    gc.freeze()
    async with session, anyio.create_task_group() as ticker:
        ticker.start_soon(tick)
        for step in range(args.steps):
            await anyio.to_thread.run_sync(lambda s=step: run.log({"trainer/loss": 1.0 / (s + 1)}, step=s))
            rows = [
                {"prompt": "q", "response": b["messages"][-1]["content"], "reward": float(i)}
                for i, b in enumerate(bodies[: args.per_step])
            ]
            t = time.perf_counter()
            await session.log_samples(rows, step=step)
            caller.append(time.perf_counter() - t)
            end = time.monotonic() + args.step_seconds
            while time.monotonic() < end:
                await anyio.sleep(0.05)
                persisted = await anyio.to_thread.run_sync(_persisted_rows, tail, files, seen)
                peak = max(peak, session.stats().sinks["wandb"].written - persisted)
        at_end = session.stats().written / session.stats().submitted
        await anyio.to_thread.run_sync(lambda: run.log({"trainer/loss": 0.0}, step=args.steps))
        t = time.perf_counter()
        flushed = await session.flush(timeout=FLUSH_TIMEOUT)
        flush_s = time.perf_counter() - t if flushed else math.inf
        persisted = await anyio.to_thread.run_sync(_persisted_rows, tail, files, seen)
        peak = max(peak, session.stats().sinks["wandb"].written - persisted)
        ticker.cancel_scope.cancel()
    gc.unfreeze()
    await anyio.to_thread.run_sync(run.finish)
    return {
        "peak": peak,
        "at_end": at_end,
        "flush": flush_s,
        "caller": statistics.median(caller),
        "tick": worst,
    }


async def main_async(args: argparse.Namespace) -> int:
    common.print_machine("start")
    bodies = common.sample_bodies(args.batches * args.batch, args.size)
    batches = [_records(bodies[i : i + args.batch], i) for i in range(0, len(bodies), args.batch)]
    # Untimed: wandb's imports and its service's start are paid before timing.
    await hand_off(batches[:1])
    results: dict[str, list[float]] = {"hand-off": await hand_off(batches)}
    for interval in args.intervals:
        results[f"ack {interval:g}s"] = await acknowledged(batches, interval)
    base = statistics.median(results["hand-off"])
    rows = []
    for name, times in results.items():
        median = statistics.median(times)
        added = "" if name == "hand-off" else f"{median - base:.3f}"
        over = "" if name == "hand-off" else common.fmt_ratio((median - base) / float(name[4:-1]))
        rows.append([name, f"{median:.3f}", f"{common.percentile(times, 90):.3f}", added, over])
    print(f"{args.batches} batches of {args.batch} records of ~{args.size} B per variant")
    common.print_table(
        ["variant", "median s/batch", "p90 s/batch", "added s (median)", "added / interval"], rows
    )
    print(
        f"\nattached to the trainer's run: {args.steps} steps of {args.step_seconds:g}s, "
        f"{args.per_step} samples a step, batch_size 64"
    )
    rows = []
    for name, wait in (("wait_for_log=False", False), ("wait_for_log=True", True), ("default", None)):
        r = await attached(args, bodies, wait)
        rows.append(
            [
                name,
                f"{r['peak']:.0f}",
                f"{r['at_end']:.0%}",
                f"{r['flush']:.2f}" if math.isfinite(r["flush"]) else f"timed out ({FLUSH_TIMEOUT:g})",
                f"{r['caller'] * 1e3:.2f}",
                f"{r['tick'] * 1e3:.0f}",
            ]
        )
    common.print_table(
        [
            "variant",
            "peak rows written not in file",
            "written at last step's end",
            "final flush s",
            "log_samples ms",
            "worst loop tick ms",
        ],
        rows,
    )
    common.print_machine("end")
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_main(main_async, parse_args))
