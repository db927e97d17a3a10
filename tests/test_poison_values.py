"""Values a sink cannot store, or that overflow a float, are refused at submission with the
documented error: never an OverflowError, never a failed write that takes valid records with it."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from trackio.sqlite_storage import SQLiteStorage

import asynctrace as at
from asynctrace.distributed import DistributedTraceLogger
from tests._util import read_traces, sample

HUGE = 10**400  # an int no float can hold: float(HUGE) raises OverflowError
LONE = "\ud800"  # a lone surrogate: no UTF-8 (JSON, SQLite, the spool) can hold it
BAD_STEPS = [2**63, 2**64 + 5]
BAD_SPLITS = [LONE, "eval" + LONE, "\udcff"]


def _overflowing(i: int, shape: str) -> Any:
    """A sample whose ranking score is `HUGE`, in each shape a caller can give it."""
    if shape == "reward":
        return sample(i, reward=HUGE)  # type: ignore[arg-type]
    if shape == "score":
        return {"prompt": f"q{i}", "response": "a", "score": HUGE}
    if shape == "nested_reward":
        return {"prompt": f"q{i}", "response": "a", "metadata": {"reward": HUGE}}
    if shape == "sample_score":
        return at.Sample(messages=[{"role": "user", "content": f"q{i}"}], score=HUGE)
    return at.Sample(messages=[{"role": "user", "content": f"q{i}"}], metadata={"reward": HUGE})


SHAPES = ["reward", "score", "nested_reward", "sample_score", "sample_reward"]


@pytest.mark.anyio
@pytest.mark.parametrize("sampler", ["top_bottom", "reservoir", "first"])
@pytest.mark.parametrize("shape", SHAPES)
async def test_an_overflowing_score_is_a_record_error(sampler: str, shape: str) -> None:
    """A score or reward of 10**400 raises RecordError from log_samples and log_samples_nowait,
    whatever the sampler and the sample's shape, and nothing of the call is counted."""
    async with at.TraceSession(
        "p", sinks=[at.testing.MemorySink()], max_traces_per_step=4, sampler=sampler
    ) as s:
        batch = [sample(0), _overflowing(1, shape), sample(2)]
        with pytest.raises(at.RecordError) as info:
            await s.log_samples(batch, step=0)
        assert info.value.index == 1
        with pytest.raises(at.RecordError):
            s.log_samples_nowait(batch, step=0)
        assert s.stats().submitted == 0


@pytest.mark.anyio
@pytest.mark.parametrize("sampler", ["top_bottom", "reservoir", "first"])
@pytest.mark.parametrize("shape", SHAPES)
async def test_an_overflowing_score_is_skipped_and_the_rest_kept(sampler: str, shape: str) -> None:
    """With on_invalid="skip" the overflowing sample is counted "invalid" and the valid samples of
    the same call are written."""
    sink = at.testing.MemorySink()
    async with at.TraceSession(
        "p", sinks=[sink], max_traces_per_step=8, sampler=sampler, on_invalid="skip"
    ) as s:
        assert await s.log_samples([sample(0), _overflowing(1, shape), sample(2)], step=0) == 2
        assert s.log_samples_nowait([sample(3), _overflowing(4, shape), sample(5)], step=0) == 2
    stats = s.stats()
    assert stats.dropped == {"invalid": 2} and stats.written == 4 and stats.check()
    assert sorted(r.sample.metadata["uid"] for r in sink.records) == ["0:0", "0:2", "0:3", "0:5"]


def test_the_blocking_form_skips_an_overflowing_score() -> None:
    """The blocking form, from the caller's thread, counts the overflowing sample as "invalid"."""
    sink = at.testing.MemorySink()
    with at.TraceSession(
        "p", sinks=[sink], max_traces_per_step=8, sampler="top_bottom", on_invalid="skip"
    ) as s:
        assert s.log_samples([sample(0), sample(1, reward=HUGE), sample(2)], step=0) == 2  # type: ignore[arg-type]
        assert s.log_samples_nowait([sample(3, reward=HUGE)], step=0) == 0  # type: ignore[arg-type]
    assert s.stats().dropped == {"invalid": 2} and len(sink.records) == 2


