"""`log_metrics` within the byte bound: a flood behind a hung sink is dropped and counted."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import asynctrace as at
from tests._util import sample
from tests.faults._harness import ROOT, env

# Run in a process of its own: its resident memory is what the test measures.
_FLOOD = textwrap.dedent(
    """
    import gc, json, psutil
    import asynctrace as at

    proc = psutil.Process()
    hung = at.testing.MemorySink("hung", hang=True)
    other = at.testing.MemorySink("other")
    with at.TraceSession(
        "p", sinks=[hung, other], max_queue_bytes=2**20, on_full="drop_newest", finish_timeout=1.0,
        health_metrics=False,
    ) as s:
        s.log_samples([{"prompt": "q", "response": "a"}], step=0)  # the hung sink's lane stops on it
        gc.collect()
        before = proc.memory_info().rss
        for i in range(80_000):
            s.log_metrics({f"loss/{j}": float(i + j) for j in range(10)}, step=i)
        gc.collect()
        grown = proc.memory_info().rss - before
        stats = s.stats()
    print(json.dumps({"grown": grown, "queue_bytes": stats.queue_bytes,
                      "metrics_dropped": stats.metrics_dropped, "other": len(other.metrics)}))
    """
)


def test_a_metrics_flood_behind_a_hung_sink_stays_within_the_bound() -> None:
    """80,000 log_metrics calls of 10 keys behind a hung sink, max_queue_bytes=1 MiB: resident
    memory grows by a few MiB, not the ~100 MiB they would take; what did not fit is counted."""
    out = subprocess.run(
        [sys.executable, "-c", _FLOOD], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["grown"] < 16 * 2**20, result
    assert 0 < result["queue_bytes"] <= 2**20, result
    # Each call held about 1 KiB: most of the 80,000 found no room, and each is counted.
    assert result["metrics_dropped"] > 70_000, result
    assert result["other"] == 80_000 - result["metrics_dropped"], result


def test_metrics_free_their_room_once_every_sink_has_them() -> None:
    """Metrics written by every sink give their bytes back: the queue is empty after a flush,
    and none is dropped under the bound."""
    sink = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[sink], max_queue_bytes=64 * 2**10, health_metrics=False) as s:
        s.log_samples([sample(0)], step=0)
        for i in range(2_000):
            s.log_metrics({"loss": float(i)}, step=i)
            if i % 20 == 0:
                assert s.flush(timeout=10)
        assert s.flush(timeout=10)
        stats = s.stats()
    assert stats.queue_bytes == 0 and stats.metrics_dropped == 0
    assert [m["loss"] for _, m in sink.metrics] == [float(i) for i in range(2_000)]
