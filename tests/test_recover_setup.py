"""The spool remembers the session's sinks: no secret in it, every sink and tier made again."""

from __future__ import annotations

from pathlib import Path

import duckdb
import orjson
import pytest

import asynctrace as at
from asynctrace._durable.setup import read_setups
from asynctrace.sinks import ParquetSink, Selected
from asynctrace.sinks._spec import rebuild_sinks
from tests._util import sample


def _setup_files(spool: Path) -> list[Path]:
    return sorted(spool.glob("setup-*.json"))


def test_the_setup_names_every_sink_and_tier_without_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live session's setup file holds each sink's kind and arguments and each tier's k and
    sampler, with no credential (an environment secret, a URL's password); it goes at a clean
    finish."""
    monkeypatch.setenv("HF_TOKEN", "hf_sEcReTvAlUe123456")
    spool = tmp_path / "spool"
    sinks = [
        ParquetSink(tmp_path / "archive", max_records=500),
        Selected(
            at.TrackioSink(server_url="https://alice:pa55word@trackio.example"),
            max_traces_per_step=4,
            sampler="top_bottom",
        ),
        at.sinks.JsonlSink(tmp_path / "hf_sEcReTvAlUe123456.jsonl"),
        at.testing.MemorySink("mem"),
    ]
    with at.TraceSession("p", run="r", sinks=sinks[:1] + sinks[2:], spool_dir=spool):
        (path,) = _setup_files(spool)
        text = path.read_text()
        assert path.stat().st_mode & 0o777 == 0o600
    assert not _setup_files(spool), "a clean finish leaves no setup behind"
    assert "hf_sEcReTvAlUe123456" not in text
    # The tier (not opened above: its server does not exist) is described on its own.
    from asynctrace.sinks._spec import describe_sinks

    specs = orjson.loads(orjson.dumps(describe_sinks(sinks)))
    assert "pa55word" not in orjson.dumps(specs).decode()
    assert specs[0]["kind"] == "parquet" and "class" not in specs[0]
    assert specs[0]["args"]["max_records"] == 500
    assert specs[1]["selected"] == {"max_traces_per_step": 4, "sampler": {"name": "top_bottom"}}
    assert specs[1]["args"]["server_url"] == "https://trackio.example"
    assert specs[1]["withheld"] == ["server_url"]
    assert specs[3]["args"] is None and specs[3]["class"] == "asynctrace.testing:MemorySink"
    made = rebuild_sinks(specs)
    assert [type(s).__name__ for s in made.sinks] == ["ParquetSink", "Selected", "JsonlSink"]
    assert [n.sink for n in made.unmade] == ["mem"] and not made.refused
    tier = made.sinks[1]
    assert isinstance(tier, Selected) and tier.max_traces_per_step == 4
    assert type(tier.sampler).__name__ == "TopBottomSampler"


def test_a_setup_stays_while_the_session_left_records(tmp_path: Path) -> None:
    """A session that finished with records in the spool keeps its setup for recover."""
    spool = tmp_path / "spool"
    with at.TraceSession(
        "p",
        run="r",
        sinks=[at.testing.MemorySink(hang=True)],
        spool_dir=spool,
        durability="enqueue",
        finish_timeout=0.2,
    ) as s:
        s.log_samples([sample(i) for i in range(3)], step=0)
    found = read_setups(spool)
    assert not found.unreadable and [(x.project, x.run) for x in found.setups.values()] == [("p", "r")]


def test_a_restarted_session_replays_through_each_tier_selection(tmp_path: Path) -> None:
    """What a stuck run left in the spool reaches the restarted run's archive whole and its
    tier as that tier's selection only (2 of 8 a step), not everything."""
    spool, archive = tmp_path / "spool", tmp_path / "archive"
    # A sink that never answers stands in for a kill: everything stays in the spool.
    with at.TraceSession(
        "p",
        run="r",
        sinks=[at.testing.MemorySink(hang=True)],
        spool_dir=spool,
        durability="enqueue",
        finish_timeout=0.3,
    ) as s:
        for step in range(3):
            s.log_samples([sample(i, step=step) for i in range(8)], step=step)
    top = at.testing.MemorySink("top")
    with at.TraceSession(
        "p",
        run="r",
        sinks=[ParquetSink(archive), Selected(top, max_traces_per_step=2, sampler="top_bottom")],
        spool_dir=spool,
    ) as s:
        pass
    stats = s.stats()
    assert stats.replayed == 24 and stats.check()
    assert {step: sorted(r.sample.metadata["uid"] for r in rs) for step, rs in top.steps().items()} == {
        step: [f"{step}:0", f"{step}:7"] for step in range(3)
    }
    rows = duckdb.sql(f"SELECT count(*), count(DISTINCT id) FROM '{archive}/*.parquet'").fetchall()
    assert rows == [(24, 24)]


def test_tracker_sinks_are_made_again_with_their_arguments(tmp_path: Path) -> None:
    """W&B and MLflow sinks round-trip through their specs (without a URL's credentials); a
    W&B sink attached to the trainer's run cannot be made again, and says so."""
    from asynctrace.sinks import MlflowSink, WandbSink
    from asynctrace.sinks._spec import describe_sinks

    sinks = [
        WandbSink(project="wp", table_prefix="rl", init_kwargs={"mode": "offline", "config": {"k": "v"}}),
        MlflowSink(tracking_uri="https://bob:hunter2@mlflow.example", experiment="e", attach_active=False),
        WandbSink(attach=True),
    ]
    specs = orjson.loads(orjson.dumps(describe_sinks(sinks)))
    assert "hunter2" not in orjson.dumps(specs).decode()
    made = rebuild_sinks(specs)
    wandb, mlflow = made.sinks
    assert isinstance(wandb, WandbSink) and wandb.project == "wp" and wandb.table_prefix == "rl/"
    assert wandb.init_kwargs == {"mode": "offline"}
    assert isinstance(mlflow, MlflowSink) and mlflow.experiment == "e"
    assert mlflow.tracking_uri == "https://mlflow.example"
    assert [name for name, _ in made.unmade] == ["wandb"] and not made.refused


_KILLED_WITH_URLS = """
import os, signal, sys
import asynctrace as at
from asynctrace.sinks import MlflowSink

sinks = [
    MlflowSink(tracking_uri="http://bob:hunter2@127.0.0.1:9/?api_key=MLSECRET1", attach_active=False),
    at.TrackioSink(server_url="http://127.0.0.1:9/?token=TRSECRET2&write_token=TRSECRET3&project=x"),
]
with at.TraceSession("p", run="r", sinks=sinks, spool_dir=sys.argv[1], durability="enqueue") as s:
    s.log_samples([{"prompt": "q", "response": "a"}], step=0)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_no_url_credential_reaches_the_spool_and_recover_says_what_it_lacks(tmp_path: Path) -> None:
    """A trainer killed with an MLflow URI holding `user:password@` and `?api_key=`, and a
    Trackio server URL holding `?token=` and `?write_token=`, leaves none of them in any spool
    file; the setup names the arguments that lost credentials, and the sinks made from it get
    the URLs without them, with a note naming where the backend takes them from."""
    import subprocess
    import sys

    from tests.faults import _harness as h

    spool = tmp_path / "spool"
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_WITH_URLS, str(spool)],
        env=h.env(), cwd=h.ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -9, child.stderr
    written = b"".join(p.read_bytes() for p in spool.iterdir() if p.is_file())
    for secret in (b"hunter2", b"MLSECRET1", b"TRSECRET2", b"TRSECRET3", b"bob"):
        assert secret not in written, secret
    (setup,) = read_setups(spool).setups.values()
    assert [spec["withheld"] for spec in setup.sinks] == [["tracking_uri"], ["server_url"]]
    made = rebuild_sinks(setup.sinks)
    mlflow, trackio = made.sinks
    assert mlflow.tracking_uri == "http://127.0.0.1:9/"  # type: ignore[attr-defined]
    assert trackio.server_url == "http://127.0.0.1:9/?project=x"  # type: ignore[attr-defined]
    notes = dict(made.notes)
    assert "from MLFLOW_TRACKING_TOKEN" in notes["mlflow"] and "from TRACKIO_WRITE_TOKEN" in notes["trackio"]


def test_a_credential_after_a_semicolon_is_left_out_of_the_setup_too() -> None:
    """A URL whose query or fragment separates parameters with `;` (as servers also read them, and
    as scrubbed text treats them) keeps none of its credentials in the spec; its other
    parameters stay as written."""
    from asynctrace.sinks import MlflowSink
    from asynctrace.sinks._spec import describe_sinks

    sinks = [
        MlflowSink(tracking_uri="http://127.0.0.1:9/?a=1;api_key=MLSEMI1&b=2", attach_active=False),
        at.TrackioSink(server_url="http://127.0.0.1:9/?project=x;write_token=TRSEMI2#sig=TRSEMI3;v=1"),
    ]
    specs = describe_sinks(sinks)
    text = orjson.dumps(specs).decode()
    for secret in ("MLSEMI1", "TRSEMI2", "TRSEMI3"):
        assert secret not in text, text
    assert [spec["withheld"] for spec in specs] == [["tracking_uri"], ["server_url"]]
    assert specs[0]["args"]["tracking_uri"] == "http://127.0.0.1:9/?a=1&b=2"
    assert specs[1]["args"]["server_url"] == "http://127.0.0.1:9/?project=x#v=1"


def test_a_dead_letter_keeps_no_credential_of_a_url_in_its_error(tmp_path: Path) -> None:
    """A sink failing with an error that quotes a URL's password and its `key=`/`sig=` values:
    the dead letter and the stats hold the error with them replaced by `***`."""

    class Refusing(at.Sink):
        name = "refusing"

        async def write(self, records: object) -> None:
            raise at.PermanentSinkError(
                "cannot post to https://carol:s3cr3tpw@store.example/up?key=K3Y99&sig=S1G77&x=1"
            )

    spool = tmp_path / "spool"
    with at.TraceSession("p", run="r", sinks=[Refusing()], spool_dir=spool) as s:
        s.log_samples([sample(0)], step=0)
    error = s.stats().sinks["refusing"].last_error or ""
    (dead,) = spool.glob("dead-*.jsonl")
    for text in (error, dead.read_text()):
        assert "s3cr3tpw" not in text and "K3Y99" not in text and "S1G77" not in text, text
    assert "https://***@store.example/up?key=***&sig=***&x=1" in error


def test_every_shipped_sink_comes_back_from_its_spec_alone(tmp_path: Path) -> None:
    """Each kind in the registry takes back exactly what its sink's `recovery_args()` gives."""
    from asynctrace.sinks import ConsoleSink, JsonlSink, MlflowSink, TrackioSink, WandbSink
    from asynctrace.sinks._kinds import KINDS
    from asynctrace.sinks._spec import describe_sinks

    sinks = [
        TrackioSink(project="tp", server_url="https://trackio.example"),
        WandbSink(project="wp", init_kwargs={"mode": "offline", "dir": str(tmp_path)}),
        MlflowSink(tracking_uri="sqlite:///x.db", experiment="e", attach_active=False),
        ParquetSink(tmp_path / "archive", stem="s"),
        JsonlSink(tmp_path / "out.jsonl", rotate_every=10),
        ConsoleSink(max_chars=100),
    ]
    specs = orjson.loads(orjson.dumps(describe_sinks(sinks)))
    assert [spec["kind"] for spec in specs] == list(KINDS)
    made = rebuild_sinks(specs)
    assert not made.refused and not made.unmade, made
    for before, after in zip(sinks, made.sinks, strict=True):
        assert type(after) is type(before) and after.recovery_args() == before.recovery_args()
