"""What Trackio's Traces tab shows of our traces: a distinct id chip each, the record id, status, latency."""

from __future__ import annotations

import math
import re
from importlib import resources
from typing import Any

import pytest

import asynctrace as at
from asynctrace.sinks._trackio_logids import decode_record_id, log_id_for
from asynctrace.sinks._trackio_traces import dashboard_metadata
from asynctrace.testing import MemorySink
from tests._util import read_traces, sample


def _chip(trace_id: str) -> str:
    """The id chip the Traces tab shows for a trace id (Trackio's `traceHash` and `traceIndex`)."""
    parts = trace_id.split(":")
    source = (parts[1] or parts[0]) if len(parts) >= 4 else trace_id
    head = re.sub(r"[^a-zA-Z0-9]", "", source)[:7] or source[:7]
    index = parts[-1] if len(parts) >= 4 and parts[-1].isdigit() else None
    return head if index is None else f"{head}:{index}"


def test_chip_mirrors_the_installed_dashboard() -> None:
    """The chip rule above is the one the installed Trackio's Traces tab applies."""
    page = resources.files("trackio").joinpath("frontend/src/pages/Traces.svelte").read_text()
    body = page[page.index("function traceHash(") : page.index("function traceIndex(")]
    assert "const source = parts.length >= 4 ? parts[1] || parts[0] : String(id);" in body
    assert 'source.replace(/[^a-zA-Z0-9]/g, "").slice(0, 7)' in body
    assert "{traceHash(trace.id)}{traceIndex(trace.id) !== null" in page


@pytest.mark.anyio
async def test_every_trace_gets_its_own_chip_and_names_its_record(project: str) -> None:
    """Traces of several calls, steps and two sessions appending to one run each show a distinct
    chip, and each carries the id under which every other sink got the same record."""
    memory = MemorySink()
    for session_round in range(2):
        sinks: list[at.Sink] = [at.TrackioSink(process=False), memory]
        async with at.TraceSession(project, run="r", sinks=sinks) as session:
            for step in range(3):
                for call in range(2):
                    batch = [sample(10 * call + i, step=step) for i in range(6)]
                    await session.log_samples(batch, step=10 * session_round + step)
        assert session.stats().written == 36
    traces = read_traces(project, "r")
    assert len(traces) == 72
    chips = [_chip(t["id"]) for t in traces]
    assert len(set(chips)) == len(chips), sorted(chips)
    assert not any(c.startswith("at") for c in chips)
    shown = [t["metadata"]["asynctrace_id"] for t in traces]
    assert sorted(shown) == sorted(r.id for r in memory.records)
    for t in traces:
        # The row itself decodes to the same record, which is what makes replays idempotent.
        log_id, index = t["id"].split(":")[1], int(t["id"].split(":")[-1])
        assert decode_record_id(log_id, index) == t["metadata"]["asynctrace_id"]


@pytest.mark.anyio
async def test_status_and_latency_columns_come_from_the_sample(project: str) -> None:
    """A truncated completion shows as `truncated`, its generation time as `duration_ms`; what the
    sample sets itself wins."""
    samples = [
        sample(0, stop_reason="length", generation_time=1.25),
        sample(1, stop_reason="stop", generation_ms=80),
        sample(2, finish_reason="tool_use", status="rejected", duration_ms=5),
        sample(3),
    ]
    async with at.TraceSession(project, run="r", sinks=[at.TrackioSink(process=False)]) as session:
        await session.log_samples(samples, step=0)
    by_uid = {t["metadata"]["uid"]: t["metadata"] for t in read_traces(project, "r")}
    assert (by_uid["0:0"]["status"], by_uid["0:0"]["duration_ms"]) == ("truncated", 1250.0)
    assert (by_uid["0:1"]["status"], by_uid["0:1"]["duration_ms"]) == ("success", 80.0)
    assert (by_uid["0:2"]["status"], by_uid["0:2"]["duration_ms"]) == ("rejected", 5)
    assert "status" not in by_uid["0:3"] and "duration_ms" not in by_uid["0:3"]


@pytest.mark.parametrize(
    ("metadata", "status", "duration"),
    [
        ({"stop_reason": "length"}, "truncated", None),
        ({"stop_reason": "ABORT"}, "aborted", None),
        ({"finish_reason": "tool_calls"}, "tool_calls", None),
        ({"stop_reason": "x" * 100}, "x" * 40, None),
        ({"stop_reason": 3}, None, None),
        ({"stop_reason": ""}, None, None),
        ({"generation_time": 0.5}, None, 500.0),
        ({"generation_time_s": 2}, None, 2000.0),
        ({"generation_time": math.nan, "generation_ms": 7}, None, 7.0),
        ({"generation_time": -1.0}, None, None),
        ({"generation_time": True}, None, None),
        ({"generation_time": "1.5"}, None, None),
        ({"generation_time": 0.5, "latency_ms": 9}, None, None),
    ],
)
def test_dashboard_metadata(metadata: dict[str, Any], status: str | None, duration: float | None) -> None:
    """Only a usable stop reason sets a status, only a finite non-negative number a duration."""
    out = dashboard_metadata("p-1", metadata)
    assert out["asynctrace_id"] == "p-1"
    assert out.get("status") == status
    assert out.get("duration_ms") == duration
    assert {k: out[k] for k in metadata} == metadata


def test_asynctrace_id_is_always_the_record_id() -> None:
    """`asynctrace_id` names the record even where the sample set one of its own (a sample
    re-logged from an earlier run's traces, say), whose value is kept beside it: the sink finds
    its traces by that key."""
    assert dashboard_metadata("p-2", {"asynctrace_id": "old-7", "n": 1}) == {
        "asynctrace_id": "p-2",
        "asynctrace_id_logged": "old-7",
        "n": 1,
    }
    assert dashboard_metadata("p-2", {"asynctrace_id": "p-2"}) == {"asynctrace_id": "p-2"}


def test_log_ids_decode_back_to_their_records() -> None:
    """A trace's log id and index name exactly one record id, in today's and the earlier form."""
    assert log_id_for("abc-10").endswith("-at-abc-10") and len(log_id_for("abc-10")) == 7 + 10
    assert decode_record_id(log_id_for("abc-10"), 0) == "abc-10"
    assert decode_record_id(log_id_for("abc-10"), 3) == "abc-13"
    assert decode_record_id(log_id_for("0a1b2c3-at-x-4"), 1) == "0a1b2c3-at-x-5"
    assert decode_record_id("at-abc-10", 2) == "abc-12"
    # Consecutive entries of a session get consecutive, so distinct, tags.
    tags = {log_id_for(f"3f9c0a1b2d4e-{n}")[:7] for n in range(10_000)}
    assert len(tags) == 10_000
