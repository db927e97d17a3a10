"""What "written" means for each sink (docs/sinks.md, "What written means"): a trainer SIGKILLs
itself right after the session counted its records written, and the storage, read back through its
own API, holds every one of them. W&B's lines are in test_wandb_persisted.py; Parquet's kill test
is test_parquet.py's `test_a_killed_sinks_journal_becomes_a_file`."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

import asynctrace as at
from tests._util import read_traces, sample

pytestmark = pytest.mark.anyio


def _killed_after_ack(kind: str, target: str, env: dict[str, str] | None = None) -> list[str]:
    """Run tests/sinks/_ack_child.py; the ids it had counted written when it killed itself."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.sinks._ack_child", kind, target],
        capture_output=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
        env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", **(env or {})},
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    ids: list[str] = orjson.loads(done.stdout.splitlines()[-1])
    assert len(ids) == 20
    return ids


def test_jsonl_written_means_in_the_file(tmp_path: Path) -> None:
    """JSONL: the lines of every acknowledged record are in the file when the process is killed."""
    path = tmp_path / "t.jsonl"
    ids = _killed_after_ack("jsonl", str(path))
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert sorted(line["id"] for line in lines) == sorted(ids)


def test_mlflow_written_means_committed_in_the_store(tmp_path: Path) -> None:
    """MLflow: every acknowledged record is a committed trace in the tracking store when the process dies."""
    pytest.importorskip("mlflow", reason="the dev extra installs MLflow")
    pytest.importorskip("sqlalchemy", reason="a sqlite: store needs the full mlflow package")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ids = _killed_after_ack("mlflow", uri)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("acked")
    assert experiment is not None
    traces = client.search_traces(locations=[experiment.experiment_id], max_results=100, include_spans=True)
    assert sorted(t.info.client_request_id for t in traces) == sorted(ids)
    assert all(len(t.data.spans) == 1 for t in traces), "each trace's span is committed with it"


def test_trackio_written_means_committed_in_the_database(project: str) -> None:
    """Trackio (local): every acknowledged record is a committed trace of the project's database."""
    ids = _killed_after_ack("trackio", project)
    stored = [t["metadata"]["asynctrace_id"] for t in read_traces(project, "acked")]
    assert sorted(stored) == sorted(ids)


def test_remote_trackio_written_means_handed_to_trackio_only(project: str, tmp_path: Path) -> None:
    """Trackio, remote: an acknowledgement means handed to Trackio's `run.log`, not persisted: a
    trainer running Trackio in its own process (`process=False`) killed right after it leaves
    none of the acknowledged traces anywhere, neither uploaded (no server answers) nor pending."""
    trackio_dir = tmp_path / "trackio"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    env = {"TRACKIO_DIR": str(trackio_dir), "TRACKIO_SERVER_URL": f"http://127.0.0.1:{port}/?write_token=t"}
    assert len(_killed_after_ack("trackio-thread", project, env)) == 20
    stored = 0
    for db in trackio_dir.glob("*.db"):
        with contextlib.closing(sqlite3.connect(db)) as conn:
            stored += conn.execute("SELECT count(*) FROM traces").fetchone()[0]
    assert stored == 0


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
async def test_fsync_true_syncs_before_the_acknowledgement(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsync=True: the file a batch went to is synced before the batch counts as written."""
    # By inode: a Parquet journal is synced before it is named (its header written, then linked).
    synced: set[int] = set()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.add(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    sink: at.Sink = (
        at.JsonlSink(tmp_path / "t.jsonl", fsync=True)
        if kind == "jsonl"
        else at.ParquetSink(tmp_path, fsync=True)
    )
    async with at.TraceSession("p", run="r", sinks=[sink], batch_size=4) as s:
        await s.log_samples([sample(i) for i in range(4)], step=0)
        assert await s.flush(timeout=30)
        assert s.stats().written == 4
        target = "t.jsonl" if kind == "jsonl" else ".journal"
        assert any(p.stat().st_ino in synced for p in tmp_path.iterdir() if p.name.endswith(target)), synced
