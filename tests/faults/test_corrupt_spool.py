"""Torn and corrupted spool files: `asynctrace recover` reports them, skips them, and delivers the rest."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import anyio

from asynctrace._durable import segments
from tests._util import sample, stuck_spool_session
from tests.faults import _harness as h


def _leave_unacknowledged(project: str, spool: Path, steps: int) -> None:
    """A session whose only sink never answers leaves everything it logged in the spool."""

    async def main() -> None:
        async with stuck_spool_session(spool, project) as session:
            for step in range(steps):
                await session.log_samples([sample(i, step=step) for i in range(20)], step=step)

    anyio.run(main)


def test_recover_reports_and_skips_torn_and_corrupt_lines_and_files(tmp_path: Path, trackio_dir: str) -> None:
    """A torn last line, a corrupted line and a file with no valid header are reported and skipped."""
    project = f"corrupt-{uuid.uuid4().hex[:8]}"
    spool = tmp_path / "spool"
    _leave_unacknowledged(project, spool, steps=5)
    (segment,) = spool.glob("seg-*.jsonl")
    lines = segment.read_bytes().split(b"\n")
    # lines: header, 100 records, "" after the last newline.
    assert len(lines) == 102
    corrupted = bytearray(lines[10])
    corrupted[len(corrupted) // 2] ^= 0x20  # one flipped bit inside a sample: JSON-valid, CRC-invalid
    lines[10] = bytes(corrupted)
    torn = lines[100][: len(lines[100]) // 2]  # the kill came in the middle of the last write
    segment.write_bytes(b"\n".join([*lines[:100], torn]))
    garbage = spool / "seg-00000000000000000001-deadbeef0000-0000.jsonl"
    garbage.write_bytes(os.urandom(3000))

    rec = h.recover(str(spool))
    assert rec.returncode == 1, rec.stdout + rec.stderr  # the corrupt line lost a record
    assert "98 replayed, 98 written" in rec.stdout
    assert "a torn last line" in rec.stdout and "1 corrupt line(s)" in rec.stdout
    assert f"{garbage.name}: no valid header" in rec.stdout
    # The unreadable file is set aside for inspection, never deleted; the rest is cleaned up.
    assert not garbage.exists() and garbage.with_name(garbage.name + ".corrupt").exists()
    assert not list(spool.glob("seg-*.jsonl"))
    uids = h.trackio_uids(project, "r")
    assert len(uids) == 98 and max(uids.values()) == 1
    lost = {f"{s}:{i}" for s in range(5) for i in range(20)} - set(uids)
    assert len(lost) == 2


def test_scan_never_raises_on_garbage(tmp_path: Path) -> None:
    """Reading a spool of empty, binary and half-written files reports problems instead of raising."""
    (tmp_path / "seg-1-x-0000.jsonl").write_bytes(b"")
    (tmp_path / "seg-2-x-0000.jsonl").write_bytes(b'{"t":"h"')
    (tmp_path / "seg-3-x-0000.jsonl").write_bytes(b"\x00\xff" * 100 + b"\n" * 3)
    (tmp_path / "dead-4-x-0000.jsonl").write_bytes(b'{"t":"a","ids":[1],"c":5}\n')
    scan = segments.scan_dir(tmp_path)
    assert len(scan.files) == 4 and scan.pending() == 0
    # An empty file is a segment created just before a kill: nothing was lost, nothing to report.
    assert {name for name, _ in scan.problems} == {f.name for f in scan.files} - {"seg-1-x-0000.jsonl"}
