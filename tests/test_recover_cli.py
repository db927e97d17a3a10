"""`asynctrace recover` on the command line: its summary and its exit status."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

import asynctrace as at
from asynctrace.cli import main
from tests._util import read_traces, sample


def test_recover_delivers_a_spool_and_prints_a_summary(tmp_path: Path, project: str) -> None:
    """Records left in a spool are delivered; the summary says how many; exit status 0."""
    spool = tmp_path / "spool"
    with at.TraceSession(
        project, run="r", sinks=[at.testing.MemorySink(hang=True)], spool_dir=spool, finish_timeout=0.2
    ) as s:
        s.log_samples([sample(i) for i in range(6)], step=0)
    result = CliRunner().invoke(main, ["recover", str(spool), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert f"{project}/r: 6 replayed, 6 written" in result.output
    assert len(read_traces(project, "r")) == 6
    again = CliRunner().invoke(main, ["recover", str(spool), "--no-progress"])
    assert again.exit_code == 0 and "nothing to replay" in again.output


def test_recover_refuses_a_spool_in_use_or_missing(tmp_path: Path) -> None:
    """A spool held by a live session, or no spool at all, is exit status 2 with a clear message."""
    spool = tmp_path / "spool"
    with at.TraceSession("p", run="r", sinks=[at.testing.MemorySink()], spool_dir=spool):
        result = CliRunner().invoke(main, ["recover", str(spool), "--no-progress"])
    assert result.exit_code == 2 and "in use by another session" in result.output
    missing = CliRunner().invoke(main, ["recover", str(tmp_path / "nope"), "--no-progress"])
    assert missing.exit_code == 2 and "no spool directory" in missing.output


def test_recover_says_why_records_could_not_be_delivered(
    tmp_path: Path, project: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When Trackio cannot store anything, the summary gives the sink's error, not only a count."""
    spool = tmp_path / "spool"
    with at.TraceSession(
        project, run="r", sinks=[at.testing.MemorySink(hang=True)], spool_dir=spool, finish_timeout=0.2
    ) as s:
        s.log_samples([sample(i) for i in range(6)], step=0)
    # The writer process reads TRACKIO_DIR from the environment it inherits: a path under a file.
    (tmp_path / "afile").touch()
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "afile" / "sub"))
    result = CliRunner().invoke(main, ["recover", str(spool), "--no-progress"])
    assert result.exit_code == 1, result.output
    assert f"{project}/r: 6 replayed, 0 written, 6 failed (kept as dead letters)" in result.output
    assert "trackio failed: " in result.output and "Not a directory" in result.output


def test_recover_on_an_unusable_spool_is_a_clear_error(tmp_path: Path) -> None:
    """A spool whose lock file cannot be opened is exit status 2 with a message, not a traceback;
    a session on it gets SpoolError."""
    spool = tmp_path / "spool"
    (spool / ".lock").mkdir(parents=True)  # os.open fails: a directory where the lock file goes
    result = CliRunner().invoke(main, ["recover", str(spool), "--no-progress"])
    assert result.exit_code == 2 and "cannot lock the spool directory" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    session = at.TraceSession("p", run="r", sinks=[at.testing.MemorySink()], spool_dir=spool)
    with pytest.raises(at.SpoolError, match="cannot lock"), session:
        pass


def test_recover_exits_1_while_dead_letters_remain(tmp_path: Path, project: str) -> None:
    """Without --dead-letters, records kept as dead letters are still undelivered: exit status 1."""

    class Refusing(at.Sink):
        name = "refusing"

        async def write(self, records: object) -> None:
            raise at.PermanentSinkError("nope")

    spool = tmp_path / "spool"
    with at.TraceSession(project, run="r", sinks=[Refusing()], spool_dir=spool) as s:
        s.log_samples([sample(i) for i in range(3)], step=0)
    assert s.stats().failed == 3
    result = CliRunner().invoke(main, ["recover", str(spool), "--no-progress"])
    assert result.exit_code == 1, result.output
    assert "3 dead letters remain" in result.output


def _leave_in_spool(spool: Path, project: str, n: int) -> list[bytes]:
    """Leaves `n` unacknowledged records in one segment; returns its lines (header first)."""
    with at.TraceSession(
        project, run="r", sinks=[at.testing.MemorySink(hang=True)], spool_dir=spool, finish_timeout=0.2
    ) as s:
        s.log_samples([sample(i) for i in range(n)], step=0)
    (segment,) = spool.glob("seg-*.jsonl")
    return segment.read_bytes().split(b"\n")[:-1]


