"""WandbSink on a long training job's run: what attaching and each write cost as the run grows.

Both parts attach a `WandbSink` (``attach=run``, the default: rows confirmed from the run's
`.wandb` file) to a trainer's offline W&B run (``WANDB_MODE=offline``, a temporary directory,
no network):

- ``open``: the trainer's run is grown to each of ``--sizes`` megabytes of `.wandb` file (history
  records of 64 metrics, as a trainer logs them), then a sink is opened on it and closed again,
  ``--opens`` times: the median seconds `await sink.open()` took; one more open, traced by
  `tracemalloc`, gives the most memory Python allocated meanwhile.
- ``write``: ``--writes`` writes of ``--batch`` rows each, one table increment a write, the run's
  table folder gaining a file each: the median seconds of a write (rows handed to W&B) over the
  first and over the last ``--window`` writes.

Each part prints a table (run the one to compare first with ``--part``, for
`bench_revisions.py`, which reads the first table).

    python benchmarks/bench_wandb_open.py                 # sizes 1, 10, 50 MB; 2000 writes
    python benchmarks/bench_wandb_open.py --quick         # smoke run
    python benchmarks/bench_revisions.py --base ../before bench_wandb_open.py -- --part open
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
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import _common as common
import anyio

SETTINGS = {"console": "off", "x_disable_stats": True, "x_disable_meta": True, "silent": True}

atexit.register(shutil.rmtree, os.environ["WANDB_DIR"], ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["open", "write", "both"], default="both")
    p.add_argument("--sizes", type=float, nargs="+", default=[1.0, 10.0, 50.0], help="log MB")
    p.add_argument("--opens", type=int, default=3, help="opens per size")
    p.add_argument("--writes", type=int, default=2000)
    p.add_argument("--window", type=int, default=100, help="writes timed at the start and the end")
    p.add_argument("--batch", type=int, default=4, help="rows a write")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 and 4 MB, 300 writes")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.opens, args.writes, args.window = [1.0, 4.0], 2, 300, 50
    return args


async def trainer_run(name: str) -> Any:
    import wandb

    settings = wandb.Settings(**SETTINGS, x_transaction_log_flush_interval=0.05)  # type: ignore[arg-type]
    return await anyio.to_thread.run_sync(
        lambda: wandb.init(project="bench", name=name, reinit="create_new", settings=settings)
    )


def grow(run: Any, megabytes: float) -> float:
    """Log history records until the run's `.wandb` file holds `megabytes`; its size then."""
    log = Path(run.settings.sync_file)
    metrics = {f"trainer/m{i}": 0.0 for i in range(64)}
    n = 0
    while True:
        for _ in range(200):
            metrics["trainer/m0"] = float(n)
            n += 1
            run.log(metrics)
        size = log.stat().st_size / 1e6 if log.exists() else 0.0
        if size >= megabytes:
            time.sleep(0.2)  # a few flush intervals: what the trainer logged is in the file
            return log.stat().st_size / 1e6


async def opens(args: argparse.Namespace) -> list[list[str]]:
    import asynctrace as at

    run = await trainer_run(f"open-{uuid.uuid4().hex[:6]}")
    rows = []
    try:
        for megabytes in args.sizes:
            size = await anyio.to_thread.run_sync(grow, run, megabytes)
            times, peak = [], 0.0
            # The last open is traced (slower): its peak memory only, not its time.
            for i in range(args.opens + 1):
                sink = at.WandbSink(attach=run)
                traced = i == args.opens
                if traced:
                    tracemalloc.start()
                started = time.perf_counter()
                await sink.open()
                if traced:
                    peak = tracemalloc.get_traced_memory()[1] / 1e6
                    tracemalloc.stop()
                else:
                    times.append(time.perf_counter() - started)
                assert sink.degraded is None, sink.degraded
                await sink.close()
            median = statistics.median(times)
            rows.append([f"{megabytes:g} MB", f"{median:.4f}", f"{size:.1f}", f"{peak:.1f}"])
    finally:
        await anyio.to_thread.run_sync(run.finish)
    return rows


def _records(n: int, size: int, step: int) -> list[Any]:
    import orjson

    from asynctrace._records.types import TraceRecord

    tag = uuid.uuid4().hex[:8]
    bodies = common.sample_bodies(n, size)
    return [
        TraceRecord(f"{tag}-{i}", step, "train", "train/traces", orjson.dumps(body), time.time())
        for i, body in enumerate(bodies)
    ]


async def writes(args: argparse.Namespace) -> list[list[str]]:
    import asynctrace as at

    run = await trainer_run(f"write-{uuid.uuid4().hex[:6]}")
    sink = at.WandbSink(attach=run)
    times = []
    try:
        await sink.open()
        for i in range(args.writes):
            batch = _records(args.batch, 512, i)
            started = time.perf_counter()
            await sink.write(batch)
            times.append(time.perf_counter() - started)
        files = len(list(Path(run.dir).glob("media/table/train/traces-incr_*.table.json")))
        assert files == args.writes, files
    finally:
        await sink.close()
        await anyio.to_thread.run_sync(run.finish)
    first, last = times[: args.window], times[-args.window :]
    return [
        [f"writes 1-{args.window}", f"{statistics.median(first) * 1e3:.2f}"],
        [f"writes {args.writes - args.window + 1}-{args.writes}", f"{statistics.median(last) * 1e3:.2f}"],
        ["last / first", common.fmt_ratio(statistics.median(last) / statistics.median(first))],
    ]


async def main_async(args: argparse.Namespace) -> int:
    common.print_machine("start")
    # Untimed: wandb's imports and its service's start are paid before timing.
    warm = await trainer_run("warm-up")
    await anyio.to_thread.run_sync(warm.finish)
    if args.part in ("open", "both"):
        print(f"open: a sink attached to a run whose .wandb file is that long; {args.opens} opens each")
        common.print_table(["log", "median open s", "log MB", "peak traced MB"], await opens(args))
    if args.part in ("write", "both"):
        print(f"\nwrite: {args.writes} writes of {args.batch} rows, one table file each")
        common.print_table(["writes", "median ms/write"], await writes(args))
    common.print_machine("end")
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_main(main_async, parse_args))
