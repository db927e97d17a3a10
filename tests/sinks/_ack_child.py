"""A trainer killed right after its sink acknowledged a write (``python -m tests.sinks._ack_child KIND TO``).

It logs 20 samples to one sink (KIND ``jsonl``: a `JsonlSink` on the file TO; ``mlflow``: an
`MlflowSink` on the tracking URI TO, experiment ``acked``; ``trackio``: a `TrackioSink`,
project TO, run ``acked``, in ``TRACKIO_DIR``; ``trackio-thread``: the same with
``process=False``), waits until the session counts them written,
prints their ids as one JSON line and SIGKILLs itself: no close, no exit handler, nothing after
the acknowledgement gets to run.
"""

from __future__ import annotations

import os
import signal
import sys

import anyio
import orjson

import asynctrace as at
from tests._util import sample


def make_sink(kind: str, target: str) -> at.Sink:
    if kind == "jsonl":
        return at.JsonlSink(target)
    if kind == "mlflow":
        return at.MlflowSink(tracking_uri=target, experiment="acked")
    if kind == "trackio":
        return at.TrackioSink(target, "acked")
    if kind == "trackio-thread":
        return at.TrackioSink(target, "acked", process=False)
    raise SystemExit(f"unknown sink kind {kind!r}")


async def main(kind: str, target: str) -> None:
    sink = make_sink(kind, target)
    memory = at.testing.MemorySink("memory")
    session = at.TraceSession("p", run="acked", sinks=[sink, memory], batch_size=8)
    await session.__aenter__()
    await session.log_samples([sample(i) for i in range(20)], step=0)
    with anyio.fail_after(120):
        while session.stats().sinks[sink.name].written < 20:
            await anyio.sleep(0.001)
    sys.stdout.write(orjson.dumps([r.id for r in memory.records]).decode() + "\n")
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
