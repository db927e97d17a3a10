"""SIGKILL a run with a Parquet archive and a Trackio tier, then `asynctrace recover`: the archive
is whole and queryable, Trackio holds each step's selection, with its submission times."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import duckdb
import orjson
import pytest

import asynctrace as at
from asynctrace._recover import recover
from asynctrace.sinks._kinds import KINDS
from asynctrace.sinks._spec import describe_sinks
from tests import _recover_spools as rs
from tests.faults import _harness as h

PER_STEP = 16
TIER = 4


def _trackio_traces(project: str, run: str) -> list[tuple[str, str]]:
    """(uid, timestamp) of every trace of the run in Trackio's database."""
    from trackio.sqlite_storage import SQLiteStorage

    path = SQLiteStorage.get_project_db_path(project)
    if not path.exists():
        return []
    with sqlite3.connect(path) as conn:
        try:
            rows = conn.execute(
                "SELECT json_extract(metadata, '$.uid'), timestamp FROM traces WHERE run_name = ?", (run,)
            ).fetchall()
        except sqlite3.OperationalError:  # the database is there, its tables not yet
            return []
    return [(str(uid), str(ts)) for uid, ts in rows]


def test_recover_after_a_kill_fills_the_archive_and_the_tier(tmp_path: Path) -> None:
    """Every acknowledged sample is in the Parquet archive exactly once (DuckDB reads it), the
    journal is a file again, and Trackio holds exactly the top_bottom 4 of each step, each
    shown at the time it was submitted, not when recover wrote it."""
    project, spool, archive = f"tier-{uuid.uuid4().hex[:6]}", tmp_path / "spool", tmp_path / "archive"
    acked_file = tmp_path / "acked.txt"
    started = time.time()
    proc = h.start_trainer(
        "--project", project, "--run", "r", "--spool", str(spool), "--acked", str(acked_file),
        "--durability", "enqueue", "--per-step", str(PER_STEP), "--interval", "0.002",
        "--sink", "tiered", "--parquet", str(archive), "--tier", str(TIER), "--pad", "200",
    )  # fmt: skip
    h.wait_ready(proc)
    # Killed while the tier is at work: it has written some steps, and holds or missed others.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (
        len(h.acked_uids(acked_file)) < 24 * PER_STEP or len(_trackio_traces(project, "r")) < 4 * TIER
    ):
        time.sleep(0.05)
    children = h.kill_tree_leader(proc)
    killed = time.time()
    h.wait_gone(children)
    acked = h.acked_uids(acked_file)
    assert len(acked) >= 24 * PER_STEP

    result = h.recover(str(spool))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sinks: parquet, trackio" in result.stdout, result.stdout

    # The archive: complete, each sample once, no journal left hidden.
    assert not list(archive.glob(".*.journal")), sorted(p.name for p in archive.iterdir())
    rows = duckdb.sql(f"SELECT json_extract_string(metadata, '$.uid') FROM '{archive}/*.parquet'").fetchall()
    archived = collections.Counter(uid for (uid,) in rows)
    assert not [u for u, n in archived.items() if n > 1], "archived twice"
    assert not set(acked) - set(archived), f"{len(set(acked) - set(archived))} acknowledged samples missing"
    # Beyond what was acknowledged: at most the call the kill cut off after it was spooled.
    beyond = {u.split(":")[0] for u in set(archived) - set(acked)}
    assert len(beyond) <= 1, beyond

    # Trackio: exactly the tier's selection of every step, once.
    traces = _trackio_traces(project, "r")
    uids = collections.Counter(uid for uid, _ in traces)
    assert not [u for u, n in uids.items() if n > 1], "a trace twice in Trackio"
    steps = {int(u.split(":")[0]) for u in archived}
    by_step: dict[int, set[int]] = collections.defaultdict(set)
    for uid in uids:
        step, i = uid.split(":")
        by_step[int(step)].add(int(i))
    # The reward is the sample's index: top_bottom keeps the two highest and the two lowest.
    want = {0, 1, PER_STEP - 2, PER_STEP - 1}
    wrong = {s: sorted(by_step.get(s, ())) for s in steps if by_step.get(s, set()) != want}
    assert not wrong, f"steps whose Trackio traces are not the tier's selection: {wrong}"

    # Request time: the submission time, within the run, never the recovery's.
    times = [datetime.datetime.fromisoformat(ts).timestamp() for _, ts in traces]
    assert min(times) >= started - 1 and max(times) <= killed, (started, killed, min(times), max(times))


