"""ParquetSink vs pyarrow writing the same rows: caller cost per sample and end-to-end throughput.

Caller cost: the time spent inside the caller's call per batch of 32 samples, summed
(``time.perf_counter`` around each call), with the caller yielding ``--gap`` seconds between
calls as a training step would. Session: ``await session.log_samples(batch)`` with only a
``ParquetSink``. Bare: the trainer writing the batch itself, in its loop: a pyarrow table of
the same rows (id, step, split, key, timestamp, messages and metadata as JSON, the typed
columns) written as a row group to an open zstd ``pyarrow.parquet.ParquetWriter``.

Throughput: first submit to the data being in closed Parquet files. Session: the same calls
with no gap, then ``finish()``. Bare: one table of all rows built and written with
``pq.write_table(..., compression="zstd")``, the least a Parquet archive costs. Row counts are
checked by reading the files back.

Variants alternate over ``--rounds`` rounds; the median round is reported, ratios are medians
of per-round ratios.

    python benchmarks/bench_parquet.py
    python benchmarks/bench_parquet.py --quick
"""

from __future__ import annotations

import os
import tempfile

os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="asynctrace-bench-")

import argparse
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import _common as common
import anyio
import orjson

BATCH = 32


def _bare_table(bodies: list[dict[str, Any]], prefix: str, start: int, step: int) -> Any:
    """The rows a ParquetSink writes, built directly from the caller's dicts."""
    import pyarrow as pa

    from asynctrace.sinks._parquet import schema

    n = len(bodies)
    metas = [b["metadata"] for b in bodies]
    empty_list = pa.array([None] * n, pa.list_(pa.int32()))
    columns = {
        "id": pa.array([f"{prefix}-{start + i}" for i in range(n)]),
        "step": pa.array([step] * n, pa.int64()),
        "split": pa.array(["train"] * n),
        "key": pa.array(["train/traces"] * n),
        "timestamp": pa.array([int(time.time() * 1e6)] * n, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        "messages": pa.array([orjson.dumps(b["messages"]).decode() for b in bodies]),
        "metadata": pa.array([orjson.dumps(m).decode() for m in metas]),
        "reward": pa.array([m.get("reward") for m in metas], pa.float64()),
        "advantage": pa.array([m.get("advantage") for m in metas], pa.float64()),
        "policy_version": pa.array([m.get("policy_version") for m in metas], pa.int64()),
        "stop_reason": pa.array([m.get("stop_reason") for m in metas], pa.string()),
        "score": pa.array([None] * n, pa.float64()),
        "spans": pa.array([None] * n, pa.string()),
    }
    target = schema()
    arrays = [columns[f.name] if f.name in columns else empty_list.cast(f.type) for f in target]
    return pa.Table.from_arrays(arrays, schema=target)


def _rows(directory: Path) -> int:
    import pyarrow.parquet as pq

    return int(pq.read_table(directory).num_rows)


async def session_cost(samples: list[Any], workdir: Path, gap: float) -> float:
    """Seconds inside `log_samples` per sample."""
    import asynctrace as at

    directory = workdir / f"s-{uuid.uuid4().hex[:8]}"
    spent = 0.0
    async with at.TraceSession(
        "bench", run="r", sinks=[at.ParquetSink(directory)], finish_timeout=600.0, queue_size=len(samples) + 1
    ) as session:
        await session.flush()
        for c in range(0, len(samples), BATCH):
            t0 = time.perf_counter()
            await session.log_samples(samples[c : c + BATCH], step=c // BATCH)
            spent += time.perf_counter() - t0
            await anyio.sleep(gap)
    _check(_rows(directory) == len(samples), "session rows")
    shutil.rmtree(directory)
    return spent / len(samples)


async def bare_cost(bodies: list[dict[str, Any]], workdir: Path, gap: float) -> float:
    """Seconds per sample of building each batch's table and writing it as a row group, in the caller."""
    import pyarrow.parquet as pq

    from asynctrace.sinks._parquet import schema

    directory = workdir / f"b-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    prefix = uuid.uuid4().hex[:12]
    spent = 0.0
    with pq.ParquetWriter(directory / "bare.parquet", schema(), compression="zstd") as writer:
        for c in range(0, len(bodies), BATCH):
            t0 = time.perf_counter()
            writer.write_table(_bare_table(bodies[c : c + BATCH], prefix, c, c // BATCH))
            spent += time.perf_counter() - t0
            await anyio.sleep(gap)
    _check(_rows(directory) == len(bodies), "bare rows")
    shutil.rmtree(directory)
    return spent / len(bodies)


async def session_throughput(samples: list[Any], workdir: Path) -> float:
    import asynctrace as at

    directory = workdir / f"s-{uuid.uuid4().hex[:8]}"
    async with at.TraceSession(
        "bench", run="r", sinks=[at.ParquetSink(directory)], finish_timeout=600.0
    ) as session:
        await session.flush()
        t0 = time.perf_counter()
        for c in range(0, len(samples), BATCH):
            await session.log_samples(samples[c : c + BATCH], step=c // BATCH)
        stats = await session.finish()
        elapsed = time.perf_counter() - t0
    _check(stats.written == len(samples) and stats.check(), stats.summary())
    _check(_rows(directory) == len(samples), "session rows")
    shutil.rmtree(directory)
    return len(samples) / elapsed


def bare_throughput(bodies: list[dict[str, Any]], workdir: Path) -> float:
    import pyarrow.parquet as pq

    directory = workdir / f"b-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    t0 = time.perf_counter()
    table = _bare_table(bodies, uuid.uuid4().hex[:12], 0, 0)
    with open(directory / "bare.parquet", "wb") as f:
        pq.write_table(table, f, compression="zstd")
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t0
    _check(_rows(directory) == len(bodies), "bare rows")
    shutil.rmtree(directory)
    return len(bodies) / elapsed


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"verification failed: {what}")


async def main_async(args: argparse.Namespace) -> int:
    import pyarrow

    common.print_machine("start")
    size = common.SIZES[args.size]
    bodies = common.sample_bodies(args.samples, size)
    samples = common.to_samples(bodies)
    workdir = Path(tempfile.mkdtemp(prefix="asynctrace-bench-parquet-"))
    costs: dict[str, list[float]] = {"session": [], "bare": []}
    rates: dict[str, list[float]] = {"session": [], "bare": []}
    try:
        for _ in range(args.rounds):
            costs["session"].append(await session_cost(samples, workdir, args.gap))
            costs["bare"].append(await bare_cost(bodies, workdir, args.gap))
            rates["session"].append(await session_throughput(samples, workdir))
            rates["bare"].append(bare_throughput(bodies, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    common.print_machine("end")
    print(
        f"pyarrow {pyarrow.__version__}; {args.samples} samples of {args.size}, batches of {BATCH}, "
        f"{args.rounds} alternating rounds (median round)"
    )
    common.print_table(
        ["variant", "caller us/sample", "samples/s end to end"],
        [
            [
                "TraceSession + ParquetSink",
                f"{statistics.median(costs['session']) * 1e6:.1f}",
                f"{statistics.median(rates['session']):.0f}",
            ],
            [
                "pyarrow directly (same rows)",
                f"{statistics.median(costs['bare']) * 1e6:.1f}",
                f"{statistics.median(rates['bare']):.0f}",
            ],
        ],
    )
    cost_ratio = statistics.median(b / s for s, b in zip(costs["session"], costs["bare"], strict=True))
    rate_ratio = statistics.median(s / b for s, b in zip(rates["session"], rates["bare"], strict=True))
    print(
        f"caller cost: pyarrow in the loop / session = {common.fmt_ratio(cost_ratio)} "
        "(above 1: the session costs the caller less)"
    )
    print(f"throughput: session / bare pyarrow = {common.fmt_ratio(rate_ratio)}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--size", choices=sorted(common.SIZES), default="2.5KB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap", type=float, default=0.002, help="seconds the caller yields between calls")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1024 samples, 1 round")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.rounds = 1024, 1
    return args


if __name__ == "__main__":
    sys.exit(common.run_main(main_async, parse_args))
