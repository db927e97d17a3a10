"""WandbSink against the real wandb package in offline mode: what the run holds on disk, the sink contract."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

import asynctrace as at
from asynctrace._runtime.lifecycle import finish_bound
from asynctrace.sinks._wandb import WANDB_COLUMNS
from tests._util import sample
from tests.sinks._contract import CONTRACT, Backend, run_contract
from tests.sinks._wandb_env import SETTINGS as _SETTINGS
from tests.sinks._wandb_env import offline_wandb, service
from tests.sinks._wandb_log import history, increments, table_rows

pytestmark = pytest.mark.anyio

__all__ = ["offline_wandb"]  # the module's fixture


def _sink(root: Path, **kwargs: Any) -> at.WandbSink:
    return at.WandbSink(init_kwargs={"dir": str(root), "settings": dict(_SETTINGS)}, **kwargs)


def _files(sink: at.WandbSink) -> Path:
    return Path(sink.wandb_run.dir)


class WandbBackend(Backend):
    """Offline W&B runs, made to fail for real: a file where the run's table folder belongs, a run
    finished under the sink, a stopped service process."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sink: at.WandbSink | None = None

    def make_sink(self) -> at.Sink:
        self.sink = _sink(self.root)
        return self.sink

    def read_ids(self) -> list[str]:
        assert self.sink is not None and self.sink.finished
        files = _files(self.sink)
        ids = [row["id"] for split in ("train", "eval") for row in table_rows(files, f"{split}/traces-incr")]
        final = [row["id"] for split in ("train", "eval") for row in table_rows(files, f"{split}/traces")]
        assert sorted(final) == sorted(ids), "the final table holds what the increments hold"
        return ids

    @contextlib.contextmanager
    def transient_fault(self) -> Iterator[None]:
        assert self.sink is not None
        folder = _files(self.sink) / "media" / "table" / "train"
        aside = folder.with_name("train.aside")
        folder.rename(aside)
        # Where W&B copies the table file: it cannot (root ignores permission bits, so a
        # read-only folder would not do); copies fail until the folder is back.
        folder.write_bytes(b"")
        try:
            yield
        finally:
            folder.unlink()
            aside.rename(folder)

    @contextlib.contextmanager
    def permanent_fault(self) -> Iterator[None]:
        assert self.sink is not None
        # The run is finished under the sink (as a trainer finishing the run it shares would):
        # W&B refuses every later call on it with a UsageError.
        self.sink.wandb_run.finish()
        yield

    @contextlib.contextmanager
    def hang(self) -> Iterator[None]:
        core = service()
        os.kill(core.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(core.pid, signal.SIGCONT)


@pytest.mark.parametrize("point", CONTRACT)
async def test_contract(point: str, offline_wandb: Path) -> None:
    """The W&B sink keeps the sink contract (see tests/sinks/_contract.py)."""
    await run_contract(point, WandbBackend(offline_wandb))


async def test_rows_carry_readable_columns_and_the_full_messages(offline_wandb: Path) -> None:
    """Each row holds id, step, split, the rendered conversation, reward, advantage and the messages."""
    sink = _sink(offline_wandb)
    memory = at.testing.MemorySink("memory")
    async with at.TraceSession("p", run="cols", sinks=[sink, memory]) as s:
        await s.log_samples(
            [
                {
                    "messages": [
                        {"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": [{"type": "text", "text": "4"}]},
                    ],
                    "metadata": {
                        "reward": 1,
                        "advantage": -0.5,
                        "policy_version": 3,
                        "stop_reason": "length",
                        "uid": "a",
                    },
                },
                sample(1, reward=float("nan")),
            ],
            step=4,
            split="eval",
        )
    rows = {row["id"]: row for row in table_rows(_files(sink), "eval/traces-incr")}
    assert sorted(rows) == sorted(r.id for r in memory.records)
    first = rows[memory.records[0].id]
    assert list(first) == list(WANDB_COLUMNS)
    assert first["step"] == 4 and first["split"] == "eval" and first["key"] == "eval/traces"
    assert first["conversation"] == "user: 2+2?\n\nassistant: 4"
    assert (first["reward"], first["advantage"], first["policy_version"]) == (1.0, -0.5, 3)
    assert first["stop_reason"] == "length"
    assert orjson.loads(first["metadata"]) == {"uid": "a"}
    assert orjson.loads(first["messages"])[1]["content"] == [{"type": "text", "text": "4"}]
    # A reward that is not a finite number gets no column value; the metadata keeps it.
    second = rows[memory.records[1].id]
    assert second["reward"] is None and "reward" in orjson.loads(second["metadata"])


async def test_score_and_spans_are_in_the_metadata_column(offline_wandb: Path) -> None:
    """A sample's `score` and `spans` are in the `metadata` column under their names, and under
    `sample.score` / `sample.spans` where the metadata has such a key itself: neither is lost."""
    sink = _sink(offline_wandb)
    spans = [{"id": "g", "name": "generate", "kind": "generation"}]
    plain = at.Sample(messages=[{"role": "user", "content": "q"}], score=0.5, spans=spans)
    both = at.Sample(messages=[{"role": "user", "content": "r"}], metadata={"score": "mine"}, score=0.25)
    async with at.TraceSession("p", run="extras", sinks=[sink]) as s:
        await s.log_samples([plain, both], step=0)
    rows = [orjson.loads(row["metadata"]) for row in table_rows(_files(sink), "train/traces-incr")]
    assert rows == [{"score": 0.5, "spans": spans}, {"score": "mine", "sample.score": 0.25}]


async def test_attach_names_the_run_object_when_wandb_run_is_unset(offline_wandb: Path) -> None:
    """A run made with `reinit="create_new"` is not `wandb.run`: `attach=True` fails saying to pass
    the run, and `attach=run` logs to it."""
    import wandb

    settings = wandb.Settings(**_SETTINGS)  # type: ignore[arg-type]
    run = await anyio.to_thread.run_sync(
        lambda: wandb.init(
            project="p", name="new", dir=str(offline_wandb), settings=settings, reinit="create_new"
        )
    )
    try:
        assert wandb.run is None
        async with at.TraceSession("p", run="a", sinks=[at.WandbSink(attach=True)]) as s:
            await s.log_samples([sample(0)], step=0)
        assert "attach=run" in str(s.stats().sinks["wandb"].last_error)
        # Counted at hand-off: this run writes its log every 15 s, and its step stays open.
        sink = at.WandbSink(attach=run, wait_for_log=False)
        async with at.TraceSession("p", run="a", sinks=[sink]) as s:
            await s.log_samples([sample(0)], step=0)
        assert s.stats().sinks["wandb"].written == 1 and sink.wandb_run is run
    finally:
        await anyio.to_thread.run_sync(run.finish)


async def test_a_batch_written_again_adds_no_rows(offline_wandb: Path) -> None:
    """A write repeated with the same records (a retry after an attempt that did land) adds nothing."""
    sink = _sink(offline_wandb)
    memory = at.testing.MemorySink("memory")
    async with at.TraceSession("p", run="again", sinks=[sink, memory]) as s:
        await s.log_samples([sample(i) for i in range(3)], step=0)
        assert await s.flush(timeout=30)
        await sink.write(memory.records)
    ids = [row["id"] for row in table_rows(_files(sink), "train/traces-incr")]
    assert sorted(ids) == sorted(r.id for r in memory.records)


# The list `_listings` notes directories in, while its block runs; whether the hook is in.
_LISTED: list[list[str]] = []
_HOOKED: list[bool] = []


@contextlib.contextmanager
def _listings() -> Iterator[list[str]]:
    """The directories this process lists (`os.scandir`, `os.listdir`) within the block."""
    if not _HOOKED:
        # An audit hook stays for the life of the process: it notes nothing outside the block.
        sys.addaudithook(_note_listing)
        _HOOKED.append(True)
    listed: list[str] = []
    _LISTED.append(listed)
    try:
        yield listed
    finally:
        _LISTED.clear()


def _note_listing(event: str, args: tuple[Any, ...]) -> None:
    if _LISTED and event in ("os.scandir", "os.listdir"):
        _LISTED[0].append(str(args[0]) if args else "")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_write_lists_no_directory_however_many_increments(offline_wandb: Path) -> None:
    """Each write knows the table file of its increment without listing the run's table folder,
    which gains a file a write: 12 writes, each waiting for its rows in the log, no listing."""
    sink = _sink(offline_wandb, log_flush_interval=0.05)
    async with at.TraceSession("p", run="listings", sinks=[sink], batch_size=2) as s:
        await s.log_samples([sample(0)], step=0)
        assert await s.flush(timeout=30)
        with _listings() as listed:
            for step in range(1, 13):
                await s.log_samples([sample(i, step=step) for i in range(2)], step=step)
                assert await s.flush(timeout=30)
        assert s.stats().written == 25 and s.stats().check()
    files = str(_files(sink))
    assert not [p for p in listed if p.startswith(files)], listed
    assert len(table_rows(_files(sink), "train/traces-incr")) == 25


async def test_out_of_order_steps_are_kept_on_the_custom_axis(offline_wandb: Path) -> None:
    """Metrics and tables logged for earlier steps are all in the history, each with its step."""
    sink = _sink(offline_wandb)
    async with at.TraceSession("p", run="order", sinks=[sink], batch_size=4) as s:
        for step in (5, 2, 7, 1):
            await s.log_metrics({"loss": float(step)}, step=step)
            await s.log_samples([sample(i, step=step) for i in range(4)], step=step)
            assert await s.flush(timeout=30)
    rows = history(Path(sink.wandb_run.dir).parent)
    losses = [(row["asynctrace/step"], row["loss"]) for row in rows if "loss" in row]
    assert losses == [(5, 5.0), (2, 2.0), (7, 7.0), (1, 1.0)]
    steps = sorted(row["step"] for row in table_rows(_files(sink), "train/traces-incr"))
    assert steps == sorted([5, 2, 7, 1] * 4)


async def test_attached_run_keeps_the_trainers_steps_and_stays_open(offline_wandb: Path) -> None:
    """Attached to the trainer's run, the sink never moves its step counter and never finishes it."""
    import wandb

    # The trainer's run writes its `.wandb` file often: the sink's rows count once there.
    settings = wandb.Settings(**_SETTINGS, x_transaction_log_flush_interval=0.1)  # type: ignore[arg-type]
    run = await anyio.to_thread.run_sync(
        lambda: wandb.init(project="p", name="trainer", dir=str(offline_wandb), settings=settings)
    )
    try:
        sink = at.WandbSink(attach=True, wait_for_log=True)
        async with at.TraceSession("p", run="attached", sinks=[sink], batch_size=4) as s:
            for step in range(3):
                # The trainer passes its own step, as verl does: a step W&B had already passed
                # would be dropped.
                run.log({"trainer/loss": float(step)}, step=step)
                await s.log_samples([sample(i, step=step) for i in range(4)], step=step)
                await s.log_metrics({"asynctrace/queue": float(step)}, step=step)
            # The rows join the trainer's current step, and W&B writes that step when the
            # trainer moves on: they count as written once it has, as the trainer goes on.
            last = 2
            with anyio.fail_after(60):
                while s.stats().sinks["wandb"].written < 12:
                    last += 1
                    run.log({"trainer/loss": float(last)}, step=last)
                    await anyio.sleep(0.05)
            assert await s.flush(timeout=30)
        assert sink.wandb_run is run and not sink.finished
    finally:
        await anyio.to_thread.run_sync(run.finish)
    rows = history(Path(run.dir).parent)
    assert [row["trainer/loss"] for row in rows if "trainer/loss" in row] == [
        float(i) for i in range(last + 1)
    ]
    ids = [row["id"] for row in table_rows(Path(run.dir), "train/traces-incr")]
    assert len(ids) == len(set(ids)) == 12


async def test_an_attached_run_counts_rows_once_its_log_holds_them(offline_wandb: Path) -> None:
    """Attached, by default, writes hand rows to wandb-core without waiting (several batches in
    one trainer step), and they count as written only once W&B has written them to the `.wandb`
    file, which it does when the trainer logs its next step; a flush meanwhile does not wait."""
    import wandb

    settings = wandb.Settings(**_SETTINGS, x_transaction_log_flush_interval=0.05)  # type: ignore[arg-type]
    run = await anyio.to_thread.run_sync(
        lambda: wandb.init(project="p", name="confirmed", dir=str(offline_wandb), settings=settings)
    )
    log = Path(run.settings.sync_file)
    try:
        async with at.TraceSession("p", run="confirmed", sinks=[at.WandbSink(attach=run)], batch_size=4) as s:
            run.log({"trainer/loss": 0.0}, step=0)
            await s.log_samples([sample(i) for i in range(12)], step=0)
            with anyio.fail_after(10):  # three writes, none waiting for the trainer's step
                assert await s.flush(timeout=10)
            assert s.stats().written == 0 and s.stats().pending == 12
            await anyio.sleep(0.5)  # ten of the run's flush intervals: the step is still open
            assert increments(log) == 0 and s.stats().written == 0
            run.log({"trainer/loss": 1.0}, step=1)
            with anyio.fail_after(30):
                while s.stats().written < 12:
                    await anyio.sleep(0.01)
            assert increments(log) >= 1, "counted written before the log held the rows"
            assert s.stats().check() and s.stats().pending == 0
    finally:
        await anyio.to_thread.run_sync(run.finish)
    ids = [row["id"] for row in table_rows(Path(run.dir), "train/traces-incr")]
    assert len(ids) == len(set(ids)) == 12


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_attached_run_with_a_long_log_confirms_the_rows_logged_after(offline_wandb: Path) -> None:
    """A trainer's run whose `.wandb` file is megabytes long when the sink attaches (read from a
    block boundary near its end, inside one of the trainer's records): the rows logged after
    count written once the trainer's next step puts them in the log, each once."""
    import wandb

    settings = wandb.Settings(**_SETTINGS, x_transaction_log_flush_interval=0.05)  # type: ignore[arg-type]
    run = await anyio.to_thread.run_sync(
        lambda: wandb.init(project="p", name="long", dir=str(offline_wandb), settings=settings)
    )
    log = Path(run.settings.sync_file)
    try:
        for i in range(8):  # records of 200 kB, each over several blocks
            await anyio.to_thread.run_sync(run.log, {"trainer/text": str(i) * 200_000})
        with anyio.fail_after(30):
            while not log.exists() or log.stat().st_size < 1_500_000:
                await anyio.sleep(0.02)
        async with at.TraceSession("p", run="long", sinks=[at.WandbSink(attach=run)]) as s:
            await s.log_samples([sample(i) for i in range(6)], step=0)
            assert await s.flush(timeout=10)
            await anyio.to_thread.run_sync(lambda: run.log({"trainer/loss": 1.0}))
            with anyio.fail_after(30):
                while s.stats().written < 6:
                    await anyio.sleep(0.01)
            assert s.stats().check() and s.stats().sinks["wandb"].degraded is None
    finally:
        await anyio.to_thread.run_sync(run.finish)
    ids = [row["id"] for row in table_rows(Path(run.dir), "train/traces-incr")]
    assert len(ids) == len(set(ids)) == 6


async def test_wait_for_log_false_counts_rows_handed_to_its_service(offline_wandb: Path) -> None:
    """Attached with ``wait_for_log=False``, a row counts as written once handed to wandb-core:
    W&B writes it with the trainer's step, in its log only once the trainer has moved on."""
    import wandb

    settings = wandb.Settings(**_SETTINGS, x_transaction_log_flush_interval=0.05)  # type: ignore[arg-type]
    run = await anyio.to_thread.run_sync(
        lambda: wandb.init(project="p", name="handed", dir=str(offline_wandb), settings=settings)
    )
    log = Path(run.settings.sync_file)
    try:
        sink = at.WandbSink(attach=run, wait_for_log=False)
        async with at.TraceSession("p", run="handed", sinks=[sink], batch_size=4) as s:
            run.log({"trainer/loss": 0.0}, step=0)
            await s.log_samples([sample(i) for i in range(4)], step=0)
            assert await s.flush(timeout=30) and s.stats().written == 4
            # Ten of the run's flush intervals: the trainer's step is still open, so W&B has not
            # written the rows counted written.
            await anyio.sleep(0.5)
            assert increments(log) == 0
            run.log({"trainer/loss": 1.0}, step=1)
            with anyio.fail_after(30):
                while increments(log) < 1:
                    await anyio.sleep(0.02)
    finally:
        await anyio.to_thread.run_sync(run.finish)


async def test_commit_decides_whether_writes_wait_for_the_log(offline_wandb: Path) -> None:
    """Logs that commit their own W&B steps (`commit=True` on an attached run) are in the log when
    the write returns; logs that do not (`commit=False` on a run the sink opens) count once
    handed over, and W&B writes them at the run's finish."""
    import wandb

    settings = wandb.Settings(**_SETTINGS, x_transaction_log_flush_interval=0.05)  # type: ignore[arg-type]
    run = await anyio.to_thread.run_sync(
        lambda: wandb.init(project="p", name="committed", dir=str(offline_wandb), settings=settings)
    )
    try:
        async with at.TraceSession("p", run="c", sinks=[at.WandbSink(attach=run, commit=True)]) as s:
            await s.log_samples([sample(i) for i in range(4)], step=0)
            assert await s.flush(timeout=30) and s.stats().written == 4
            assert increments(Path(run.settings.sync_file)) == 1
    finally:
        await anyio.to_thread.run_sync(run.finish)

    sink = _sink(offline_wandb, commit=False, log_flush_interval=0.05)
    async with at.TraceSession("p", run="uncommitted", sinks=[sink]) as s:
        await s.log_samples([sample(i) for i in range(4)], step=0)
        assert await s.flush(timeout=30) and s.stats().written == 4
        log = Path(sink.wandb_run.settings.sync_file)
        await anyio.sleep(0.5)  # ten flush intervals: no commit, nothing written
        assert increments(log) == 0
    history(log.parent)  # waits for the finished run's exit record
    assert increments(log) == 1


async def test_a_second_sink_on_a_run_waits_for_its_own_rows(offline_wandb: Path) -> None:
    """Two sessions one after the other on the trainer's run, logging the same table key: the
    second's rows count once the log holds them, not because the first's are there."""
    import wandb

    settings = wandb.Settings(**_SETTINGS, x_transaction_log_flush_interval=0.05)  # type: ignore[arg-type]
    run = await anyio.to_thread.run_sync(
        lambda: wandb.init(project="p", name="shared", dir=str(offline_wandb), settings=settings)
    )
    try:
        async with at.TraceSession("p", run="a", sinks=[at.WandbSink(attach=run, commit=True)]) as s:
            await s.log_samples([sample(i) for i in range(4)], step=0)
            assert await s.flush(timeout=30) and s.stats().written == 4
        core = service()
        async with at.TraceSession("p", run="b", sinks=[at.WandbSink(attach=run, commit=True)]) as s:
            os.kill(core.pid, signal.SIGSTOP)
            try:
                await s.log_samples([sample(i) for i in range(4)], step=1)
                assert not await s.flush(timeout=1.0), "the stopped service has not written them"
                assert s.stats().written == 0
            finally:
                os.kill(core.pid, signal.SIGCONT)
            assert await s.flush(timeout=30) and s.stats().written == 4
    finally:
        await anyio.to_thread.run_sync(run.finish)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_earlier_sessions_increments_never_confirm_a_later_ones_rows(offline_wandb: Path) -> None:
    """A session's increment of a table key is in the trainer's log; a second session's rows of
    the same key, held in the trainer's open step, count written only once the log holds them
    (each knows its increment by its own table file, not by how many the key has)."""
    import wandb

    settings = wandb.Settings(**_SETTINGS, x_transaction_log_flush_interval=0.05)  # type: ignore[arg-type]
    run = await anyio.to_thread.run_sync(
        lambda: wandb.init(project="p", name="earlier", dir=str(offline_wandb), settings=settings)
    )
    log = Path(run.settings.sync_file)
    try:
        async with at.TraceSession("p", run="a", sinks=[at.WandbSink(attach=run, commit=True)]) as s:
            await s.log_samples([sample(i) for i in range(4)], step=0)
            assert await s.flush(timeout=30) and s.stats().written == 4
        async with at.TraceSession("p", run="b", sinks=[at.WandbSink(attach=run)]) as s:
            await anyio.to_thread.run_sync(lambda: run.log({"trainer/loss": 0.0}))
            await s.log_samples([sample(i) for i in range(4)], step=1)
            assert await s.flush(timeout=10)
            await anyio.sleep(0.5)  # ten of the run's flush intervals: the step is still open
            assert s.stats().written == 0 and s.stats().pending == 4
            await anyio.to_thread.run_sync(lambda: run.log({"trainer/loss": 1.0}))
            with anyio.fail_after(30):
                while s.stats().written < 4:
                    await anyio.sleep(0.01)
            assert increments(log) >= 1 and s.stats().check()
    finally:
        await anyio.to_thread.run_sync(run.finish)
    assert len(table_rows(Path(run.dir), "train/traces-incr")) == 8


async def test_a_stopped_service_bounds_finish_and_the_run_is_finished_after(offline_wandb: Path) -> None:
    """With the service stopped, finish returns within its budget and counts nothing logged since
    as written; the close it walked away from finishes the run once the service goes on."""
    sink = _sink(offline_wandb)
    core = service()
    s = at.TraceSession("p", run="stop", sinks=[sink], batch_size=4, finish_timeout=1.0)
    async with s:
        await s.log_samples([sample(i) for i in range(4)], step=0)
        assert await s.flush(timeout=30)
        os.kill(core.pid, signal.SIGSTOP)
        try:
            await s.log_samples([sample(i) for i in range(4)], step=1)
            started = time.monotonic()
            stats = await s.finish(timeout=1.0)
            elapsed = time.monotonic() - started
            assert not sink.finished, "finishing the run cannot end while the service is stopped"
        finally:
            os.kill(core.pid, signal.SIGCONT)
    assert elapsed < finish_bound(1.0) + 2.0, f"finish took {elapsed:.1f}s"
    assert stats.check(), stats.summary()
    with anyio.fail_after(30):
        while not sink.finished:
            await anyio.sleep(0.02)
    # Written: only what the service had put in the run's log before it stopped. The close it
    # walked away from logged the rest in the end: at least once, never claimed before.
    assert stats.sinks["wandb"].written == 4 and stats.pending == 4, stats.summary()
    ids = [row["id"] for row in table_rows(_files(sink), "train/traces")]
    assert len(ids) == len(set(ids)) == 8


async def test_the_runs_it_opens_write_their_log_at_its_interval(offline_wandb: Path) -> None:
    """A run the sink opens writes its `.wandb` file every `log_flush_interval`, given settings as a
    mapping or a `wandb.Settings` object, unless those set W&B's interval themselves."""
    import wandb

    given = [
        dict(_SETTINGS),
        wandb.Settings(**_SETTINGS),  # type: ignore[arg-type]
        wandb.Settings(**_SETTINGS, x_transaction_log_flush_interval=3.0),  # type: ignore[arg-type]
    ]
    intervals = []
    for settings in given:
        sink = at.WandbSink(
            init_kwargs={"dir": str(offline_wandb), "settings": settings}, log_flush_interval=0.3
        )
        sink.bind("p", "interval")
        await sink.open()
        intervals.append(sink.wandb_run.settings.x_transaction_log_flush_interval)
        await sink.close()
    assert intervals == [0.3, 0.3, 3.0]


def test_missing_wandb_names_the_extra() -> None:
    """Without wandb, WandbSink() fails with an ImportError naming the asynctrace[wandb] extra."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "sys.modules['wandb'] = None\n"
            "import asynctrace as at\n"
            "try:\n"
            "    at.WandbSink()\n"
            "except ImportError as exc:\n"
            "    print(exc)\n",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert 'pip install "asynctrace[wandb]"' in done.stdout


def test_importing_asynctrace_does_not_import_wandb() -> None:
    """`import asynctrace` leaves wandb unimported."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys, asynctrace\nprint('wandb' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_bad_arguments_are_refused_with_their_name() -> None:
    """Arguments the sink cannot use are refused when it is made, naming the argument."""
    with pytest.raises(ValueError, match="finish_timeout"):
        at.WandbSink(finish_timeout=0)
    with pytest.raises(ValueError, match="log_flush_interval"):
        at.WandbSink(log_flush_interval=-1)
    with pytest.raises(ValueError, match="table_prefix"):
        at.WandbSink(table_prefix=" ")
    with pytest.raises(ValueError, match="init_kwargs"):
        at.WandbSink(attach=True, init_kwargs={"project": "x"})
    with pytest.raises(ValueError, match="run"):
        at.WandbSink(run="a/b")
