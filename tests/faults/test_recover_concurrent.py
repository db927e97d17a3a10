"""`asynctrace recover` against other processes on the same spool: it holds the directory from
start to end, so a second recover or a trainer is refused (exit status 2, `SpoolError`), never let in
between two of its sessions, and every record is delivered once."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests import _recover_spools as rs
from tests.faults import _harness as h


def _two_runs(tmp_path: Path) -> tuple[Path, Path]:
    """A spool holding 5 records of each of two runs, both for one JSONL file."""
    spool, out = tmp_path / "spool", tmp_path / "out.jsonl"
    for run in ("r1", "r2"):
        rs.set_sinks(spool, rs.leave(spool, run), [rs.jsonl(out)])
    return spool, out


@contextlib.contextmanager
def _lock_file(spool: Path) -> Iterator[int]:
    fd = os.open(spool / ".lock", os.O_RDWR)
    try:
        yield fd
    finally:
        os.close(fd)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def test_a_session_racing_recover_never_gets_the_spool_between_its_sessions(tmp_path: Path) -> None:
    """Another process taking the spool's lock the moment it is free while recover runs gets it
    only once recover is done: recover delivers both runs, exits 0, and prints no traceback."""
    spool, out = _two_runs(tmp_path)
    recover = h.start_recover(str(spool))
    with _lock_file(spool) as fd:
        # Wait until recover holds the lock, then take it the first moment it is free, as a
        # trainer (or a second recover) started meanwhile would.
        deadline = time.monotonic() + 60
        while _try_lock(fd):
            fcntl.flock(fd, fcntl.LOCK_UN)
            assert recover.poll() is None and time.monotonic() < deadline, "recover never took the lock"
            time.sleep(0.001)
        while not _try_lock(fd):
            assert time.monotonic() < deadline, "recover kept the lock"
            time.sleep(0.0002)
        try:
            stdout, stderr = recover.communicate(timeout=1.0)  # the lock stays taken meanwhile
        except subprocess.TimeoutExpired:
            fcntl.flock(fd, fcntl.LOCK_UN)
            stdout, stderr = recover.communicate(timeout=120)
    assert "Traceback" not in stderr, stderr
    assert recover.returncode == 0, stdout + stderr
    assert "p/r1: 5 replayed, 5 written" in stdout and "p/r2: 5 replayed, 5 written" in stdout, stdout
    assert rs.uids(out) == {f"{run}/0:{i}": 1 for run in ("r1", "r2") for i in range(5)}


def test_four_recovers_at_once_deliver_once_and_refuse_with_status_2(tmp_path: Path) -> None:
    """Four recovers started 3 ms apart: each exits 0 or, refused because another holds the
    spool, 2 with the reason and its summary, never a traceback; the records land once."""
    spool, out = _two_runs(tmp_path)
    procs = []
    for _ in range(4):
        procs.append(h.start_recover(str(spool)))
        time.sleep(0.003)
    results = [(*p.communicate(timeout=120), p.returncode) for p in procs]
    for stdout, stderr, status in results:
        assert "Traceback" not in stderr and status in (0, 2), stdout + stderr
        assert stdout.startswith(f"asynctrace recover {spool}"), stdout
        if status == 2:
            assert "is in use by another session" in stderr, stderr
    assert sum(stdout.count("5 replayed") for stdout, _, _ in results) == 2, results
    assert rs.uids(out) == {f"{run}/0:{i}": 1 for run in ("r1", "r2") for i in range(5)}
