"""JsonlSink and ConsoleSink: line format, rotation, truncation, metrics."""

from __future__ import annotations

import io
from pathlib import Path

import orjson
import pytest

import asynctrace as at
from tests._util import sample

pytestmark = pytest.mark.anyio


async def test_jsonl_lines_hold_record_fields_and_sample(tmp_path: Path) -> None:
    """Each JSONL line holds id, step, split, key, timestamp and the sample as submitted."""
    sink = at.JsonlSink(tmp_path / "traces.jsonl")
    async with at.TraceSession("p", sinks=[sink]) as s:
        await s.log_samples([sample(i) for i in range(3)], step=7, split="eval")
        await s.log_metrics({"reward/mean": 0.5}, step=7)
    lines = [orjson.loads(line) for line in (tmp_path / "traces.jsonl").read_bytes().splitlines()]
    traces = [line for line in lines if "sample" in line]
    assert [t["sample"]["metadata"]["uid"] for t in traces] == ["0:0", "0:1", "0:2"]
    assert all(t["step"] == 7 and t["split"] == "eval" and t["key"] == "eval/traces" for t in traces)
    assert len({t["id"] for t in traces}) == 3 and all(isinstance(t["timestamp"], float) for t in traces)
    assert traces[0]["sample"]["messages"][0] == {"role": "user", "content": "question 0 of step 0"}
    assert {"step": 7, "metrics": {"reward/mean": 0.5}} in lines


async def test_jsonl_rotates_every_n_records(tmp_path: Path) -> None:
    """rotate_every=N starts a new numbered file every N records, none lost or repeated."""
    sink = at.JsonlSink(tmp_path / "t.jsonl", rotate_every=4)
    async with at.TraceSession("p", sinks=[sink], batch_size=3) as s:
        for step in range(5):
            await s.log_samples([sample(i, step=step) for i in range(2)], step=step)
    files = sorted(tmp_path.glob("t.*.jsonl"))
    assert [f.name for f in files] == ["t.00000.jsonl", "t.00001.jsonl", "t.00002.jsonl"]
    counts = [len(f.read_bytes().splitlines()) for f in files]
    assert counts == [4, 4, 2]
    ids = [orjson.loads(line)["id"] for f in files for line in f.read_bytes().splitlines()]
    assert len(set(ids)) == 10


async def test_console_sink_is_readable_and_truncated() -> None:
    """ConsoleSink prints a header per trace and clips long messages to max_chars."""
    out = io.StringIO()
    async with at.TraceSession("p", sinks=[at.ConsoleSink(out, max_chars=200)]) as s:
        await s.log_samples([{"prompt": "short question", "response": "z" * 5000, "reward": 1.0}], step=2)
    text = out.getvalue()
    assert "train/traces step 2" in text and "short question" in text
    assert "more chars]" in text and len(text) < 1000


async def test_jsonl_escapes_unusual_ids_and_names(tmp_path: Path) -> None:
    """Record ids, splits and keys that need JSON escaping still give valid lines."""
    from asynctrace._record import TraceRecord

    sink = at.JsonlSink(tmp_path / "odd.jsonl")
    await sink.open()
    ids = ['a"b', "c\\d", "é-1", "plain-2"]
    await sink.write([TraceRecord(i, 1, 'sp"lit', "k\\ey", b'{"messages":[]}', 1.5) for i in ids])
    await sink.close()
    lines = [orjson.loads(line) for line in (tmp_path / "odd.jsonl").read_bytes().splitlines()]
    assert [line["id"] for line in lines] == ids
    assert all(line["split"] == 'sp"lit' and line["key"] == "k\\ey" for line in lines)


async def test_jsonl_fsync_covers_every_file_a_batch_touches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With fsync and rotation, a file rolled away from in the middle of a batch is synced too."""
    import os

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    sink = at.JsonlSink(tmp_path / "t.jsonl", rotate_every=4, fsync=True)
    async with at.TraceSession("p", sinks=[sink], batch_size=10) as s:
        await s.log_samples([sample(i) for i in range(10)], step=0)
    assert [p.name for p in sink.paths] == ["t.00000.jsonl", "t.00001.jsonl", "t.00002.jsonl"]
    assert set(synced) == {"t.00000.jsonl", "t.00001.jsonl", "t.00002.jsonl"}
