"""Helpers for the fault-injection tests: start the trainer, read back what reached Trackio."""

from __future__ import annotations

import collections
import os
import select
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).with_name("_trainer.py")


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), out.get("PYTHONPATH", "")) if p)
    out["PYTHONUNBUFFERED"] = "1"
    return out


def start_trainer(*args: str, stderr: Any = subprocess.PIPE) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(TRAINER), *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=env(),
        cwd=ROOT,
    )


def wait_ready(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Block until the trainer printed ``ready`` (its session is open)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line.strip() == b"ready":
                return
            if not line and proc.poll() is not None:
                break
    raise AssertionError(f"trainer did not become ready (rc={proc.poll()}, last line {line!r})")


def wait_acked(path: Path, timeout: float = 30.0) -> None:
    """Block until the trainer acknowledged a first sample (polled every 10 ms): the test then
    acts on a session holding traces, without a fixed sleep that a loaded machine could outrun."""
    deadline = time.monotonic() + timeout
    while not acked_uids(path):
        assert time.monotonic() < deadline, f"no sample acknowledged in {timeout} s"
        time.sleep(0.01)


def kill_tree_leader(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """SIGKILL the trainer only (like the OOM killer would); returns its children, still running."""
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.wait(timeout=30)
    return children


def wait_gone(procs: list[psutil.Process], timeout: float = 60.0) -> None:
    """Wait for the trainer's Trackio writer to finish its last commit and exit (EOF on its pipe)."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"processes still running: {alive}"


def acked_uids(path: Path) -> list[str]:
    """Uids the trainer saw `log_samples` accept (a torn last line is ignored)."""
    if not path.exists():
        return []
    data = path.read_bytes().decode()
    lines = data.split("\n")
    return [u for u in lines[:-1] if u]


def trackio_uids(project: str, run: str) -> collections.Counter[str]:
    """How many traces of each uid the run holds in Trackio's database."""
    from trackio.sqlite_storage import SQLiteStorage

    path = SQLiteStorage.get_project_db_path(project)
    if not path.exists():
        return collections.Counter()
    with sqlite3.connect(path) as conn:
        rows = conn.execute(
            "SELECT json_extract(metadata, '$.uid') FROM traces WHERE run_name = ?", (run,)
        ).fetchall()
    return collections.Counter(r[0] for r in rows)


def run_id(project: str, run: str) -> str:
    from trackio.sqlite_storage import SQLiteStorage

    with sqlite3.connect(SQLiteStorage.get_project_db_path(project)) as conn:
        row = conn.execute("SELECT DISTINCT run_id FROM traces WHERE run_name = ?", (run,)).fetchone()
    return str(row[0])


def recover(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run ``asynctrace recover`` as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "asynctrace", "recover", "--no-progress", *args],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=timeout,
    )


def start_recover(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "asynctrace", "recover", "--no-progress", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
        cwd=ROOT,
    )