def _trackio() -> at.TrackioSink:
    """Real Trackio storage, written in this process (no writer process to start: faster)."""
    return at.TrackioSink(process=False)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_what_a_sink_cannot_store_is_refused_and_its_batch_survives(project: str) -> None:
    """A step beyond SQLite's INTEGER (2**63), a split or a metric name holding a lone surrogate
    and a metric value no float holds are a ValueError at submission; the valid records and
    metrics logged around them, which would share their batch, all reach Trackio."""
    async with at.TraceSession(project, run="r", sinks=[_trackio()], batch_size=256) as s:
        await s.log_samples([sample(i) for i in range(5)], step=0)
        await s.log_metrics({"loss": 0.5}, step=0)
        for step in BAD_STEPS:
            with pytest.raises(ValueError, match="step"):
                await s.log_samples([sample(9)], step=step)
            with pytest.raises(ValueError, match="step"):
                s.log_samples_nowait([sample(9)], step=step)
            with pytest.raises(ValueError, match="step"):
                await s.log_metrics({"loss": 1.0}, step=step)
        for split in BAD_SPLITS:
            for _ in range(2):  # the second time too, when the key of every valid split is cached
                with pytest.raises(ValueError, match="split"):
                    await s.log_samples([sample(9)], step=0, split=split)
                with pytest.raises(ValueError, match="split"):
                    s.log_samples_nowait([sample(9)], step=0, split=split)
        for metrics in ({"loss": HUGE}, {"loss" + LONE: 1.0}, {"loss": torch.ones(2)}):
            with pytest.raises(ValueError, match="loss"):
                await s.log_metrics(metrics, step=1)
        await s.log_samples([sample(i, step=1) for i in range(5)], step=1)
        await s.log_metrics({"loss": 0.25}, step=2)
    stats = s.stats()
    assert stats.written == 10 and stats.failed == 0 and stats.submitted == 10
    assert stats.sinks["trackio"].metrics_failed == 0
    assert len(read_traces(project, "r")) == 10
    assert [m["loss"] for m in SQLiteStorage.get_logs(project, "r") if "loss" in m] == [0.5, 0.25]


@pytest.mark.anyio
@pytest.mark.parametrize("step", BAD_STEPS)
async def test_a_step_a_sink_cannot_store_is_a_value_error(step: int) -> None:
    """Every logging call refuses step=2**63 and beyond with a ValueError naming step, counting nothing."""
    async with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as s:
        with pytest.raises(ValueError, match="step"):
            await s.log_samples([sample(9)], step=step)
        with pytest.raises(ValueError, match="step"):
            s.log_samples_nowait([sample(9)], step=step)
        with pytest.raises(ValueError, match="step"):
            await s.log_metrics({"loss": 1.0}, step=step)
        assert await s.log_samples([sample(0)], step=2**63 - 1) == 1
    assert s.stats().submitted == 1


def test_the_blocking_form_refuses_bad_steps_and_splits() -> None:
    """The blocking form (another thread's call) refuses them too, counting nothing."""
    with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as s:
        with pytest.raises(ValueError, match="step"):
            s.log_samples([sample(0)], step=2**63)
        with pytest.raises(ValueError, match="split"):
            s.log_samples([sample(0)], step=0, split=LONE)
        with pytest.raises(ValueError, match="step"):
            s.log_metrics({"loss": 1.0}, step=2**63)
        assert s.stats().submitted == 0


SURROGATE_SAMPLES: dict[str, Any] = {
    "message content": {"messages": [{"role": "user", "content": "x" + LONE}]},
    "message role": {"messages": [{"role": "us" + LONE, "content": "x"}]},
    "metadata value": sample(1, note="n" + LONE),
    "metadata key": {"prompt": "q", "k" + LONE: 1},
    "nested key": {"prompt": "q", "metadata": {"deep": {LONE: 1}}},
    "span": {"prompt": "q", "spans": [{"name": LONE}]},
    "sample": at.Sample(messages=[{"role": "user", "content": LONE}]),
}


@pytest.mark.anyio
@pytest.mark.parametrize("where", sorted(SURROGATE_SAMPLES))
async def test_a_lone_surrogate_in_a_sample_is_a_record_error(where: str) -> None:
    """A lone surrogate anywhere in a sample is a RecordError naming the sample."""
    async with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as s:
        with pytest.raises(at.RecordError) as info:
            await s.log_samples([sample(0), SURROGATE_SAMPLES[where]], step=0)
        assert info.value.index == 1


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_samples_with_lone_surrogates_are_skipped_and_the_rest_stored(project: str) -> None:
    """Under on_invalid="skip" each is counted "invalid" and every valid sample reaches Trackio."""
    bad = list(SURROGATE_SAMPLES.values())
    async with at.TraceSession(project, run="r", sinks=[_trackio()], on_invalid="skip") as s:
        assert await s.log_samples([x for b in bad for x in (sample(0), b)], step=0) == len(bad)
    stats = s.stats()
    assert stats.written == len(bad) and stats.failed == 0 and stats.dropped == {"invalid": len(bad)}
    assert len(read_traces(project, "r")) == len(bad)


