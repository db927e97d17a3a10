"""The sidecar maker's temporaries: one killed (SIGKILL: no cleanup runs) leaves its own, which the
next sink's open and recovery remove, and nothing else."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import asynctrace as at  # noqa: E402
from asynctrace.sinks._parquet_sidecar import SIDECAR_FOLDER, remove_leftovers  # noqa: E402

pytestmark = pytest.mark.skipif(os.name != "posix", reason="SIGKILL and process ids of POSIX")

_ROWS = 200_000


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("big") / "run-00000.parquet"
    _big_file(path)
    return path


def _big_file(path: Path) -> None:
    """A file of the sink's columns, large enough that a sidecar's write takes a while."""
    n = _ROWS
    ids = pa.array([f"r{i}" for i in range(n)])
    meta = pa.array([f'{{"prompt_id": "p{i % 997}", "group_uid": "g{i // 8}"}}' for i in range(n)])
    pq.write_table(
        pa.table(
            {
                "id": ids,
                "step": pa.array([i // 4096 for i in range(n)], pa.int64()),
                "split": pa.array(["train"] * n),
                "messages": pa.array(
                    [f'[{{"role": "user", "content": "word{i % 5000} x"}}]' for i in range(n)]
                ),
                "metadata": meta,
                "reward": pa.array([float(i % 3) for i in range(n)]),
                "advantage": pa.array([0.0] * n),
                "policy_version": pa.array([i // 4096 for i in range(n)], pa.int64()),
                "stop_reason": pa.array(["stop"] * n),
            }
        ),
        path,
        row_group_size=65_536,
    )


def _killed_while_writing(file: Path) -> list[str]:
    """Run the sidecar maker on `file` and SIGKILL it once a temporary of its is in the folder:
    the temporaries it left."""
    folder = file.parent / SIDECAR_FOLDER
    child = subprocess.Popen([sys.executable, "-m", "asynctrace.sinks._parquet_sidecar", str(file)])
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None:
            if folder.is_dir() and any(n.endswith(".tmp") for n in os.listdir(folder)):
                child.send_signal(signal.SIGKILL)
                break
            time.sleep(0.0005)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL, "the maker ended before a temporary was seen"
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))


def test_a_killed_makers_temporaries_are_removed_by_the_next_sink(made: Path, tmp_path: Path) -> None:
    """A maker SIGKILLed mid-write leaves ``.<name>.<pid>.tmp``; the next ParquetSink opened there
    removes it, and leaves a live process's temporary, a link and a foreign name alone."""
    file = tmp_path / made.name
    shutil.copyfile(made, file)
    left = _killed_while_writing(file)
    assert left, "a SIGKILLed maker left no temporary"
    folder = tmp_path / SIDECAR_FOLDER
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # What is not the leftovers of a dead maker, named alike.
        alive = folder / f".{file.name}.index.parquet.{live.pid}.tmp"
        alive.write_bytes(b"a live maker's work")
        target = tmp_path / "kept.txt"
        target.write_text("not the sink's")
        linked = folder / f".{file.name}.words.parquet.999999999.tmp"
        linked.symlink_to(target)
        a_folder = folder / f".{file.name}.steps.parquet.999999998.tmp"
        a_folder.mkdir()
        foreign = folder / ".notes.999999997.tmp"
        foreign.write_text("someone else's")

        async def open_a_sink() -> None:
            sink = at.ParquetSink(tmp_path, process=False)
            async with at.TraceSession("s", run="r", sinks=[sink], health_metrics=False):
                pass

        anyio.run(open_a_sink)
        remaining = set(os.listdir(folder))
        assert not remaining & set(left), "the killed maker's temporaries are still there"
        for kept in (alive, linked, a_folder, foreign):
            assert kept.name in remaining, kept
        assert target.read_text() == "not the sink's"
    finally:
        live.kill()
        live.wait()
    # Its process gone, that temporary is a leftover too (what `asynctrace recover` calls).
    assert remove_leftovers(tmp_path) == 1
    assert not alive.exists() and linked.is_symlink() and a_folder.is_dir() and foreign.exists()


def test_recovery_removes_a_killed_makers_temporaries(made: Path, tmp_path: Path) -> None:
    """`finalize_journals` (what `asynctrace recover` runs for each Parquet archive of a killed
    session) removes what a SIGKILLed maker left."""
    file = tmp_path / made.name
    shutil.copyfile(made, file)
    assert _killed_while_writing(file)
    at.ParquetSink(tmp_path).finalize_journals()
    assert not [n for n in os.listdir(tmp_path / SIDECAR_FOLDER) if n.endswith(".tmp")]
