"""Tiered capture: every sample to a JSONL archive, the top and bottom 16 of each step to Trackio.

The session encodes each sample once; the archive gets all of them, and Trackio, through
`Selected`, only the 8 highest and 8 lowest rewards of each step. The ids match, so a trace
you spot in the dashboard is one lookup away from its archived copy. Run it, then open the
dashboard with: trackio show --project "asynctrace-tiered"
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any

import anyio
import orjson

import asynctrace as at
from asynctrace.sinks import JsonlSink, Selected, TrackioSink


def rollout(step: int, i: int) -> dict[str, Any]:
    """Stands in for your generation and reward code."""
    reward = random.random()
    return {
        "prompt": f"What is {step} * {i}?",
        "response": f"{step * i}",
        "reward": reward,
        "group_uid": i // 8,
    }


async def main() -> None:
    archive = Path(tempfile.mkdtemp(prefix="asynctrace-tiered-")) / "archive.jsonl"
    async with at.TraceSession(
        "asynctrace-tiered",
        run="tiered-demo",
        sinks=[
            JsonlSink(archive),  # every sample
            Selected(TrackioSink(), max_traces_per_step=16, sampler="top_bottom"),  # what the dashboard shows
        ],
        group_key="group_uid",  # zero-spread group metrics per step
    ) as session:
        for step in range(5):
            await session.log_samples([rollout(step, i) for i in range(256)], step=step)
    stats = session.stats()
    print(stats.summary())
    for name, sink in stats.sinks.items():
        print(f"  {name}: written={sink.written} skipped={dict(sink.skipped)}")

    # The lookup: a trace the dashboard shows, found in the archive by its id.
    from trackio.sqlite_storage import SQLiteStorage

    trace = SQLiteStorage.get_traces("asynctrace-tiered", run="tiered-demo", sort="step_asc")[0]
    wanted = trace["metadata"]["asynctrace_id"]  # the record id every sink got
    with archive.open("rb") as f:
        row = next(r for line in f if (r := orjson.loads(line)).get("id") == wanted)
    print(
        f"Trackio trace of step {trace['step']} (reward {trace['metadata']['reward']:.3f}) is record {wanted}"
    )
    print(f"  archive: step {row['step']}, reward {row['sample']['metadata']['reward']:.3f}, in {archive}")


if __name__ == "__main__":
    anyio.run(main)
