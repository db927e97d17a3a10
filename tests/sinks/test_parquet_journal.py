"""ParquetSink's journal appends: a batch's lines written from their pieces, whole, however the
system splits the writes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from asynctrace._records.types import TraceRecord
from asynctrace.sinks import _appends as appends
from asynctrace.sinks import _parquet_rows as rows


def _records(n: int) -> list[TraceRecord]:
    return [
        TraceRecord(f"j-{i}", i // 3, "train", "k", b'{"messages":[],"metadata":{"i":%d}}' % i, 1.0)
        for i in range(n)
    ]


@pytest.mark.parametrize("cap", [None, 7, 4096])
def test_a_batch_is_written_whole_from_its_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap: int | None
) -> None:
    """Pieces past the system's limit per call, and writes cut short at any byte, still append
    exactly the joined lines."""
    records = _records(1500)  # 3001 pieces: more than one writev call can take
    parts, layout = rows.journal_parts(records)
    joined, joined_layout = rows.journal_lines(records)
    assert b"".join(parts) == joined and layout == joined_layout
    if cap is not None:
        writev = os.writev

        def short(fd: int, buffers: Any) -> int:
            # The real call, given at most `cap` bytes: as a system call cut short by a signal.
            out, room = [], cap
            for b in buffers:
                view = memoryview(b)[:room]
                out.append(view)
                room -= len(view)
                if not room:
                    break
            return writev(fd, out)

        monkeypatch.setattr(appends.os, "writev", short)
    path = tmp_path / "journal"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, b"before\n")
        appends.write_all(fd, parts)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"before\n" + joined


def test_a_journal_is_named_only_once_its_header_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the header is written the journal has no name yet, so a kill at that moment leaves no
    header-less journal (which recovery would have to leave in the directory for good)."""
    from asynctrace.sinks import _parquet_journal as journals

    seen: list[bool] = []
    real = journals.write_all

    def watching(fd: int, parts: Any) -> None:
        seen.append(any(p.name.endswith(".journal") for p in tmp_path.iterdir()))
        real(fd, parts)

    monkeypatch.setattr(journals, "write_all", watching)
    journal = journals.create(tmp_path, journals.JournalName("s", 0))
    try:
        assert seen == [False]
        assert journal.path.read_bytes().startswith(b'{"journal":"asynctrace.parquet-journal"')
        with pytest.raises(FileExistsError):
            journals.create(tmp_path, journals.JournalName("s", 0))
        with pytest.raises(journals.LiveJournal):
            journals.open_dead(journal.path)
    finally:
        os.close(journal.fd)
    dead = journals.open_dead(journal.path)
    assert dead is not None and dead.start == journal.start
    os.close(dead.fd)