@pytest.mark.parametrize(
    "make",
    [
        lambda: at.TraceSession("p" + LONE, sinks=[at.testing.MemorySink()]),
        lambda: at.TraceSession("p", run="r" + LONE, sinks=[at.testing.MemorySink()]),
        lambda: at.TraceSession("p", sinks=[at.testing.MemorySink()], trace_key="{split}/t" + LONE),
        lambda: at.TrackioSink(project="p" + LONE),
    ],
    ids=["project", "run", "trace_key", "sink project"],
)
def test_names_a_sink_cannot_store_are_refused_at_construction(make: Any) -> None:
    """Project and run names and the trace key holding a lone surrogate are a ValueError up front."""
    with pytest.raises(ValueError, match="surrogate"):
        make()


@pytest.mark.parametrize("value", [HUGE, 2**1100])
def test_overflowing_seconds_are_a_value_error_at_construction(value: int) -> None:
    """Constructor seconds that no float can hold are a ValueError naming them, not an OverflowError."""
    for name in ("finish_timeout", "flush_interval", "step_timeout"):
        with pytest.raises(ValueError, match=name):
            at.TraceSession("p", sinks=[at.testing.MemorySink()], **{name: value})
    with pytest.raises(ValueError, match="attempt_timeout"):
        at.RetryPolicy(attempt_timeout=value)


def test_overflowing_install_shutdown_hooks_timeout_is_a_value_error() -> None:
    """install_shutdown_hooks(timeout=10**400) is a ValueError naming timeout."""
    with (
        at.TraceSession("p", sinks=[at.testing.MemorySink()]) as s,
        pytest.raises(ValueError, match="timeout"),
    ):
        at.install_shutdown_hooks(s.session, timeout=HUGE)


def test_distributed_logger_refuses_what_a_sink_cannot_store(project: str) -> None:
    """The distributed logger refuses a bad step or split with ValueError and an overflowing score
    with RecordError (skipped under "skip"), and writes the valid samples."""
    with DistributedTraceLogger(
        project,
        "solo",
        mode="global",
        max_traces_per_step=8,
        sampler="top_bottom",
        on_invalid="skip",
        sinks=[_trackio()],
    ) as logger:
        with pytest.raises(ValueError, match="step"):
            logger.log_samples([sample(0)], step=2**63)
        with pytest.raises(ValueError, match="split"):
            logger.log_samples([sample(0)], step=0, split=LONE)
        with pytest.raises(ValueError, match="step"):
            logger.end_step(2**63)
        assert logger.log_samples([sample(0), sample(1, reward=HUGE), sample(2)], step=0) == 2  # type: ignore[arg-type]
        logger.end_step(0)
    stats = logger.stats()
    assert stats.dropped == {"invalid": 1}
    assert len(read_traces(project, "solo")) == 2


def test_distributed_logger_raises_record_error_for_an_overflowing_score() -> None:
    """Under on_invalid="raise" the overflowing score is a RecordError, not an OverflowError."""
    with DistributedTraceLogger(
        "p",
        "solo",
        mode="global",
        max_traces_per_step=8,
        sampler="top_bottom",
        sinks=[at.testing.MemorySink()],
    ) as logger:
        with pytest.raises(at.RecordError, match="sample 1"):
            logger.log_samples([sample(0), sample(1, reward=HUGE)], step=0)  # type: ignore[arg-type]
        assert logger.stats().submitted == 0


@pytest.mark.anyio
async def test_no_wait_overflows_at_the_largest_float_timeout() -> None:
    """The largest finite float as a timeout is a wait without a practical limit, not an error."""
    big = 1.7976931348623157e308
    with anyio.fail_after(20):
        async with at.TraceSession("p", sinks=[at.testing.MemorySink()], finish_timeout=big) as s:
            assert await s.log_samples([sample(0)], step=0, timeout=big) == 1
            assert await s.flush(timeout=big)
            stats = await s.finish(timeout=big)
    assert stats.written == 1


@pytest.mark.anyio
@pytest.mark.parametrize("sampler", ["first", "top_bottom", "reservoir"])
async def test_a_cap_no_float_holds_caps_nothing(sampler: str) -> None:
    """max_traces_per_step=10**400 is a valid (if pointless) cap: top_bottom splits it in ints
    instead of failing with OverflowError on a step's first sample."""
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], max_traces_per_step=HUGE, sampler=sampler) as s:
        assert await s.log_samples([sample(i) for i in range(5)], step=0) == 5
    assert s.stats().written == 5