_KILLED_AFTER_FLUSH = """
import os, signal, sys
import asynctrace as at

archive, spool = sys.argv[1], sys.argv[2]
with at.TraceSession("p", run="r", sinks=[at.sinks.ParquetSink(archive)], spool_dir=spool) as s:
    s.log_samples([{"prompt": f"q{i}", "response": "a", "uid": f"0:{i}"} for i in range(10)], step=0)
    assert s.flush(timeout=30)
    assert s.stats().written == 10
    os.kill(os.getpid(), signal.SIGKILL)  # everything acknowledged: the spool holds nothing
"""


def test_recover_turns_a_journal_into_a_file_with_nothing_to_replay(tmp_path: Path) -> None:
    """A run killed after its spool was fully acknowledged leaves only a Parquet journal:
    recover has nothing to replay, still makes the journal a file, and removes the setup."""
    import subprocess
    import sys

    archive, spool = tmp_path / "archive", tmp_path / "spool"
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_AFTER_FLUSH, str(archive), str(spool)],
        env=h.env(), cwd=h.ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -9, child.stderr
    assert list(archive.glob(".*.journal")) and not list(archive.glob("*.parquet"))
    result = h.recover(str(spool))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "nothing to replay" in result.stdout
    assert "10 rows of killed Parquet sinks' journals written as Parquet files" in result.stdout
    rows = duckdb.sql(f"SELECT json_extract_string(metadata, '$.uid') FROM '{archive}/*.parquet'").fetchall()
    assert sorted(uid for (uid,) in rows) == sorted(f"0:{i}" for i in range(10))
    assert not list(archive.glob(".*.journal")) and not list(spool.glob("setup-*.json"))


_KILLED_WITH_A_TIER = """
import os, signal, sys
import asynctrace as at
from asynctrace.sinks import ParquetSink, Selected

class Mine(at.FirstSampler):  # a sampler of the user's own: the tier cannot be made again
    pass

archive, tier, spool = sys.argv[1], sys.argv[2], sys.argv[3]
top = ParquetSink(tier)
top.name = "top"
sinks = [ParquetSink(archive), Selected(top, max_traces_per_step=2, sampler=Mine())]
with at.TraceSession("p", run="r", sinks=sinks, spool_dir=spool) as s:
    s.log_samples([{"prompt": f"q{i}", "response": "a", "uid": f"0:{i}"} for i in range(10)], step=0)
    assert s.flush(timeout=30)
    written = {name: sink.written for name, sink in s.stats().sinks.items()}
    assert written == {"parquet": 10, "top": 2}, written
    os.kill(os.getpid(), signal.SIGKILL)  # everything acknowledged: the spool holds nothing
"""


def test_recover_makes_only_a_setups_parquet_sinks_to_finish_their_journals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing to replay, recover turns the journals of the killed session's Parquet
    sinks into files (a tier's too, though its sampler cannot be made again) without making the
    W&B, MLflow or Trackio sinks its setup also names."""
    archive, tier, spool = tmp_path / "archive", tmp_path / "tier", tmp_path / "spool"
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_WITH_A_TIER, str(archive), str(tier), str(spool)],
        env=h.env(), cwd=h.ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -9, child.stderr
    assert list(archive.glob(".*.journal")) and list(tier.glob(".*.journal"))
    (setup,) = spool.glob("setup-*.json")
    trackers = [
        at.WandbSink(project="wp", run="wr", init_kwargs={"mode": "offline", "dir": str(tmp_path)}),
        at.sinks.MlflowSink(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="e"),
        at.TrackioSink(project="tp", run="tr"),
    ]
    specs = orjson.loads(setup.read_bytes())["sinks"] + describe_sinks(trackers)
    rs.set_sinks(spool, setup.name[len("setup-") : -len(".json")], specs)
    made: list[str] = []
    for kind in ("wandb", "mlflow", "trackio"):
        real = KINDS[kind].cls

        class Counted(real):  # type: ignore[valid-type, misc]
            """The shipped sink, counted each time one is made."""

            def __init__(self, *args: Any, _cls: type = real, **kwargs: Any) -> None:
                made.append(_cls.__name__)
                super().__init__(*args, **kwargs)

        monkeypatch.setitem(KINDS, kind, dataclasses.replace(KINDS[kind], cls=Counted))
    report = anyio.run(lambda: recover(spool, progress=False))
    assert report.ok and not report.groups, report.lines()
    assert made == [], f"made for nothing: {made}"
    assert report.finalized == 10 + 2, report.lines()
    assert not list(archive.glob(".*.journal")) and not list(tier.glob(".*.journal"))
    assert not list(spool.glob("setup-*.json"))
