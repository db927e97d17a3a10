"""Memory under overload: a producer ~100x faster than its sink, with a byte bound and a drop policy.

Each policy and sampler runs in a fresh child process (this script re-invoked with ``--child``)
so RSS figures are clean; the top-level run prints everything. In the child:

- a ``TraceSession`` with ``max_queue_bytes`` (default 64 MiB), ``on_full`` = the policy and a
  deliberately slow sink that discards what it gets (it sleeps ``--sink-ms-per-record`` per
  record while the producer runs, then speeds up so ``finish`` drains quickly); with a sampler
  (``--samplers``: ``none`` is no cap), ``max_traces_per_step`` of half a step's samples and
  ``max_open_steps=2``, so a holding sampler (``top_bottom``, ``reservoir``) keeps selections
  for three open steps and releases one into the queue as each step closes;
- a producer coroutine logging 32 KB samples in batches of 32, one step per batch (a pool of
  distinct samples is reused, so the samples themselves take no memory; what is held is what
  the session holds), ``--total-mib`` in all, far more than the bound;
- a sampler thread reading RSS (psutil) every ``--sample-ms`` and checking the accounting
  invariant (``submitted == written + failed + pending + sum(dropped)``) and
  ``queue_bytes <= max_queue_bytes`` (plus, with a holding sampler, a selection per open step:
  the documented bound) on live ``stats()`` snapshots.

The baseline RSS is taken after a warm-up: samples logged through the (then fast) sink and
drained. Each policy runs twice: after a short warm-up (``--short-warmup-mib``, just enough for
imports and caches) and after a long one (``--long-warmup-mib``, half the bound by default),
because how much of the freed memory the allocator hands back, and how fragmented the heap
gets, depends on what the process allocated before, as it would in a long-running trainer.
Reported: peak RSS growth over the baseline divided by the documented bound (the byte bound,
plus ``max_traces_per_step`` samples per open step with a holding sampler; goal < 1.5); the
measured producer rate over the sink's rate; drops counted; which steps survived (drop_newest
should keep the oldest, drop_oldest the newest).

    python benchmarks/bench_memory.py
    python benchmarks/bench_memory.py --quick
    python benchmarks/bench_memory.py --samplers top_bottom,reservoir
"""

from __future__ import annotations

import os
import tempfile

os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="asynctrace-bench-")

import argparse
import gc
import json
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import _common as common
import anyio
import anyio.lowlevel
import psutil

import asynctrace as at
from asynctrace._records.encode import encode_sample

GOAL = 1.5  # peak RSS growth / byte bound
BATCH = 32
POLICIES = ("drop_newest", "drop_oldest")
SAMPLERS = ("none", "first", "top_bottom", "reservoir")
HOLDING = ("top_bottom", "reservoir")
K = BATCH // 2  # max_traces_per_step with a sampler: half of each step's samples
MAX_OPEN_STEPS = 2
MIB = 2**20


def allowance(sampler: str, record_bytes: int) -> int:
    """Bytes the documented bound allows past max_queue_bytes: a holding sampler's selection
    per open step (configuration.md), of records of `record_bytes` each."""
    return K * (MAX_OPEN_STEPS + 1) * record_bytes if sampler in HOLDING else 0


class SlowDiscardSink(at.Sink):
    """Sleeps per record while `slow` is set, keeps nothing but counts and the steps it saw."""

    def __init__(self, seconds_per_record: float) -> None:
        self.name = "slow-discard"
        self.seconds_per_record = seconds_per_record
        self.slow = False
        self.written = 0
        self.written_while_slow = 0
        self.steps: list[int] = []

    async def write(self, records: Sequence[at.TraceRecord]) -> None:
        if self.slow:
            await anyio.sleep(self.seconds_per_record * len(records))
            self.written_while_slow += len(records)
        else:
            await anyio.lowlevel.checkpoint()
        self.written += len(records)
        self.steps.extend(r.step for r in records)


class Sampler(threading.Thread):
    """Samples RSS and checks live stats snapshots from a background thread."""

    def __init__(self, session: at.TraceSession, every: float, allowed: int) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.session = session
        self.allowed = allowed
        self.every = every
        self.proc = psutil.Process()
        self.peak = 0
        self.samples = 0
        self.snapshots = 0
        self.invariant_violations = 0
        self.bound_violations = 0
        self.max_queue_bytes_seen = 0
        self.halt = threading.Event()

    def run(self) -> None:
        bound = self.session.max_queue_bytes + self.allowed
        while not self.halt.is_set():
            rss = self.proc.memory_info().rss
            self.peak = max(self.peak, rss)
            self.samples += 1
            if self.samples % 5 == 0:
                s = self.session.stats()
                self.snapshots += 1
                self.invariant_violations += not s.check()
                self.bound_violations += s.queue_bytes > bound
                self.max_queue_bytes_seen = max(self.max_queue_bytes_seen, s.queue_bytes)
            self.halt.wait(self.every)


def rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


