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
import shutil
import statistics
import time
import uuid
from typing import Any

import _common as common
import anyio

SETTINGS = {"console": "off", "x_disable_stats": True, "x_disable_meta": True, "silent": True}

atexit.register(shutil.rmtree, os.environ["WANDB_DIR"], ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=20, help="batches per variant")
    p.add_argument("--batch", type=int, default=32, help="records per batch")
    p.add_argument("--size", type=int, default=2048, help="bytes of one encoded sample")
    p.add_argument("--intervals", type=float, nargs="+", default=[0.05, 0.2, 1.0])
    p.add_argument("--quick", action="store_true", help="a smoke run: 4 batches, intervals 0.2 and 1")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.intervals = 4, [0.2, 1.0]
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
    common.print_machine("end")
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_main(main_async, parse_args))
