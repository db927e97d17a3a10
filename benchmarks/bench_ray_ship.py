"""Ray: bytes shipped and collector CPU per capped step, with and without the client's local selection.

Four rollout actors log a step's samples (``--per-step`` in all, ``--bytes`` each) through a
`TraceClient` to one `TraceCollector` capping each step at ``--cap`` with ``top_bottom``:

- ``ship all``: ``TraceClient(select_locally=False)``, every sample crosses to the collector,
  whose session selects over the whole step (the client before local selection);
- ``select locally``: the default; each actor keeps its own ``--cap`` candidates of a step and
  ships only those when the step closes there (the next step, or the final flush).

Per variant and round: the payload bytes the clients shipped per step (``ClientStats.bytes_shipped``),
the collector process's CPU per step (user + system time of every thread of its process, read
from ``/proc``, from the first sample to the end of its ``flush``), and the actors' time inside
``log_samples_nowait`` per sample. Both variants run in one job on one local cluster, alternating
rounds, against one collector; ratios are ``ship all / select locally``.

    python benchmarks/bench_ray_ship.py            # 512 samples of 100 KB a step, cap 16
    python benchmarks/bench_ray_ship.py --quick    # smoke run
"""

from __future__ import annotations

import os
import tempfile

os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="asynctrace-bench-")

import argparse
import random
import statistics
import time
from typing import Any

import _common as common
import ray

from asynctrace.ray import TraceClient, start_collector

ACTORS = 4
CHUNK = 8  # samples per log call: an agentic rollout loop logs a few trajectories at a time


@ray.remote
class Producer:
    """A stand-in rollout actor: logs prepared samples step by step through its own client."""

    def __init__(self, bodies: list[dict[str, Any]]) -> None:
        self.bodies = bodies
        self.client: TraceClient | None = None

    def connect(self, collector: Any, select_locally: bool) -> None:
        self.client = TraceClient(
            collector,
            select_locally=select_locally,
            max_buffered=100_000,
            max_buffered_bytes=2**31,
            max_batch_bytes=16 * 2**20,
            flush_interval=0.05,
        )

    def run(self, first_step: int, steps: int, seed: int) -> dict[str, Any]:
        """Log `steps` steps of this actor's share, then flush; returns its numbers for the round."""
        assert self.client is not None
        rng = random.Random(seed)
        spent = 0.0
        n = 0
        for step in range(first_step, first_step + steps):
            for start in range(0, len(self.bodies), CHUNK):
                chunk = self.bodies[start : start + CHUNK]
                for body in chunk:  # a fresh reward per trajectory, as a rollout loop would have
                    body["metadata"]["reward"] = rng.random()
                t0 = time.perf_counter()
                self.client.log_samples_nowait(chunk, step=step)
                spent += time.perf_counter() - t0
                n += len(chunk)
        self.client.flush(600.0)
        stats = self.client.close(60.0)
        return {"stats": stats, "spent": spent, "samples": n}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of every thread of process `pid` (Linux)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--per-step", type=int, default=512, help="samples per step, all actors")
    parser.add_argument("--bytes", type=int, default=100_000, help="encoded size of one sample")
    parser.add_argument("--cap", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.per_step, args.bytes, args.steps, args.rounds = 128, 4_000, 2, 1

    share = args.per_step // ACTORS
    common.cleanup_trackio_dir_at_exit()
    common.print_machine("start")
    with common.stderr_to_log():
        ray.init(num_cpus=ACTORS + 1, include_dashboard=False, log_to_driver=False, configure_logging=False)
        collector = start_collector(
            common.project_name("ray-ship"),
            max_traces_per_step=args.cap,
            sampler="top_bottom",
            max_open_steps=2,
            step_timeout=None,
            queue_size=100_000,
            max_queue_bytes=2**31,
            ingest_timeout=120.0,
            finish_at_exit=False,
        )
        pid = ray.get(collector.ready.remote())["pid"]
        bodies = [common.sample_bodies(share, args.bytes, seed=a, distinct=share) for a in range(ACTORS)]
        actors = [Producer.remote(b) for b in bodies]
        step = 0
        results: dict[str, list[dict[str, float]]] = {"ship all": [], "select locally": []}
        for r in range(args.rounds):
            for name, local in (("ship all", False), ("select locally", True)):
                ray.get([a.connect.remote(collector, local) for a in actors])
                cpu0 = _cpu_seconds(pid)
                out = ray.get([a.run.remote(step, args.steps, r * 1000 + i) for i, a in enumerate(actors)])
                ray.get(collector.flush.remote(600.0))
                cpu = _cpu_seconds(pid) - cpu0
                step += args.steps + 3  # past the collector's open window: rounds never mix
                shipped = sum(o["stats"].bytes_shipped for o in out)
                delivered = sum(o["stats"].delivered for o in out)
                spent = sum(o["spent"] for o in out) / sum(o["samples"] for o in out)
                results[name].append(
                    {
                        "bytes": shipped / args.steps,
                        "samples": delivered / args.steps,
                        "cpu": cpu / args.steps,
                        "caller": spent,
                    }
                )
        final = ray.get(collector.finish.remote())
        ray.shutdown()

    def med(name: str, key: str) -> float:
        return statistics.median(row[key] for row in results[name])

    print(
        f"\n{ACTORS} actors, {args.per_step} samples of {args.bytes / 1000:.0f} KB a step, cap {args.cap} "
        f"(top_bottom), {args.steps} steps a round, median of {args.rounds} rounds:\n"
    )
    rows = []
    for name in results:
        rows.append(
            [
                name,
                f"{med(name, 'samples'):.0f}",
                f"{med(name, 'bytes') / 2**20:.2f} MiB",
                f"{med(name, 'cpu') * 1e3:.0f} ms",
                f"{med(name, 'caller') * 1e6:.1f} µs",
            ]
        )
    rows.append(
        [
            "ship all / select locally",
            common.fmt_ratio(med("ship all", "samples") / med("select locally", "samples")),
            common.fmt_ratio(med("ship all", "bytes") / med("select locally", "bytes")),
            common.fmt_ratio(med("ship all", "cpu") / med("select locally", "cpu")),
            common.fmt_ratio(med("ship all", "caller") / med("select locally", "caller")),
        ]
    )
    common.print_table(
        [
            "variant",
            "samples shipped / step",
            "bytes shipped / step",
            "collector CPU / step",
            "actor time in log call / sample",
        ],
        rows,
    )
    print(f"\ncollector: {final.summary()}")
    total_steps = args.rounds * 2 * args.steps
    print(f"written {final.written} of {total_steps} steps x cap {args.cap} = {total_steps * args.cap}")
    common.print_machine("end")


if __name__ == "__main__":
    main()
