"""`asynctrace recover` on the command line: its summary and its exit status."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

import asynctrace as at
from asynctrace.cli import main
from tests import _recover_spools as rs
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


def _unreadable(spool: Path, session: str, case: str) -> None:
    path = spool / f"setup-{session}.json"
    if case == "not JSON":
        path.write_bytes(b'{"v": 2, "session": ')
    elif case == "another session's":
        path.write_bytes(path.read_bytes().replace(session.encode(), b"0123456789ab"))
    else:
        path.unlink()
        path.symlink_to(spool.parent / "elsewhere.json")
        (spool.parent / "elsewhere.json").write_bytes(b"{}")


@pytest.mark.parametrize("case", ["not JSON", "another session's", "a link"])
def test_recover_exits_1_and_keeps_the_records_of_a_session_whose_setup_is_unreadable(
    tmp_path: Path, project: str, case: str
) -> None:
    """A setup file that is damaged, names another session, or is a link: its session's records
    are not sent anywhere (Trackio included) but kept, the file named; exit status 1."""
    spool = tmp_path / "spool"
    _unreadable(spool, rs.leave(spool, project=project), case)
    result = CliRunner().invoke(main, ["recover", str(spool), "--no-progress"])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert f"{project}/r: 5 records not replayed, kept in the spool: setup-" in result.output, result.output
    assert "unreadable sink setup" in result.output
    assert read_traces(project, "r") == [] and list(spool.glob("seg-*.jsonl"))


def test_recover_exits_1_and_keeps_the_records_when_a_sink_cannot_be_made_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A setup's ParquetSink on a machine without pyarrow: not made, its session's records kept
    for when the extra is installed, the reason given; exit status 1."""
    spool = tmp_path / "spool"
    spec = {"name": "parquet", "kind": "parquet", "args": {"directory": str(tmp_path)}}
    rs.set_sinks(spool, rs.leave(spool), [spec])
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as where the extra is not installed
    result = CliRunner().invoke(main, ["recover", str(spool), "--no-progress"])
    assert result.exit_code == 1, result.output
    assert (
        "p/r: 5 records not replayed, kept in the spool: sink 'parquet': ImportError: ParquetSink needs"
        in (result.output)
    )


_KILLED_WITH_A_JOURNAL = """
import os, signal, sys
import asynctrace as at

archive, spool = sys.argv[1], sys.argv[2]
with at.TraceSession("p", run="r", sinks=[at.ParquetSink(archive)], spool_dir=spool) as s:
    s.log_samples([{"prompt": f"q{i}", "response": "a", "uid": f"0:{i}"} for i in range(10)], step=0)
    assert s.flush(timeout=30)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def killed_with_a_journal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run killed after its ParquetSink wrote 10 rows to its journal (no file yet)."""
    from tests.faults import _harness as h

    root = tmp_path_factory.mktemp("journal")
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_WITH_A_JOURNAL, str(root / "archive"), str(root / "spool")],
        env=h.env(), cwd=h.ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -9, child.stderr
    return root


@pytest.mark.parametrize("damage", [b"{not json", b'{"id": "x-1", "step": 0}'])
def test_recover_on_a_damaged_journal_names_its_archive_and_exits_1(
    tmp_path: Path, killed_with_a_journal: Path, damage: bytes
) -> None:
    """A killed ParquetSink's journal with a line of bad JSON, or one lacking its sample: the
    command prints its summary naming the archive, and exits 1, never with a traceback, and
    never 2 (the spool itself is fine)."""
    from tests.faults import _harness as h

    shutil.copytree(killed_with_a_journal, tmp_path, dirs_exist_ok=True)
    (setup,) = (tmp_path / "spool").glob("setup-*.json")  # its archive is the copy's
    setup.write_bytes(setup.read_bytes().replace(str(killed_with_a_journal).encode(), str(tmp_path).encode()))
    archive = tmp_path / "archive"
    (journal,) = archive.glob(".*.journal")
    lines = journal.read_bytes().split(b"\n")
    lines[4] = damage
    journal.write_bytes(b"\n".join(lines))
    result = h.recover(str(tmp_path / "spool"))
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith(f"asynctrace recover {tmp_path / 'spool'}")
    assert str(archive) in result.stdout, result.stdout
