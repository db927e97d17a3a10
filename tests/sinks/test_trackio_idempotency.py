"""Trackio replays are idempotent per record id, whatever the batch composition was, on the
private commit and on the public path alike."""

from __future__ import annotations

import contextlib
import io
import uuid
from collections.abc import Iterator

import orjson
import pytest

from asynctrace.sinks._trackio_logids import decode_record_id
from asynctrace.sinks._trackio_writer import TrackioWriter, WriteItem, stored_record_ids
from tests._util import read_traces
from tests.sinks._trackio_public import change_bulk_log


def _item(
    prefix: str, n: int, step: int = 0, *, replayed: bool = False, key: str = "train/traces"
) -> WriteItem:
    payload = orjson.dumps({"messages": [{"role": "user", "content": f"{prefix}-{n}"}], "metadata": {"n": n}})
    return WriteItem(f"{prefix}-{n}", step, key, payload, replayed, 1.7e9)


@pytest.fixture(params=["private", "public"])
def writer(
    request: pytest.FixtureRequest, project: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[TrackioWriter]:
    if request.param == "public":
        change_bulk_log(monkeypatch)
    w = TrackioWriter(project, "r", seal_writes=True)
    with contextlib.redirect_stdout(io.StringIO()):
        w.open()
    assert w.path == request.param
    yield w
    with contextlib.redirect_stdout(io.StringIO()):
        w.finish()


def test_decode_record_id() -> None:
    """A trace's log id and index name exactly one record id; other log ids are not ours."""
    assert decode_record_id("0123abc-at-abc-10", 1) == "abc-11"
    assert decode_record_id("at-abc-10", 0) == "abc-10"
    assert decode_record_id("at-abc-10", 3) == "abc-13"
    assert decode_record_id("at-a-b-7", 1) == "a-b-8"
    assert decode_record_id("at-odd", 0) == "odd"
    assert decode_record_id("at-odd", 2) is None
    assert decode_record_id("7f3a9c", 0) is None and decode_record_id(None, 0) is None
    assert decode_record_id("atm-7f3a9c", 0) is None and decode_record_id("0123abc-atm-x", 0) is None


def test_replay_with_another_composition_skips_what_is_stored(writer: TrackioWriter, project: str) -> None:
    """A replay overlapping an earlier write, split differently, writes only the records not yet stored."""
    prefix = uuid.uuid4().hex[:12]
    assert writer.write([_item(prefix, n) for n in range(10)]) == 0
    replay = [_item(prefix, n, replayed=True) for n in range(3, 13)]
    assert writer.write(replay) == 7
    ids = stored_record_ids(project, writer.run.id)
    assert ids == {f"{prefix}-{n}" for n in range(13)}
    # A second identical replay writes nothing at all.
    assert writer.write(replay) == 10
    with contextlib.redirect_stdout(io.StringIO()):
        writer.finish()
    assert len(read_traces(project, "r")) == 13, "every record stored exactly once"


def test_gaps_steps_and_keys_each_map_back_to_their_record(writer: TrackioWriter, project: str) -> None:
    """Records with gaps in their ids, of several steps and keys in one batch, decode to their own ids."""
    prefix = uuid.uuid4().hex[:12]
    items = [
        _item(prefix, 0, 1),
        _item(prefix, 2, 1),
        _item(prefix, 3, 2),
        _item(prefix, 4, 1, key="eval/traces"),
        _item(prefix, 5, 1),
        _item("other", 1, 1),
    ]
    writer.write(items)
    assert stored_record_ids(project, writer.run.id) == {i.record_id for i in items}
    assert stored_record_ids(project, writer.run.id, steps=[2]) == {f"{prefix}-3"}
    assert writer.write([i._replace(replayed=True) for i in items]) == len(items)


def test_looking_up_many_steps_fits_old_sqlite_limits(
    writer: TrackioWriter, project: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replayed batch spanning more steps than SQLite before 3.32 allows parameters (999) is
    still checked against what is stored, and skipped where it is."""
    import sqlite3

    prefix = uuid.uuid4().hex[:12]
    items = [_item(prefix, n, step=n) for n in range(1200)]
    writer.write(items)
    connect = sqlite3.connect

    def limited(*args: object, **kwargs: object) -> sqlite3.Connection:
        conn = connect(*args, **kwargs)  # type: ignore[arg-type]
        conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
        return conn

    monkeypatch.setattr(sqlite3, "connect", limited)
    assert stored_record_ids(project, writer.run.id, steps=range(1200)) == {i.record_id for i in items}
    assert writer.write([i._replace(replayed=True) for i in items]) == len(items)


def test_a_sample_carrying_another_records_id_is_stored_under_its_own(
    writer: TrackioWriter, project: str
) -> None:
    """A sample whose metadata names an earlier record (`asynctrace_id`, as when traces are
    logged again from an export) is stored, and found again, under its own record id."""
    prefix = uuid.uuid4().hex[:12]
    payload = orjson.dumps(
        {"messages": [{"role": "user", "content": "q"}], "metadata": {"asynctrace_id": "old-1"}}
    )
    item = WriteItem(f"{prefix}-0", 0, "train/traces", payload, False, 1.7e9)
    assert writer.write([item]) == 0
    assert stored_record_ids(project, writer.run.id) == {item.record_id}
    assert writer.write([item._replace(replayed=True)]) == 1
