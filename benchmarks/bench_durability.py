"""What the write-ahead spool costs: caller cost and throughput without a spool, with
``durability="writer"`` and with ``durability="enqueue"``, and how fast a spool is recovered.

Caller cost: time inside ``await session.log_samples(batch of 32)`` (2.5 KB samples), the caller
yielding ``--gap`` seconds between calls, as in ``bench_caller_cost.py``; the default
``TrackioSink``. Wall time inside the call is the goals' measure; the calling thread's CPU time
inside the call is shown too, as it leaves out time the thread was preempted (on a shared
2-core machine that is most of the round-to-round noise). The three variants run in rotating
order over ``--rounds`` rounds; ratios to the no-spool variant are the median of per-round
ratios.

Throughput: first submit to ``finish()`` returning, everything in Trackio's SQLite (verified
with a COUNT query), for each variant.

Recovery: a spool holding ``--recover-records`` unacknowledged records (left by a session whose
only sink never answered) is delivered to Trackio by ``asynctrace recover``'s implementation;
reading the spool back alone is timed too.

    python benchmarks/bench_durability.py
    python benchmarks/bench_durability.py --quick
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
from pathlib import Path
from typing import Any

import _common as common
import anyio
import orjson

GOAL_WRITER = 1.1
GOAL_ENQUEUE = 3.0
BATCH = 32
VARIANTS = ("none", "writer", "enqueue")


def _session(project: str, variant: str, spool: Path, n: int, size: int) -> Any:
    import asynctrace as at

    kwargs: dict[str, Any] = {}
    if variant != "none":
        kwargs = {"spool_dir": spool / variant, "durability": variant}
    return at.TraceSession(
        project,
        queue_size=n + 1,
        max_queue_bytes=n * (size + 1024) + 2**20,
        finish_timeout=600.0,
        **kwargs,
    )


async def caller_round(
    variant: str, samples: list[Any], calls: int, warmup: int, gap: float, spool: Path
) -> tuple[float, float]:
    """Seconds spent inside ``log_samples`` over `calls` timed calls: wall and on-CPU."""
    size = len(orjson.dumps(common.sample_body(0, common.SIZES["2.5KB"])))
    project = common.project_name(f"dur-{variant}")
    spent = cpu = 0.0
    async with _session(project, variant, spool, len(samples), size) as session:
        await session.flush()  # the writer process is up before timing starts
        for c in range(warmup + calls):
            batch = samples[c * BATCH : (c + 1) * BATCH]
            t0, c0 = time.perf_counter(), time.thread_time()
            await session.log_samples(batch, step=c)
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            if c >= warmup:
                spent += dt
                cpu += dc
            await anyio.sleep(gap)
    stats = session.stats()
    if stats.written != len(samples) or not stats.check():
        raise SystemExit(f"{variant}: lost samples: {stats.summary()}")
    return spent, cpu


async def throughput_round(variant: str, samples: list[Any], spool: Path) -> float:
    """Records per second from the first submit to ``finish()`` returning."""
    size = len(orjson.dumps(common.sample_body(0, common.SIZES["2.5KB"])))
    project = common.project_name(f"tput-{variant}")
    async with _session(project, variant, spool, len(samples), size) as session:
        await session.flush()
        t0 = time.perf_counter()
        for c in range(0, len(samples), BATCH):
            await session.log_samples(samples[c : c + BATCH], step=c // BATCH)
        stats = await session.finish()
        elapsed = time.perf_counter() - t0
    stored = common.count_trackio_traces(project, session.run)
    if stats.written != len(samples) or stored != len(samples):
        raise SystemExit(f"{variant}: stored {stored}: {stats.summary()}")
    return len(samples) / elapsed


async def make_backlog(samples: list[Any], spool: Path) -> str:
    """A spool holding every sample unacknowledged, as a killed trainer would leave it."""
    import asynctrace as at

    project = common.project_name("recover")
    async with at.TraceSession(
        project,
        run="r",
        sinks=[at.testing.MemorySink(hang=True)],
        spool_dir=spool,
        durability="enqueue",
        queue_size=len(samples) + 1,
        max_queue_bytes=1 << 31,
        finish_timeout=0.5,
    ) as session:
        for c in range(0, len(samples), BATCH):
            await session.log_samples(samples[c : c + BATCH], step=c // BATCH)
    return project


async def recovery(samples: list[Any], spool: Path) -> tuple[float, float, float, int]:
    """(records/s reading the spool back, records/s delivered by recover, seconds, bytes)."""
    from asynctrace._durable import segments
    from asynctrace._recover import recover

    project = await make_backlog(samples, spool)
    nbytes = sum(p.stat().st_size for p in spool.glob("seg-*"))
    t0 = time.perf_counter()
    scan = segments.scan_dir(spool)
    loaded = sum(len(segments.load_records(f, f.unresolved)) for f in scan.files)
    read_rate = loaded / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    report = await recover(spool, progress=False)
    seconds = time.perf_counter() - t0
    stored = common.count_trackio_traces(project, "r")
    if not report.ok or stored != len(samples) or loaded != len(samples):
        raise SystemExit(f"recover: {report.lines()} stored={stored} loaded={loaded}")
    return read_rate, len(samples) / seconds, seconds, nbytes


def line_costs(bodies: list[dict[str, Any]], rounds: int) -> None:
    """What writing one record to the spool costs on the caller's side under "enqueue", next to
    encoding it: the scan for credentials, and the whole spool line (the scan included)."""
    from asynctrace._durable.segments import record_line_parts
    from asynctrace._records.types import TraceRecord
    from asynctrace._security import scrub_bytes, secret_bytes

    payloads = [orjson.dumps(b) for b in bodies]
    records = [TraceRecord(f"id-{i}", 0, "train", "train/traces", p, 0.0) for i, p in enumerate(payloads)]
    secrets = secret_bytes()

    def encode() -> None:
        for b in bodies:
            orjson.dumps(b)

    def scan() -> None:
        for p in payloads:
            scrub_bytes(p, secrets)

    def line() -> None:
        out: list[bytes] = []
        for r in records:
            record_line_parts(r, secrets, out)

    variants = {"encode the sample (orjson.dumps)": encode, "credential scan (scrub_bytes)": scan,
                "whole spool line (scan included)": line}  # fmt: skip
    spent: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            spent[name].append((time.perf_counter() - t0) / len(bodies) * 1e6)
    base = statistics.median(spent["encode the sample (orjson.dumps)"])
    print(f"spool line cost per 2.5 KB record ({len(secrets)} credential values in the environment), "
          f"{rounds} alternating rounds (median)")  # fmt: skip
    common.print_table(
        ["step", "us/record", "vs encode"],
        [
            [v, f"{statistics.median(x):.2f}", common.fmt_ratio(statistics.median(x) / base)]
            for v, x in spent.items()
        ],
    )
    print()


async def main_async(args: argparse.Namespace) -> int:
    common.print_machine("start")
    common.prefault(args.prefault_mb)
    spool_root = Path(tempfile.mkdtemp(prefix="asynctrace-bench-spool-"))
    try:
        return await _run(args, spool_root)
    finally:
        shutil.rmtree(spool_root, ignore_errors=True)


async def _run(args: argparse.Namespace, spool_root: Path) -> int:
    size = common.SIZES["2.5KB"]
    n = (args.calls + args.warmup) * BATCH
    samples = common.to_samples(common.sample_bodies(n, size))
    cost: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        for variant in order:
            spent, on_cpu = await caller_round(
                variant, samples, args.calls, args.warmup, args.gap, spool_root / str(r)
            )
            cost[variant].append(spent / (args.calls * BATCH) * 1e6)
            cpu[variant].append(on_cpu / (args.calls * BATCH) * 1e6)

    def ratios_of(values: dict[str, list[float]]) -> dict[str, list[float]]:
        return {
            v: [x / base for x, base in zip(values[v], values["none"], strict=True)]
            for v in ("writer", "enqueue")
        }

    ratios, cpu_ratios = ratios_of(cost), ratios_of(cpu)
    print(f"caller cost per 2.5 KB sample, batches of {BATCH}, {args.calls * BATCH} samples timed per round, "
          f"{args.rounds} rotating rounds (median); gap {args.gap * 1e3:.0f} ms")  # fmt: skip
    rows = []
    for v in VARIANTS:
        ratio = "1.00x" if v == "none" else common.fmt_ratio(statistics.median(ratios[v]))
        cpu_ratio = "1.00x" if v == "none" else common.fmt_ratio(statistics.median(cpu_ratios[v]))
        rounds = " / ".join(f"{x:.2f}" for x in cost[v])
        rows.append([v, f"{statistics.median(cost[v]):.2f}", rounds, ratio,
                     f"{statistics.median(cpu[v]):.2f}", cpu_ratio])  # fmt: skip
    common.print_table(
        ["spool", "us/sample", "rounds (us/sample)", "vs no spool", "on-CPU us/sample", "on-CPU vs no spool"],
        rows,
    )
    print()

    tput_samples = common.to_samples(common.sample_bodies(args.throughput_records, size))
    tput: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.throughput_rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        for variant in order:
            tput[variant].append(await throughput_round(variant, tput_samples, spool_root / f"t{r}"))
    print(f"end-to-end throughput into Trackio, {args.throughput_records} samples of 2.5 KB, "
          f"{args.throughput_rounds} rotating rounds (median)")  # fmt: skip
    base = statistics.median(tput["none"])
    common.print_table(
        ["spool", "samples/s", "rounds", "vs no spool"],
        [
            [
                v,
                f"{statistics.median(tput[v]):,.0f}",
                " / ".join(f"{x:,.0f}" for x in tput[v]),
                common.fmt_ratio(statistics.median(tput[v]) / base),
            ]
            for v in VARIANTS
        ],
    )
    print()

    line_costs(common.sample_bodies(2000, size), args.rounds)

    backlog = common.to_samples(common.sample_bodies(args.recover_records, size))
    read_rate, rate, seconds, nbytes = await recovery(backlog, spool_root / "recover")
    mib = nbytes / 2**20
    print(f"recovery of {args.recover_records} unacknowledged 2.5 KB records ({mib:.1f} MiB of spool)")
    common.print_table(
        ["step", "records/s", "seconds"],
        [
            [
                "read the spool back (scan + load)",
                f"{read_rate:,.0f}",
                f"{args.recover_records / read_rate:.2f}",
            ],
            ["recover into Trackio (incl. writer start)", f"{rate:,.0f}", f"{seconds:.2f}"],
        ],
    )
    print()
    writer_ratio = statistics.median(ratios["writer"])
    enqueue_ratio = statistics.median(ratios["enqueue"])
    ok_writer = writer_ratio <= GOAL_WRITER
    ok_enqueue = enqueue_ratio <= GOAL_ENQUEUE
    print(f"writer / none  = {common.fmt_ratio(writer_ratio)} (goal <= {GOAL_WRITER}x: "
          f"{'met' if ok_writer else 'NOT met'})")  # fmt: skip
    print(f"enqueue / none = {common.fmt_ratio(enqueue_ratio)} (goal <= {GOAL_ENQUEUE}x: "
          f"{'met' if ok_enqueue else 'NOT met'})")  # fmt: skip
    common.print_machine("end")
    return 0 if (ok_writer and ok_enqueue) or not args.strict else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200, help="timed calls per round")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls at the start of each round")
    p.add_argument("--rounds", type=int, default=9, help="rotating rounds of the three variants")
    p.add_argument("--gap", type=float, default=0.015, help="seconds the caller yields between calls")
    p.add_argument("--throughput-records", type=int, default=10_000)
    p.add_argument("--throughput-rounds", type=int, default=3)
    p.add_argument("--recover-records", type=int, default=20_000)
    p.add_argument("--prefault-mb", type=int, default=512, help="VM first-touch warm-up (0 = off)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--verbose", action="store_true", help="show Trackio's and the writer's stderr")
    p.add_argument("--strict", action="store_true", help="exit 1 when a goal is not met")
    args = p.parse_args(argv)
    if args.quick:
        args.calls, args.warmup, args.rounds, args.prefault_mb = 20, 2, 3, 0
        args.throughput_records, args.throughput_rounds, args.recover_records = 1000, 1, 1000
    return args


def main(argv: list[str] | None = None) -> int:
    return common.run_main(main_async, parse_args, argv)


if __name__ == "__main__":
    sys.exit(main())
