"""MlflowSink against a real MLflow tracking store (a SQLite file), read back through MLflow's own API."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import asynctrace as at
from tests._util import LazyModule, sample
from tests.sinks._contract import CONTRACT, RETRY, Backend, run_contract

# Imported by the first test that uses it: `import mlflow` takes ~2 s, which every xdist worker
# paid at collection, though one runs this module.
mlflow = LazyModule("mlflow")

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="the dev extra installs MLflow"),
]


@pytest.fixture(autouse=True)
def _quiet_mlflow(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing leaves this machine: MLflow's usage telemetry is off.
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")


@pytest.fixture(scope="module")
def migrated_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tracking database MLflow has created (schema migrations run once for the module)."""
    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    from mlflow.tracking import MlflowClient

    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store(migrated_store: Path, tmp_path: Path) -> Path:
    """A fresh copy of the migrated tracking database, for one test."""
    path = tmp_path / "mlflow.db"
    shutil.copyfile(migrated_store, path)
    return path


def _uri(path: Path) -> str:
    return f"sqlite:///{path}"


def _traces(uri: str, experiment: str, filter_string: str | None = None) -> list[Any]:
    """Every trace of an experiment matching `filter_string`, read back through `search_traces`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r}"
    out: list[Any] = []
    token = None
    while True:
        page = client.search_traces(
            locations=[exp.experiment_id],
            filter_string=filter_string,
            max_results=500,
            page_token=token,
            include_spans=False,
        )
        out += list(page)
        token = page.token
        if not token:
            return out


def _immutable(path: Path, on: bool) -> bool:
    """Set or clear the file's immutable flag (`chattr`); False where that is not possible."""
    if shutil.which("chattr") is None:
        return False
    flag = "+i" if on else "-i"
    return subprocess.run(["chattr", flag, str(path)], capture_output=True, timeout=30).returncode == 0


class MlflowBackend(Backend):
    """A SQLite tracking store. Faults: its file made immutable (transient), a lock another connection
    holds (a hang), a deleted experiment (permanent)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.uri = _uri(path)
        self.experiment = "contract"

    def make_sink(self) -> at.Sink:
        return at.MlflowSink(tracking_uri=self.uri, experiment=self.experiment)

    def read_ids(self) -> list[str]:
        return [t.info.client_request_id for t in _traces(self.uri, self.experiment)]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # Another connection holds the database in an exclusive transaction: MLflow's calls wait
        # for it (its busy timeout is 20 s) and then fail with "database is locked".
        holder = sqlite3.connect(self.path, isolation_level=None, timeout=1.0, check_same_thread=False)
        try:
            holder.execute("BEGIN EXCLUSIVE")
            yield
        finally:
            holder.rollback()
            holder.close()

    @contextlib.contextmanager
    def transient_fault(self) -> Iterator[None]:
        # The store's file refuses writes (the immutable flag: even root cannot write it, like a
        # volume remounted read-only for a while): each MLflow call fails at once with "disk I/O
        # error" (TEMPORARILY_UNAVAILABLE). Where the flag cannot be set, the lock above does
        # it, in MLflow's 20 s busy timeout per failed call.
        if not _immutable(self.path, True):
            with self._locked():
                yield
            return
        try:
            yield
        finally:
            assert _immutable(self.path, False), "could not clear the immutable flag"

    def hang(self) -> contextlib.AbstractContextManager[None]:
        # Held past MLflow's 20 s busy timeout, the lock blocks every call for 20 s and fails it;
        # the retry blocks again: from a 2 s finish deadline, a backend that does not answer.
        return self._locked()

    @contextlib.contextmanager
    def permanent_fault(self) -> Iterator[None]:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.uri)
        exp = client.get_experiment_by_name(self.experiment)
        assert exp is not None
        client.delete_experiment(exp.experiment_id)
        try:
            yield
        finally:
            client.restore_experiment(exp.experiment_id)


@pytest.fixture
def anyio_backend() -> str:
    # The sink's MLflow calls all run on daemon threads, the same on either event loop; the
    # contract (tens of seconds against a real database lock) runs once, on asyncio.
    return "asyncio"


@pytest.mark.parametrize("point", CONTRACT)
async def test_contract(point: str, store: Path) -> None:
    """The MLflow sink keeps the sink contract (see tests/sinks/_contract.py)."""
    await run_contract(point, MlflowBackend(store))


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_traces_are_searchable_by_step_split_and_metadata(store: Path) -> None:
    """Step, split, the record id and scalar metadata are trace tags MLflow's search filters on."""
    from mlflow.tracking import MlflowClient

    uri = _uri(store)
    memory = at.testing.MemorySink("memory")
    sink = at.MlflowSink(tracking_uri=uri, experiment="search")
    async with at.TraceSession("search", run="r1", sinks=[sink, memory], retry=RETRY) as s:
        for step in range(2):
            await s.log_samples([sample(i, step=step, stop_reason="length") for i in range(4)], step=step)
            await s.log_samples([sample(i, step=step) for i in range(2)], step=step, split="eval")
            await s.log_metrics({"reward/mean": 0.25 + step}, step=step)
    assert s.stats().sinks["mlflow"].written == 12, s.stats().summary()
    by_id = {r.id: r for r in memory.records}

    def ids(filter_string: str | None = None) -> list[str]:
        return sorted(t.info.client_request_id for t in _traces(uri, "search", filter_string))

    assert ids() == sorted(by_id), "every record once, under the id the other sinks got"
    assert ids("tags.step = '1'") == sorted(i for i, r in by_id.items() if r.step == 1)
    assert ids("tags.split = 'eval'") == sorted(i for i, r in by_id.items() if r.split == "eval")
    assert ids("tags.split = 'train' AND tags.stop_reason = 'length' AND tags.step = '0'") == sorted(
        i for i, r in by_id.items() if r.split == "train" and r.step == 0
    )
    one = next(iter(by_id))
    assert ids(f"trace.client_request_id = '{one}'") == [one]
    assert ids(f"tags.record_id = '{one}'") == [one]

    client = MlflowClient(uri)
    linked = client.search_traces(locations=[sink.experiment_id], run_id=sink.run_id, max_results=100)
    assert len(linked) == 12, "every trace is linked to the run (its Traces tab)"
    trace = next(t for t in linked if t.info.client_request_id == one)
    record = by_id[one]
    assert trace.info.tags["reward"] == repr(record.sample.metadata["reward"])
    assert (
        trace.info.tags["key"] == record.key
        and trace.info.request_preview == record.sample.messages[0]["content"]
    )
    span = trace.data.spans[0]
    assert (
        span.inputs == {"messages": record.sample.messages[:1]} and span.outputs == record.sample.messages[1]
    )
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r1", "the run the sink opened is ended"
    history = client.get_metric_history(sink.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.25), (1, 1.25)]