def test_recover_exits_1_when_a_corrupt_line_lost_a_record(tmp_path: Path, project: str) -> None:
    """A record on a corrupt line is skipped and lost, so recover exits 1, not 0."""
    spool = tmp_path / "spool"
    lines = _leave_in_spool(spool, project, 6)
    bad = bytearray(lines[3])
    bad[len(bad) // 2] ^= 0x20  # one flipped bit inside a sample: the CRC no longer matches
    lines[3] = bytes(bad)
    (segment,) = spool.glob("seg-*.jsonl")
    segment.write_bytes(b"".join(line + b"\n" for line in lines))
    result = CliRunner().invoke(main, ["recover", str(spool), "--no-progress"])
    assert result.exit_code == 1, result.output
    assert f"{project}/r: 5 replayed, 5 written" in result.output
    assert "1 corrupt line(s) skipped" in result.output
    assert len(read_traces(project, "r")) == 5


class _FirstThenHang(at.Sink):
    """Writes its first batch, then hangs: that batch is acknowledged in the spool, the rest not."""

    name = "first-then-hang"

    def __init__(self) -> None:
        self.writes = 0

    async def write(self, records: Any) -> None:
        self.writes += 1
        if self.writes > 1:
            await anyio.sleep(3600)


def test_recover_exits_0_when_only_an_acknowledgement_line_was_corrupt(tmp_path: Path, project: str) -> None:
    """A corrupt acknowledgement loses nothing (its records are replayed): reported, and exit 0."""
    spool = tmp_path / "spool"
    with at.TraceSession(
        project, run="r", sinks=[_FirstThenHang()], spool_dir=spool, finish_timeout=0.3, flush_interval=0.01
    ) as s:
        s.log_samples([sample(i) for i in range(3)], step=0)
        assert s.flush(timeout=10)
        s.log_samples([sample(i) for i in range(3, 6)], step=1)
    (segment,) = spool.glob("seg-*.jsonl")
    lines = segment.read_bytes().split(b"\n")[:-1]
    (i,) = [k for k, line in enumerate(lines) if line.startswith(b'{"t":"a"')]
    bad = bytearray(lines[i])
    bad[-3] ^= 0x01  # inside its checksum: the line no longer verifies
    lines[i] = bytes(bad)
    segment.write_bytes(b"".join(line + b"\n" for line in lines))
    result = CliRunner().invoke(main, ["recover", str(spool), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert f"{project}/r: 6 replayed, 6 written" in result.output
    assert "1 corrupt line(s) skipped" in result.output


def test_recover_exits_1_when_a_file_without_a_header_held_records(tmp_path: Path, project: str) -> None:
    """Records in a segment whose header is damaged cannot be delivered: exit 1, the file kept aside."""
    spool = tmp_path / "spool"
    lines = _leave_in_spool(spool, project, 4)
    (segment,) = spool.glob("seg-*.jsonl")
    segment.write_bytes(b"".join(line + b"\n" for line in lines[1:]))  # the header is gone
    result = CliRunner().invoke(main, ["recover", str(spool), "--no-progress"])
    assert result.exit_code == 1, result.output
    assert "nothing to replay" in result.output and "no valid header" in result.output
    assert segment.with_name(segment.name + ".corrupt").exists()


def test_recover_exits_0_when_only_a_torn_last_line_was_skipped(tmp_path: Path, project: str) -> None:
    """A torn last line is the write a kill cut short, not a loss: reported, and exit 0."""
    spool = tmp_path / "spool"
    lines = _leave_in_spool(spool, project, 6)
    (segment,) = spool.glob("seg-*.jsonl")
    torn = lines[-1][: len(lines[-1]) // 2]
    segment.write_bytes(b"".join(line + b"\n" for line in lines[:-1]) + torn)
    result = CliRunner().invoke(main, ["recover", str(spool), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert f"{project}/r: 5 replayed, 5 written" in result.output and "a torn last line" in result.output


@pytest.mark.parametrize("flag", ["--project", "--run"])
def test_recover_refuses_a_name_trackio_cannot_store(tmp_path: Path, flag: str) -> None:
    """A bad --project or --run is a usage error naming the option, before the spool is touched."""
    spool = tmp_path / "spool"
    result = CliRunner().invoke(main, ["recover", str(spool), flag, "a/b", "--no-progress"])
    assert result.exit_code == 2 and flag in result.output, result.output
    assert not spool.exists()
    empty = CliRunner().invoke(main, ["recover", str(spool), flag, " ", "--no-progress"])
    assert empty.exit_code == 2 and "must not be empty" in empty.output
