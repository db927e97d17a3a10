"""TrackioWriter: local or remote as Trackio decides, and a run config that survives a failed write."""

from __future__ import annotations

import contextlib
import io
import socket
import sqlite3
import subprocess
import sys

import orjson
import pytest

from asynctrace.sinks._trackio_writer import TrackioWriter, WriteItem
from tests.faults import _harness as h


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_server_url_from_the_environment_makes_the_run_remote(
    project: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With TRACKIO_SERVER_URL set, traces go to Trackio's upload path (kept pending), not into
    local SQLite as if delivered."""
    from trackio.sqlite_storage import SQLiteStorage

    # A self-hosted server configured the way Trackio documents; nothing listens on the port.
    monkeypatch.setenv("TRACKIO_SERVER_URL", f"http://127.0.0.1:{_unused_port()}/?write_token=t")
    writer = TrackioWriter(project, "r")
    with contextlib.redirect_stdout(io.StringIO()), pytest.warns(UserWarning):
        writer.open()
        payload = orjson.dumps({"messages": [{"role": "user", "content": "q"}]})
        writer.write([WriteItem(f"abc-{i}", 0, "train/traces", payload, False, 1.7e9) for i in range(3)])
        writer.write_metrics(0, {"reward/mean": 0.5})
        writer.finish()
    with sqlite3.connect(SQLiteStorage.get_project_db_path(project)) as conn:
        traces = conn.execute("SELECT count(*), count(space_id) FROM traces").fetchone()
        metrics = conn.execute("SELECT count(space_id) FROM metrics").fetchone()
    # Every row waits for upload to the server (its space_id set): none was stored as local data.
    assert traces == (3, 3) and metrics[0] >= 1
    assert SQLiteStorage.has_pending_data(project) and not writer.local


@pytest.mark.parametrize("path", ["private", "public"])
def test_run_config_is_stored_when_the_first_write_fails_and_is_retried(project: str, path: str) -> None:
    """A first write that fails (disk full) does not use up the run config: the retry stores it
    (on the public path, where Trackio drops the failed commit, with the traces logged again)."""
    result = subprocess.run(
        [sys.executable, "-m", "tests.sinks._children", "config-after-disk-full", project, path],
        capture_output=True,
        text=True,
        env=h.env(),
        cwd=h.ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = orjson.loads(result.stdout.splitlines()[-1])
    assert out["traces"] == 3
    assert [c["lr"] for c in out["configs"]] == [1e-5]
