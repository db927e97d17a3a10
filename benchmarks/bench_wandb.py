"""WandbSink against W&B's own call: caller cost per sample and end-to-end throughput, side by side.

Both variants log the same samples, in batches of 32, to an offline W&B run (``WANDB_MODE=offline``
in a temporary directory: no network) with the same table rows (the sink's columns):

- ``bare``: the caller builds each batch's rows, adds them to an incremental ``wandb.Table``
  and calls ``run.log({key: table, "asynctrace/step": step})`` itself, on the event loop, as a
  trainer logging to W&B directly does; a final immutable table and ``run.finish()`` at the end.
- ``session``: ``await session.log_samples(batch)`` with a `WandbSink` (its wandb calls run in
  a thread), then ``session.finish()``.

Caller cost: the time spent inside the caller's call, summed, per sample (between calls the
caller yields for ``--gap`` seconds, standing in for the training step); ``finish`` is reported
apart. End to end: from opening the run until it is finished with every row on disk, in samples
per second. Variants
alternate over ``--rounds`` rounds; the median round is reported, the ratio is the median of
per-round ratios.

    python benchmarks/bench_wandb.py            # default sizes
    python benchmarks/bench_wandb.py --quick    # smoke run
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
import orjson

BATCH = 32
SETTINGS = {"console": "off", "x_disable_stats": True, "x_disable_meta": True, "silent": True}

atexit.register(shutil.rmtree, os.environ["WANDB_DIR"], ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2048, help="samples per variant and round")
    p.add_argument("--size", type=int, default=2048, help="bytes of one encoded sample")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gap", type=float, default=0.005, help="seconds the caller yields between calls")
    p.add_argument("--quick", action="store_true", help="a smoke run: few samples, one round")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.samples, args.rounds = 256, 1
    return args


def _bare_rows(bodies: list[dict[str, Any]], step: int, first: int) -> list[list[Any]]:
    from asynctrace.sinks._wandb import render_conversation

    rows = []
    for i, body in enumerate(bodies):
        meta = dict(body["metadata"])
        rows.append(
            [
                f"bare-{first + i}",
                step,
                "train",
                "train/traces",
                time.time(),
                render_conversation(body["messages"]),
                meta.pop("reward"),
                meta.pop("advantage"),
                meta.pop("policy_version"),
                meta.pop("stop_reason"),
                orjson.dumps(meta).decode(),
                orjson.dumps(body["messages"]).decode(),
            ]
        )
    return rows


async def run_bare(batches: list[list[dict[str, Any]]], gap: float) -> tuple[float, float, float]:
    import wandb

    from asynctrace.sinks._wandb import WANDB_COLUMNS

    started = time.perf_counter()
    run = await anyio.to_thread.run_sync(
        lambda: wandb.init(project="bench", name=f"bare-{uuid.uuid4().hex[:6]}", settings=SETTINGS)
    )
    run.define_metric("asynctrace/step", hidden=True)
    run.define_metric("train/traces-incr", step_metric="asynctrace/step")
    table = wandb.Table(columns=list(WANDB_COLUMNS), log_mode="INCREMENTAL")
    spent = 0.0
    for step, batch in enumerate(batches):
        t = time.perf_counter()
        for row in _bare_rows(batch, step, step * BATCH):
            table.add_data(*row)
        run.log({"train/traces-incr": table, "asynctrace/step": step})
        spent += time.perf_counter() - t
        await anyio.sleep(gap)
    t = time.perf_counter()
    run.log({"train/traces": wandb.Table(columns=list(WANDB_COLUMNS), data=list(table.data))})
    run.finish()
    return spent, time.perf_counter() - t, time.perf_counter() - started


async def run_session(batches: list[list[dict[str, Any]]], gap: float) -> tuple[float, float, float]:
    import asynctrace as at

    samples = [common.to_samples(b) for b in batches]
    sink = at.WandbSink(init_kwargs={"settings": SETTINGS})
    session = at.TraceSession("bench", run=f"session-{uuid.uuid4().hex[:6]}", sinks=[sink])
    spent = 0.0
    started = time.perf_counter()
    async with session:
        for step, batch in enumerate(samples):
            t = time.perf_counter()
            await session.log_samples(batch, step=step)
            spent += time.perf_counter() - t
            await anyio.sleep(gap)
        t = time.perf_counter()
        stats = await session.finish(timeout=120)
        ended = time.perf_counter() - t
    assert stats.written == sum(len(b) for b in batches) and sink.finished, stats.summary()
    return spent, ended, time.perf_counter() - started


async def main_async(args: argparse.Namespace) -> int:
    common.print_machine("start")
    bodies = common.sample_bodies(args.samples, args.size)
    batches = [bodies[i : i + BATCH] for i in range(0, len(bodies), BATCH)]
    n = len(bodies)
    # One untimed run each: wandb's imports and its service's start are paid before timing.
    await run_bare(batches[:2], 0.0)
    await run_session(batches[:2], 0.0)
    results: dict[str, list[tuple[float, float, float]]] = {"bare": [], "session": []}
    for _ in range(args.rounds):
        results["bare"].append(await run_bare(batches, args.gap))
        results["session"].append(await run_session(batches, args.gap))
    # Caller cost is what the training loop pays per sample; finish, paid once after training
    # (the session drains its queue there), is reported apart.
    rows = []
    for name, runs in results.items():
        call_us = statistics.median(r[0] for r in runs) / n * 1e6
        finish_s = statistics.median(r[1] for r in runs)
        rate = n / statistics.median(r[2] for r in runs)
        rows.append([name, f"{call_us:.1f}", f"{finish_s:.2f}", f"{rate:.0f}"])
    pairs = list(zip(results["bare"], results["session"], strict=True))
    cost = statistics.median(b[0] / s[0] for b, s in pairs)
    speed = statistics.median(b[2] / s[2] for b, s in pairs)
    print(f"{n} samples of ~{args.size} B in batches of {BATCH}, {args.rounds} round(s), gap {args.gap}s")
    common.print_table(["variant", "caller µs/sample", "finish s", "end-to-end samples/s"], rows)
    print(f"caller cost, bare / session: {common.fmt_ratio(cost)}")
    print(f"end-to-end time, bare / session: {common.fmt_ratio(speed)}")
    common.print_machine("end")
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_main(main_async, parse_args))
