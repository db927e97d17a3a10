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


def _expected_jsonl_parts(n: int) -> list[bytes]:
    return [b'{"i":%d,"pad":"%s"}\n' % (i, b"x" * (i % 97)) for i in range(n)]


@pytest.mark.parametrize("short", [True, False], ids=["short-writes", "no-writev"])
async def test_jsonl_writes_every_byte_in_order_however_the_kernel_takes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, short: bool
) -> None:
    """A write cut short (or a platform without writev) still lands every piece once, in order,
    across more pieces than one writev call takes."""
    import os

    from asynctrace.sinks import _jsonl

    calls = []
    if short:
        # A real write of at most 1000 bytes per call, as when a signal cuts a writev short.
        def short_writev(fd: int, buffers: list[bytes | memoryview]) -> int:
            calls.append(len(buffers))
            return os.write(fd, b"".join(buffers)[:1000])

        monkeypatch.setattr(_jsonl, "_writev", short_writev)
    else:
        monkeypatch.setattr(_jsonl, "_writev", None)
    parts = _expected_jsonl_parts(2500)  # more than _IOV_MAX pieces
    path = tmp_path / "raw.jsonl"
    with open(path, "ab", buffering=0) as f:
        _jsonl._write_all(f, parts)
    assert path.read_bytes() == b"".join(parts)
    if short:
        assert len(calls) > 3 and max(calls) <= _jsonl._IOV_MAX
