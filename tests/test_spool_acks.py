"""The spool's format 2: the watched mark, each sink's own acknowledgements and the tiers'
progress, read back after a restart; format 1 files still read as before."""

from __future__ import annotations

import zlib
from pathlib import Path

import orjson
import pytest

import asynctrace as at
from asynctrace._durable import segments
from asynctrace._durable import spool as spool_module
from asynctrace._durable.spool import Spool
from asynctrace._records.types import TraceRecord
from tests._util import sample

pytestmark = pytest.mark.anyio


def _sealed(obj: dict[str, object], sample_json: bytes | None = None) -> bytes:
    """A line as format 1 wrote it: the object, its sample appended as is, then the CRC."""
    body = orjson.dumps(obj)[:-1]
    if sample_json is not None:
        body += b',"sample":' + sample_json
    return body + b',"c":%d}\n' % zlib.crc32(body)


async def test_a_format_1_segment_reads_and_replays_as_before(tmp_path: Path) -> None:
    """A segment written before the watched mark and sink lines existed: its unacknowledged
    record is replayed, unwatched, to every sink."""
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    payload = orjson.dumps({"messages": [{"role": "user", "content": "q"}], "metadata": {"uid": "u"}})
    head = {
        "t": "h",
        "v": 1,
        "kind": "seg",
        "project": "p",
        "run": "r",
        "session": "old",
        "pid": 1,
        "created": 0.0,
    }
    record = {
        "t": "r",
        "id": "old-1",
        "step": 3,
        "split": "train",
        "key": "train/traces",
        "ts": 1.0,
        "score": None,
    }
    done = dict(record, id="old-2")
    data = (
        _sealed(head)
        + _sealed(record, payload)
        + _sealed(done, payload)
        + _sealed({"t": "a", "ids": ["old-2"]})
    )
    (spool / "seg-00000000000000000001-old-0000.jsonl").write_bytes(data)

    (scan,) = segments.scan_dir(spool).files
    assert scan.problems() is None
    (raw,) = scan.unresolved
    assert (raw.id, raw.watched, raw.done) == ("old-1", False, None)
    (loaded,) = segments.load_records(scan, scan.unresolved)
    assert loaded.watched is False and loaded.sinks_done is None and loaded.replayed

    sinks = [at.testing.MemorySink("a"), at.testing.MemorySink("b")]
    async with at.TraceSession("p", run="r", sinks=sinks, spool_dir=spool) as s:
        pass
    assert [[r.id for r in sink.records] for sink in sinks] == [["old-1"], ["old-1"]]
    assert s.stats().replayed == 1 and s.stats().written == 1
    assert not list(spool.glob("seg-*.jsonl"))


async def test_a_restart_sends_each_record_only_to_the_sinks_that_lack_it(tmp_path: Path) -> None:
    """One sink wrote everything, the other nothing (it hung): the spool says which, with each
    record's watched mark; the next session writes them to the second sink only, and the first
    counts them `skipped["earlier"]`."""
    spool = tmp_path / "spool"
    first = [at.testing.MemorySink("fast"), at.testing.MemorySink("slow", hang=True)]
    watch = at.Watch(ids=["w"])
    async with at.TraceSession(
        "p", run="r", sinks=first, spool_dir=spool, durability="enqueue", watch=watch, finish_timeout=0.5
    ) as s:
        rows = [sample(i) for i in range(5)] + [{"prompt": "q", "response": "a", "prompt_id": "w"}]
        await s.log_samples(rows, step=0)
        assert not await s.flush(timeout=0.5)
    assert len(first[0].records) == 6 and s.stats().pending == 6

    scan = segments.scan_dir(spool)
    unresolved = [r for f in scan.files for r in f.unresolved]
    assert len(unresolved) == 6 and {r.done for r in unresolved} == {frozenset({"fast"})}
    assert sum(r.watched for r in unresolved) == 1

    second = [at.testing.MemorySink("fast"), at.testing.MemorySink("slow")]
    async with at.TraceSession("p", run="r", sinks=second, spool_dir=spool) as s2:
        pass
    assert second[0].records == [] and len(second[1].records) == 6
    assert [r.sample.metadata.get("prompt_id") for r in second[1].records if r.watched] == ["w"]
    stats = s2.stats()
    assert stats.sinks["fast"].skipped == {"earlier": 6} and stats.sinks["slow"].written == 6
    assert stats.written == 6 and stats.check(), stats.summary()
    assert not list(spool.glob("seg-*.jsonl"))


def test_tier_totals_outlive_the_segments_they_were_written_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every new segment starts with the tiers' running totals, and a session's newest segment
    with tier lines stays while any of its records is unresolved, so a replay always finds them."""
    monkeypatch.setattr(spool_module, "SEGMENT_BYTES", 1)  # a new segment for every commit
    directory = tmp_path / "spool"
    spool = Spool(directory, project="p", run="r", session="s1", durability="writer")
    spool.open()

    def record(rid: str, step: int) -> TraceRecord:
        return TraceRecord(rid, step, "train", "k", b"{}", 0.0)

    held = record("held", 9)
    spool.stage([held])
    spool.commit()
    spool.tier("tier", {("train", 9): 2, ("train", 1): 4}, {"train": 3})
    spool.commit()
    spool.tier("tier", {("train", 9): 1}, {})
    spool.commit()
    for i in range(4):  # later segments, each resolved and deleted
        other = record(f"r{i}", 10)
        spool.stage([other])
        spool.commit()
        spool.resolve([other])
        spool.commit()
    tiers = segments.scan_dir(directory).tiers(("p", "r"))
    # Step 1 is closed (3 and below): its count is no longer kept.
    assert tiers.written == {"tier": {("train", 9): 3}} and tiers.closed == {"tier": {"train": 3}}
    spool.close()
    assert segments.scan_dir(directory).tiers(("p", "r")).written == {"tier": {("train", 9): 3}}

    # Once nothing is unresolved, nothing is kept.
    again = Spool(directory, project="p", run="r", session="s2", durability="writer")
    scan = again.open()
    (records,) = list(again.backlog(scan, lambda f: True))
    again.resolve(records)
    again.close()
    assert not list(directory.glob("seg-*.jsonl"))
