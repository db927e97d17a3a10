"""A plain synchronous training loop logging traces, plus a worker thread logging without blocking.

`with TraceSession(...)` runs the session's writer on its own event-loop thread, so a loop
with no asyncio at all can use it; `log_samples_nowait` is safe from any thread.
Open the dashboard with: trackio show --project "asynctrace-sync"
"""

from __future__ import annotations

import queue
import random
import threading
from typing import Any

import asynctrace as at


def generate(step: int, i: int) -> dict[str, Any]:
    """Stands in for generation: one chat sample with a reward."""
    return {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": f"Name a prime larger than {10 * step + i}."},
            {"role": "assistant", "content": "97"},
        ],
        "reward": random.random(),
        "dataset": "primes",
    }


def evaluator(session: at.SyncTraceSession, jobs: queue.Queue[int | None]) -> None:
    """A worker thread: logs eval samples without ever blocking (a full queue drops and counts)."""
    while (step := jobs.get()) is not None:
        session.log_samples_nowait([generate(step, i) for i in range(4)], step=step, split="eval")


def main() -> None:
    jobs: queue.Queue[int | None] = queue.Queue()
    with at.TraceSession("asynctrace-sync", max_traces_per_step=16, sampler="reservoir") as session:
        worker = threading.Thread(target=evaluator, args=(session, jobs))
        worker.start()
        for step in range(20):
            batch = [generate(step, i) for i in range(64)]
            session.log_samples(batch, step=step)  # blocks only while the buffer is full
            session.log_metrics({"reward/mean": sum(s["reward"] for s in batch) / len(batch)}, step=step)
            if step % 5 == 0:
                jobs.put(step)
        jobs.put(None)
        worker.join()
    # Leaving the block drained everything, finished the Trackio run and stopped the writer thread.
    stats = session.stats()
    print(stats.summary())
    for name, sink in stats.sinks.items():
        print(f"  {name}: written={sink.written} failed={sink.failed} retries={sink.retries}")


if __name__ == "__main__":
    main()