async def test_attaches_to_the_active_run_and_leaves_it_open(store: Path) -> None:
    """With a run active when the sink is made, traces and metrics go to it and it stays open."""
    from mlflow.tracking import MlflowClient

    uri = _uri(store)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run(run_name="trainer") as run:
            sink = at.MlflowSink()
            async with at.TraceSession("attach", sinks=[sink], retry=RETRY) as s:
                await s.log_samples([sample(i) for i in range(3)], step=5)
                await s.log_metrics({"loss": 1.5}, step=5)
            assert sink.run_id == run.info.run_id and not sink.owns_run
            client = MlflowClient(uri)
            assert client.get_run(run.info.run_id).info.status == "RUNNING", (
                "a run it did not open stays open"
            )
            traces = client.search_traces(locations=[run.info.experiment_id], run_id=run.info.run_id)
            assert len(traces) == 3 and all(t.info.tags["step"] == "5" for t in traces)
            metrics = client.get_run(run.info.run_id).data.metrics
            assert {k: v for k, v in metrics.items() if not k.startswith("asynctrace/")} == {"loss": 1.5}
            assert metrics["asynctrace/written"] == 3, "the session's health goes to the same run"
    finally:
        mlflow.set_tracking_uri(previous)


async def test_a_deleted_run_fails_at_once(store: Path) -> None:
    """Attaching to a deleted run is a permanent error: the records fail without 40 retries."""
    from mlflow.tracking import MlflowClient

    uri = _uri(store)
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("gone"))
    client.delete_run(run.info.run_id)
    sink = at.MlflowSink(tracking_uri=uri, run_id=run.info.run_id)
    async with at.TraceSession("gone", sinks=[sink], retry=RETRY) as s:
        await s.log_samples([sample(i) for i in range(4)], step=0)
    st = s.stats().sinks["mlflow"]
    assert st.failed == 4 and st.retries == 0 and "deleted" in (st.last_error or ""), st


async def test_a_refusal_at_the_first_open_fails_at_once(tmp_path: Path) -> None:
    """A tracking URI MLflow has no store for is refused while the first open makes the store
    (`UnsupportedModelRegistryStoreURIException`, INVALID_PARAMETER_VALUE): the records fail
    without a retry, the refusal named, as every other refusal retrying cannot fix."""
    sink = at.MlflowSink(tracking_uri=f"nosuchscheme://{tmp_path}/store", experiment="refused")
    async with at.TraceSession("refused", sinks=[sink], retry=RETRY) as s:
        await s.log_samples([sample(i) for i in range(4)], step=0)
    st = s.stats().sinks["mlflow"]
    assert st.failed == 4 and st.retries == 0, st
    assert "unsupported URI" in (st.last_error or ""), st.last_error