async def child(args: argparse.Namespace) -> dict[str, Any]:
    bound = args.bound_mib * MIB
    size = common.SIZES["32KB"]
    pool = common.to_samples(common.sample_bodies(64, size))
    for j, sample in enumerate(pool):
        sample.score = float(j % BATCH)  # what top_bottom ranks by
    # The bound counts encoded records, a little larger than the samples' text.
    record_bytes = max(len(encode_sample(sample, j)[0]) for j, sample in enumerate(pool))
    batches = max(1, args.total_mib * MIB // (BATCH * size))
    sink = SlowDiscardSink(args.sink_ms_per_record / 1e3)
    capped: dict[str, Any] = {}
    if args.sampler != "none":
        capped = {"max_traces_per_step": K, "sampler": args.sampler, "max_open_steps": MAX_OPEN_STEPS}
    session = at.TraceSession(
        common.project_name("memory"),
        sinks=[sink],
        max_queue_bytes=bound,
        on_full=args.child,
        finish_timeout=120.0,
        **capped,
    )
    async with session:
        # Warm-up through the fast sink (nothing is dropped: the sink keeps up).
        warm_batches = max(1, args.warmup_mib * MIB // (BATCH * size))
        for i in range(warm_batches):
            await session.log_samples(pool[(i % 2) * BATCH : (i % 2 + 1) * BATCH], step=i)
        await session.flush()
        warm = session.stats()
        sink.steps.clear()
        baseline = rss()
        sampler = Sampler(session, args.sample_ms / 1e3, allowance(args.sampler, record_bytes))
        sampler.peak = baseline
        sampler.start()
        sink.slow = True
        t0 = time.perf_counter()
        for i in range(batches):
            batch = [pool[(i * BATCH + j) % len(pool)] for j in range(BATCH)]
            await session.log_samples(batch, step=warm_batches + i)
            await anyio.sleep(0)
        produced_s = time.perf_counter() - t0
        written_while_producing = sink.written_while_slow
        sink.slow = False
        stats = await session.finish()
        sampler.halt.set()
        sampler.join()
    submitted = batches * BATCH
    bound_records = bound // size
    kept = {step - warm_batches for step in sink.steps}
    per_step = BATCH if args.sampler == "none" else K  # what the sink can get of one step
    first_steps = range(bound_records // per_step)
    last_steps = range(batches - bound_records // per_step, batches)
    return {
        "policy": args.child,
        "sampler": args.sampler,
        "warmup_mib": args.warmup_mib,
        "bound": bound,
        "allowance": allowance(args.sampler, record_bytes),
        "baseline_rss": baseline,
        "peak_rss": sampler.peak,
        "growth": sampler.peak - baseline,
        "rss_samples": sampler.samples,
        "snapshots": sampler.snapshots,
        "invariant_violations": sampler.invariant_violations,
        "bound_violations": sampler.bound_violations,
        "max_queue_bytes_seen": sampler.max_queue_bytes_seen,
        "submitted": stats.submitted - warm.submitted,
        "expected_submitted": submitted,
        "written": stats.written - warm.written,
        "dropped": {k: v - warm.dropped.get(k, 0) for k, v in stats.dropped.items()},
        "pending": stats.pending,
        "failed": stats.failed,
        "final_invariant": stats.check(),
        "produced_mib": submitted * size / MIB,
        "produce_seconds": produced_s,
        "producer_rate": submitted / produced_s,
        "sink_rate": 1.0 / sink.seconds_per_record,
        "written_while_producing": written_while_producing,
        "kept_first_frac": sum(s in kept for s in first_steps) / max(1, len(first_steps)),
        "kept_last_frac": sum(s in kept for s in last_steps) / max(1, len(last_steps)),
    }


def run_child(policy: str, sampler: str, warmup_mib: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        policy,
        "--sampler",
        sampler,
        "--warmup-mib",
        str(warmup_mib),
        "--bound-mib",
        str(args.bound_mib),
        "--total-mib",
        str(args.total_mib),
        "--sink-ms-per-record",
        str(args.sink_ms_per_record),
        "--sample-ms",
        str(args.sample_ms),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    tail = "\n".join((out.stdout + out.stderr).splitlines()[-30:])
    raise SystemExit(f"child for {policy} failed (exit {out.returncode}):\n{tail}")


def main_parent(args: argparse.Namespace) -> int:
    common.print_machine("start")
    results = [
        run_child(policy, sampler, warmup, args)
        for sampler in args.samplers
        for warmup in (args.short_warmup_mib, args.long_warmup_mib)
        for policy in POLICIES
    ]
    rows: list[list[str]] = []
    ok = True
    for r in results:
        ratio = r["growth"] / (r["bound"] + r["allowance"])
        speed = r["producer_rate"] / r["sink_rate"] if r["sink_rate"] else float("inf")
        drops = r["dropped"].get("queue_full", 0)
        capped = r["dropped"].get("capped", 0)
        accounting = (
            r["final_invariant"]
            and r["invariant_violations"] == 0
            and r["bound_violations"] == 0
            and r["pending"] == 0
            and r["submitted"] == r["expected_submitted"]
            and r["written"] + drops + capped == r["submitted"]
            and drops > 0
        )
        r["ratio"], r["speed"], r["accounting"] = ratio, speed, accounting
        ok &= ratio < GOAL and accounting
        rows.append(
            [
                r["policy"],
                r["sampler"],
                f"{r['warmup_mib']}",
                f"{r['produced_mib']:.0f}",
                f"{(r['bound'] + r['allowance']) / MIB:.1f}",
                f"{r['baseline_rss'] / MIB:.0f}",
                f"{r['peak_rss'] / MIB:.0f}",
                f"{r['growth'] / MIB:.1f}",
                f"{ratio:.2f}",
                f"{r['max_queue_bytes_seen'] / MIB:.1f}",
                common.fmt_ratio(speed),
            ]
        )
    print(
        f"peak RSS growth with a {args.bound_mib} MiB byte bound, 32 KB samples, batches of {BATCH} "
        f"(one step each), slow sink {args.sink_ms_per_record:g} ms/record; one fresh process per "
        f"variant; with a sampler max_traces_per_step={K}, max_open_steps={MAX_OPEN_STEPS}"
    )
    print("(bound: max_queue_bytes, plus max_traces_per_step samples per open step with a holding sampler)")
    print("(producer / sink rate: the producer's measured samples/s over the sink's rate, 1 / its delay)")
    common.print_table(
        [
            "on_full",
            "sampler",
            "warm-up MiB",
            "produced MiB",
            "bound MiB",
            "baseline RSS MiB",
            "peak RSS MiB",
            "growth MiB",
            "growth / bound",
            "max queue_bytes MiB",
            "producer / sink rate",
        ],
        rows,
    )
    print()
    rows = []
    for r in results:
        rows.append(
            [
                r["policy"],
                r["sampler"],
                f"{r['warmup_mib']}",
                f"{r['submitted']}",
                f"{r['written']}",
                f"{r['dropped'].get('capped', 0)}",
                f"{r['dropped'].get('queue_full', 0)}",
                f"{r['pending']}",
                "yes" if r["accounting"] else "NO",
                f"{r['snapshots']} ({r['invariant_violations']} / {r['bound_violations']})",
                f"{r['kept_first_frac']:.0%}",
                f"{r['kept_last_frac']:.0%}",
            ]
        )
    common.print_table(
        [
            "on_full",
            "sampler",
            "warm-up MiB",
            "submitted",
            "written",
            "dropped capped",
            "dropped queue_full",
            "pending",
            "accounting exact",
            "live snapshots (invariant / bound violations)",
            "oldest bound's worth kept",
            "newest bound's worth kept",
        ],
        rows,
    )
    print()
    for r in results:
        met = r["ratio"] < GOAL
        print(
            f"ratio {r['policy']}, {r['sampler']}, {r['warmup_mib']} MiB warm-up: "
            f"peak RSS growth / bound = {r['ratio']:.2f} "
            f"(goal < {GOAL}: {'met' if met else 'NOT met'}); "
            f"producer / sink = {common.fmt_ratio(r['speed'])}; "
            f"accounting {'exact' if r['accounting'] else 'NOT exact'}"
        )
    common.print_machine("end")
    return 0 if ok or not args.strict else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bound-mib", type=int, default=64, help="max_queue_bytes, MiB")
    p.add_argument("--total-mib", type=int, default=1024, help="MiB of samples the producer logs")
    p.add_argument(
        "--sink-ms-per-record",
        type=float,
        default=10.0,
        help="the slow sink's sleep per record while the producer runs",
    )
    p.add_argument("--sample-ms", type=float, default=2.0, help="RSS sampling period")
    p.add_argument(
        "--short-warmup-mib", type=int, default=4, help="MiB logged and drained before the baseline"
    )
    p.add_argument(
        "--long-warmup-mib", type=int, default=None, help="the long warm-up (default: half the bound)"
    )
    p.add_argument("--warmup-mib", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--strict", action="store_true", help="exit 1 when a goal is not met")
    p.add_argument(
        "--samplers",
        default=",".join(SAMPLERS),
        help=f"comma-separated, of {', '.join(SAMPLERS)} (none: no cap)",
    )
    p.add_argument("--child", choices=POLICIES, help=argparse.SUPPRESS)
    p.add_argument("--sampler", choices=SAMPLERS, default="none", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.samplers = [name.strip() for name in args.samplers.split(",") if name.strip()]
    for name in args.samplers:
        if name not in SAMPLERS:
            p.error(f"--samplers: unknown sampler {name!r}")
    if args.quick:
        args.bound_mib, args.total_mib, args.short_warmup_mib = 8, 64, 1
    if args.long_warmup_mib is None:
        args.long_warmup_mib = args.bound_mib // 2
    return args


def main(argv: list[str] | None = None) -> int:
    common.cleanup_trackio_dir_at_exit()
    args = parse_args(argv)
    if args.child:
        result = anyio.run(child, args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    return main_parent(args)


if __name__ == "__main__":
    sys.exit(main())
