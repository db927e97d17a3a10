"""Ray: the rollout actor's cost per sample, and the collector's throughput with 4 actors.

Two ways for a rollout actor to hand samples to a `TraceCollector`:

- ``client``: ``TraceClient.log_samples_nowait(batch)`` (validate and encode in the actor,
  buffer, ship encoded batches from a background thread, a bound on calls in flight);
- ``remote``: one ``collector.ingest.remote(batch, step=...)`` per call (Ray pickles the sample
  objects; the collector validates and encodes them).

Actor-side cost: inside one actor, the time spent in the call itself, summed over `--calls`
calls of `--batch` samples each, with ``--gap`` seconds between calls standing in for
generation (so the client's shipping thread runs as it would). Reported per sample.

Collector throughput: 4 actors each hand over `--flood` samples as fast as they can; the clock
stops when the collector has ingested every one (``client.flush()`` returns once delivered;
the ``remote`` variant waits for every call's result). Samples per second, end to end through
the collector's session (cap of 16 per step, ``top_bottom``, Trackio sink).

Both variants run in the same job, alternating, on the same local cluster; ratios are
``remote / client``.

    python benchmarks/bench_distributed.py            # default sizes
    python benchmarks/bench_distributed.py --quick    # smoke run
"""

from __future__ import annotations

import os
import tempfile

os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="asynctrace-bench-")

import argparse
import statistics
import time
from typing import Any

import _common as common
import ray

from asynctrace.ray import TraceClient, start_collector

CALLS_PER_STEP = 8


@ray.remote
class Producer:
    """A stand-in rollout actor that only hands samples over, timing the hand-over."""

    def __init__(self, collector: Any, max_buffered: int) -> None:
        self.collector = collector
        # Every sample crosses, so the collector's throughput is what it measures
        # (bench_ray_ship.py compares this with the client's local selection).
        self.client = TraceClient(
            collector,
            max_buffered=max_buffered,
            max_buffered_bytes=4 * 2**30,
            flush_interval=0.05,
            select_locally=False,
        )

    def cost(
        self, how: str, bodies: list[dict[str, Any]], calls: int, batch: int, gap: float, step0: int
    ) -> float:
        """Seconds per sample spent inside the hand-over call."""
        spent = 0.0
        refs = []
        n = len(bodies)
        for c in range(calls):
            start = (c * batch) % n
            chunk = bodies[start : start + batch]
            step = step0 + c // CALLS_PER_STEP
            t0 = time.perf_counter()
            if how == "client":
                self.client.log_samples_nowait(chunk, step=step)
            else:
                refs.append(self.collector.ingest.remote(chunk, step=step))
            spent += time.perf_counter() - t0
            if gap:
                time.sleep(gap)
        # Not timed: make sure everything arrived before the next round.
        if how == "client":
            self.client.flush(300.0)
        else:
            ray.get(refs)
        return spent / (calls * batch)

    def flood(
        self, how: str, bodies: list[dict[str, Any]], total: int, batch: int, step0: int
    ) -> dict[str, Any]:
        """Hand over `total` samples as fast as possible; returns when the collector has them all."""
        refs = []
        n = len(bodies)
        before = self.client.stats()
        for c in range(total // batch):
            start = (c * batch) % n
            chunk = bodies[start : start + batch]
            step = step0 + c // CALLS_PER_STEP
            if how == "client":
                self.client.log_samples_nowait(chunk, step=step)
            else:
                refs.append(self.collector.ingest.remote(chunk, step=step))
        if how == "client":
            self.client.flush(600.0)
        else:
            ray.get(refs)
        after = self.client.stats()
        return {"dropped": after.dropped_total - before.dropped_total}

    def ready(self) -> bool:
        return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="2.5KB", choices=sorted(common.SIZES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="samples per call")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per round (cost)")
    parser.add_argument("--gap", type=float, default=0.001, help="seconds between calls (cost)")
    parser.add_argument("--flood", type=int, default=10_000, help="samples per actor (throughput)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.flood, args.rounds = 200, 1_000, 1

    size = common.SIZES[args.size]
    bodies = common.sample_bodies(512, size)
    common.print_machine("start")
    with common.stderr_to_log():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
        collector = start_collector(
            common.project_name("ray"),
            max_traces_per_step=16,
            sampler="top_bottom",
            max_open_steps=1_000_000,  # every step of both variants stays open until flush
            step_timeout=None,
            queue_size=100_000,
            max_queue_bytes=2**31,
            finish_at_exit=False,
        )
        actors = [Producer.remote(collector, max(args.flood, 10_000)) for _ in range(4)]
        ray.get([a.ready.remote() for a in actors])
        step = 0

        cost: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for batch in args.batch:
                for how in ("client", "remote"):
                    per = ray.get(actors[0].cost.remote(how, bodies, args.calls, batch, args.gap, step))
                    step += args.calls // CALLS_PER_STEP + 1
                    cost.setdefault((how, batch), []).append(per)
        ray.get(collector.flush.remote())

        throughput: dict[str, list[float]] = {}
        drops: dict[str, int] = {}
        batch = max(args.batch)
        for _ in range(args.rounds):
            for how in ("client", "remote"):
                t0 = time.perf_counter()
                results = ray.get([a.flood.remote(how, bodies, args.flood, batch, step) for a in actors])
                elapsed = time.perf_counter() - t0
                step += args.flood // batch // CALLS_PER_STEP + 1
                delivered = 4 * (args.flood // batch) * batch - sum(r["dropped"] for r in results)
                throughput.setdefault(how, []).append(delivered / elapsed)
                drops[how] = drops.get(how, 0) + sum(r["dropped"] for r in results)
        final = ray.get(collector.finish.remote())
        ray.shutdown()

    print(f"\nActor-side cost per sample ({args.size} samples, median of {args.rounds} rounds):\n")
    rows = []
    for batch in args.batch:
        c = statistics.median(cost[("client", batch)])
        r = statistics.median(cost[("remote", batch)])
        rows.append([batch, f"{c * 1e6:.1f} µs", f"{r * 1e6:.1f} µs", common.fmt_ratio(r / c)])
    common.print_table(
        [
            "samples per call",
            "TraceClient.log_samples_nowait",
            "collector.ingest.remote()",
            "remote / client",
        ],
        rows,
    )
    print(f"\nCollector throughput, 4 actors, {batch} samples per call ({args.size}):\n")
    c = statistics.median(throughput["client"])
    r = statistics.median(throughput["remote"])
    common.print_table(
        ["variant", "samples/s into the collector", "dropped"],
        [
            ["TraceClient (encoded batches)", f"{c:,.0f}", drops["client"]],
            ["ingest.remote() per call", f"{r:,.0f}", drops["remote"]],
            ["client / remote", common.fmt_ratio(c / r), ""],
        ],
    )
    print(f"\ncollector: {final.summary()}")
    for name, sink in final.sinks.items():
        if sink.last_error:
            print(f"sink {name}: {sink.last_error}")
    common.print_machine("end")


if __name__ == "__main__":
    main()