def test_importing_asynctrace_leaves_mlflow_unimported_and_names_the_extra() -> None:
    """`import asynctrace` does not import MLflow; without it, MlflowSink() names the extra."""
    code = (
        "import sys, asynctrace as at\n"
        "print('mlflow' in sys.modules)\n"
        "sys.modules['mlflow'] = None  # as if MLflow were not installed\n"
        "try:\n"
        "    at.MlflowSink()\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["False", 'MlflowSink needs MLflow: pip install "asynctrace[mlflow]"']


async def test_metadata_mlflow_cannot_take_as_tags_stays_in_the_span(store: Path) -> None:
    """Nested values, names MLflow refuses and `mlflow.*` keys are kept in the span, not as tags."""
    from mlflow.tracking import MlflowClient

    uri = _uri(store)
    meta = {"flag": True, "nested": {"a": [1, 2]}, "bad key!": 1, "mlflow.user": "x", "long": "y" * 5000}
    prompt_only = {"messages": [{"role": "user", "content": "unanswered"}], "metadata": meta}
    sink = at.MlflowSink(tracking_uri=uri, experiment="odd")
    async with at.TraceSession("odd", sinks=[sink], retry=RETRY) as s:
        await s.log_samples([prompt_only], step=0)
    assert s.stats().sinks["mlflow"].written == 1, s.stats().summary()
    (trace,) = MlflowClient(uri).search_traces(locations=[sink.experiment_id], run_id=sink.run_id)
    tags = trace.info.tags
    assert tags["flag"] == "true" and tags["long"] == "y" * 4096
    assert not {"nested", "bad key!", "mlflow.user"} & set(tags)
    span = trace.data.spans[0]
    assert span.get_attribute("asynctrace.metadata") == meta
    assert span.inputs == {"messages": prompt_only["messages"]} and span.outputs is None
    assert trace.info.request_preview == "unanswered"


async def test_a_tag_value_cut_to_mlflows_limit_is_named_and_warned(
    store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A string longer than MLflow's 4,096-character tag limit is cut in its tag, never silently:
    the trace's `asynctrace.truncated` tag names it, the sink counts it, one warning says so, and
    the span keeps the whole value."""
    from mlflow.tracking import MlflowClient

    uri = _uri(store)
    meta = {"long": "y" * 5000, "short": "z"}
    sink = at.MlflowSink(tracking_uri=uri, experiment="cut")
    with caplog.at_level("WARNING", logger="asynctrace"):
        async with at.TraceSession("cut", sinks=[sink], retry=RETRY) as s:
            await s.log_samples([{"prompt": "q", "response": "a", **meta}], step=0)
    assert s.stats().sinks["mlflow"].written == 1, s.stats().summary()
    (trace,) = MlflowClient(uri).search_traces(locations=[sink.experiment_id], run_id=sink.run_id)
    assert trace.info.tags["long"] == "y" * 4096 and trace.info.tags["asynctrace.truncated"] == "long"
    assert trace.data.spans[0].get_attribute("asynctrace.metadata")["long"] == "y" * 5000
    assert sink.truncated_tags == 1
    assert sum("tag limit" in r.getMessage() for r in caplog.records) == 1


async def test_the_first_open_is_not_bound_by_the_attempt_timeout(tmp_path: Path) -> None:
    """Making a new tracking store (MLflow's migrations, seconds on a loaded machine) runs under
    the sink's own `open_timeout`: attempts far shorter than it no longer fail the sink."""
    uri = _uri(tmp_path / "new.db")  # not migrated yet
    quick = at.RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.01, attempt_timeout=1.5)
    sink = at.MlflowSink(tracking_uri=uri, experiment="slow-open")
    async with at.TraceSession("slow-open", sinks=[sink], retry=quick) as s:
        await s.log_samples([sample(i) for i in range(2)], step=0)
    assert s.stats().sinks["mlflow"].written == 2, s.stats().summary()
    assert len(_traces(uri, "slow-open")) == 2


def test_open_timeout_is_checked() -> None:
    """`open_timeout` must be a positive number of seconds."""
    with pytest.raises(ValueError, match="open_timeout"):
        at.MlflowSink(open_timeout=0)


async def test_a_finish_during_the_first_open_does_not_wait_for_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first open's wait ignores only the attempt deadline: a session finished while MLflow
    still makes a new store stops waiting at once, instead of leaving a call it cannot cancel."""
    sink = at.MlflowSink(tracking_uri=_uri(tmp_path / "new.db"), experiment="early")
    with caplog.at_level("ERROR", logger="asynctrace"):
        async with at.TraceSession("early", sinks=[sink], retry=RETRY) as s:
            await s.log_samples([sample(0)], step=0)
            stats = await s.finish(timeout=0.2)
    assert stats.written == 0 and stats.submitted == 1 and stats.check(), stats.summary()
    assert not [r for r in caplog.records if "still running" in r.getMessage()]