@pytest.mark.parametrize("name", ["initial_backoff", "max_backoff"])
def test_a_backoff_no_float_holds_is_a_value_error(name: str) -> None:
    """RetryPolicy refuses a backoff of 10**400 up front, not in the writer's sleep."""
    with pytest.raises(ValueError, match=name):
        at.RetryPolicy(**{name: HUGE})


@pytest.mark.parametrize("trace_key", ["{split.nope}/traces", "{split[3]}/traces"])
def test_a_trace_key_that_cannot_take_the_split_is_a_value_error(trace_key: str) -> None:
    """A trace_key whose format fails (an attribute, an index past a short split) is a ValueError
    naming trace_key, at construction or at the call that logs the split, never another type."""
    try:
        session = at.TraceSession("p", sinks=[at.testing.MemorySink()], trace_key=trace_key)
    except ValueError as exc:
        assert "trace_key" in str(exc)
        return
    with session as s:
        with pytest.raises(ValueError, match="trace_key"):
            s.log_samples([sample(0)], step=0, split="ab")
        assert s.stats().submitted == 0


@pytest.mark.parametrize("project", [5, "", None])
def test_sink_project_of_the_wrong_type_is_a_value_error(project: Any) -> None:
    """TrackioSink(project=5) is a ValueError naming project (it was a TypeError); None means the
    session's project."""
    if project is None:
        at.TrackioSink(project=project)
        return
    with pytest.raises(ValueError, match="project"):
        at.TrackioSink(project=project)


TRACKIO_NAMES = [
    "ok",
    "my.model",
    "registry-x",
    "Registry-x",
    "m_traces",
    "_traces",
    "m.traces",
    "m_system",
    "m_configs",
    "m_artifact_versions",
    "m_external_run_artifact_links",
    "x" * 219,
    "x" * 220,
    "実" * 73,
    "実" * 74,
    "a.b" * 200,
]


@pytest.mark.parametrize("name", TRACKIO_NAMES, ids=lambda n: n[:24])
def test_project_names_trackio_refuses_are_refused_at_construction(name: str) -> None:
    """A project name Trackio itself refuses, or too long for its file names, is a ValueError
    when the session (or the sink) is made, never a sink that fails to open and fails the run."""
    refused = False
    try:
        SQLiteStorage.validate_project_name(name)
    except ValueError:
        refused = True
    canonical = "".join(c for c in name if c.isalnum() or c in "-_")
    refused = refused or len(canonical.encode()) + len("_external_run_artifact_links.parquet") > 255
    if refused:
        with pytest.raises(ValueError, match="project"):
            at.TraceSession(name, sinks=[at.TrackioSink()])
        with pytest.raises(ValueError, match="project"):
            at.TrackioSink(project=name)
    else:
        at.TraceSession(name, sinks=[at.TrackioSink()])
        at.TrackioSink(project=name)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_longest_accepted_project_name_is_stored(project: str) -> None:
    """The longest project name accepted opens in Trackio and its records are written."""
    name = project + "x" * (219 - len(project))
    async with at.TraceSession(name, run="r", sinks=[_trackio()]) as s:
        await s.log_samples([sample(0)], step=0)
    assert s.stats().written == 1 and len(read_traces(name, "r")) == 1


class _Args:
    """An argparse-like config object: Trackio stores its public attributes."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


BAD_INIT_KWARGS = [
    {"config": {"lr": "x" + LONE}},
    {"config": {"k" + LONE: 1}},
    {"config": {"big": HUGE}},
    {"config": {"nested": [{"deep": (1, LONE)}]}},
    {"config": _Args(note=LONE)},
    {"group": "g" + LONE},
]


@pytest.mark.parametrize("init_kwargs", BAD_INIT_KWARGS, ids=range(len(BAD_INIT_KWARGS)))
def test_init_kwargs_trackio_cannot_store_are_refused_at_construction(init_kwargs: Any) -> None:
    """A config or group Trackio could not store (a lone surrogate, an int beyond 64 bits) is a
    ValueError naming init_kwargs when the sink is made."""
    with pytest.raises(ValueError, match="init_kwargs"):
        at.TrackioSink(init_kwargs=init_kwargs)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_storable_config_reaches_trackio(project: str) -> None:
    """Ordinary configs (numbers, NaN, numpy scalars, 64-bit ints, objects) still open the run,
    and its records are written."""
    import numpy as np

    config = {"lr": 1e-4, "nan": float("nan"), "n": np.int64(3), "u": 2**64 - 1, "args": _Args(x=1)}
    async with at.TraceSession(
        project, run="r", sinks=[at.TrackioSink(process=False, init_kwargs={"config": config})]
    ) as s:
        await s.log_samples([sample(0)], step=0)
    assert s.stats().written == 1 and len(read_traces(project, "r")) == 1
