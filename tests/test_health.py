"""The session's health as run metrics: drops, failures, the queue and each sink, under asynctrace/."""

from __future__ import annotations

from collections.abc import Mapping

import anyio
import pytest

import asynctrace as at
from asynctrace.sinks import Selected
from tests._util import sample

pytestmark = pytest.mark.anyio

# The explicit Trackio sinks run in a thread (`process=False`): these tests check the metrics in
# Trackio's store, not the writer process (a process start costs ~1.5 CPU-s). The capped-drop
# test keeps the default sink, and so its process.


def _health(sink: at.testing.MemorySink) -> list[tuple[int, dict[str, float]]]:
    return [(step, m) for step, m in sink.metrics if "asynctrace/submitted" in m]


def _trackio_logs(project: str, run: str) -> list[dict[str, object]]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(project, run)


async def test_a_capped_drop_shows_in_trackio(project: str) -> None:
    """Samples the cap drops show up as asynctrace/dropped/capped in Trackio's stored metrics."""
    async with at.TraceSession(project, run="h", max_traces_per_step=2) as s:
        await s.log_samples([sample(i, step=3) for i in range(10)], step=3)
    rows = [r for r in _trackio_logs(project, "h") if "asynctrace/dropped/capped" in r]
    assert rows, "no health metrics in Trackio"
    last = rows[-1]
    assert last["asynctrace/dropped/capped"] == 8 and last["step"] == 3
    assert last["asynctrace/written"] == 2 and last["asynctrace/sinks/trackio/written"] == 2


async def test_a_queue_full_drop_shows_in_trackio(project: str) -> None:
    """A drop_newest overflow of a tiny queue is logged as asynctrace/dropped/queue_full, equal
    to the session's own count."""
    slow = at.testing.MemorySink("slow", delay=0.05)
    async with at.TraceSession(
        project,
        run="q",
        sinks=[at.TrackioSink(process=False), slow],
        queue_size=2,
        on_full="drop_newest",
        batch_size=1,
    ) as s:
        for i in range(20):
            await s.log_samples([sample(i, step=1)], step=1)
    dropped = s.stats().dropped.get("queue_full", 0)
    assert dropped > 0
    rows = [r for r in _trackio_logs(project, "q") if "asynctrace/dropped/queue_full" in r]
    assert rows and rows[-1]["asynctrace/dropped/queue_full"] == dropped


async def test_health_is_logged_every_interval_at_the_highest_step() -> None:
    """While the run goes on, health metrics arrive every health_interval seconds, at the highest
    step the sinks were handed (a straggler of an older step does not move it back)."""
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], health_interval=0.05, flush_interval=0.01) as s:
        await s.log_samples([sample(0, step=5)], step=5)
        await s.log_samples([sample(1, step=2)], step=2)
        with anyio.fail_after(10):
            while not any(m["asynctrace/written"] == 2 for _, m in _health(sink)):
                await anyio.sleep(0.01)
        await s.log_samples([sample(2, step=7)], step=7)
    health = _health(sink)
    steps = [step for step, _ in health]
    assert steps == sorted(steps) and steps[0] == 5 and steps[-1] == 7
    final = health[-1][1]
    assert final["asynctrace/submitted"] == 3 and final["asynctrace/written"] == 3
    assert final["asynctrace/pending"] == 0 and final["asynctrace/dropped/total"] == 0


class _StuckOnce(at.testing.MemorySink):
    """Its first write_metrics waits until `release` is set."""

    def __init__(self) -> None:
        super().__init__("stuck")
        self.release = anyio.Event()

    async def write_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        await self.release.wait()
        await super().write_metrics(step, metrics)


async def test_a_stuck_sink_holds_one_health_point_not_one_per_interval() -> None:
    """While a sink is stuck, the health points it has not written do not pile up: it keeps the
    one in hand and one waiting, and the other sink gets every point meanwhile."""
    stuck, ok = _StuckOnce(), at.testing.MemorySink("ok")
    async with at.TraceSession("p", sinks=[stuck, ok], health_interval=0.02, flush_interval=0.01) as s:
        with anyio.fail_after(20):
            step = 0
            while len(_health(ok)) < 12:  # each point differs: a sample was logged since
                await s.log_samples([sample(step, step=step)], step=step)
                step += 1
                await anyio.sleep(0.01)
        held = len(_health(ok))
        stuck.release.set()
        assert await s.flush(timeout=10)
        # What the stuck sink got: the point it was stuck on, the one waiting, and at most the
        # few made while the flush ran; never the dozen it missed.
        assert len(_health(stuck)) <= 2 + len(_health(ok)) - held
    assert len(stuck.records) == len(ok.records) == step


async def test_health_counts_a_sinks_selection_and_failures() -> None:
    """Per-sink counts, a selection's skips by reason, and failures appear as run metrics."""
    archive = at.testing.MemorySink("archive")
    broken = at.testing.MemorySink("broken", fail_permanently=True)
    async with at.TraceSession(
        "p",
        sinks=[
            archive,
            Selected(at.testing.MemorySink("top"), max_traces_per_step=2, sampler="top_bottom"),
            broken,
        ],
    ) as s:
        await s.log_samples([sample(i) for i in range(6)], step=0)
    final = _health(archive)[-1][1]
    assert final["asynctrace/sinks/archive/written"] == 6
    assert final["asynctrace/sinks/top/written"] == 2 and final["asynctrace/sinks/top/skipped/capped"] == 4
    assert final["asynctrace/sinks/broken/failed"] == 6 and final["asynctrace/failed"] == 6


async def test_a_sink_name_keeps_its_letters_of_any_script_in_metric_names() -> None:
    """As health.md says, only characters other than letters, digits and `_.-` become `_`:
    letters outside ASCII stay, so sinks named in other scripts do not all become `_`."""
    archive = at.testing.MemorySink("archive")
    async with at.TraceSession("p", sinks=[archive, at.testing.MemorySink("évals/日本 x")]) as s:
        await s.log_samples([sample(0)], step=0)
    final = _health(archive)[-1][1]
    assert final["asynctrace/sinks/évals_日本_x/written"] == 1


async def test_health_metrics_can_be_switched_off() -> None:
    """health_metrics=False logs no asynctrace/ metrics; the caller's own metrics still go."""
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], health_metrics=False, health_interval=0.01) as s:
        await s.log_metrics({"loss": 1.0}, step=0)
        await s.log_samples([sample(0)], step=0)
        await anyio.sleep(0.05)
    assert sink.metrics == [(0, {"loss": 1.0})]


def test_health_arguments_are_checked() -> None:
    """A bad switch or interval gets a clear ValueError."""
    with pytest.raises(ValueError, match="health_metrics must be a bool"):
        at.TraceSession("p", sinks=[at.testing.MemorySink()], health_metrics="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="health_interval"):
        at.TraceSession("p", sinks=[at.testing.MemorySink()], health_interval=0)


async def _held_then_finish(project: str, tier: at.Sink, archive: at.testing.MemorySink) -> at.SessionStats:
    """Log a step a top_bottom tier holds, wait until a health point shows it held, finish."""
    async with at.TraceSession(
        project,
        run="g",
        sinks=[archive, Selected(tier, max_traces_per_step=2, sampler="top_bottom")],
        health_interval=0.05,
        flush_interval=0.01,
    ) as s:
        await s.log_samples([sample(i, step=1) for i in range(6)], step=1)
        # Every sink gets each health point: the archive's show when one with `held` went out.
        held = f"asynctrace/sinks/{tier.name}/held"
        with anyio.fail_after(20):
            while not any(m.get(held, 0) > 0 for _, m in _health(archive)):
                await anyio.sleep(0.01)
    return s.stats()


async def test_a_gauge_back_at_zero_is_logged_at_finish() -> None:
    """`held` logged while a tier held a step is logged again as 0 at finish, as stats() says."""
    archive = at.testing.MemorySink("archive")
    stats = await _held_then_finish("p", at.testing.MemorySink("top"), archive)
    assert stats.sinks["top"].held == 0
    health = _health(archive)
    assert any(m.get("asynctrace/sinks/top/held", 0) > 0 for _, m in health), "never logged held"
    assert health[-1][1]["asynctrace/sinks/top/held"] == 0
    # A sink that never held anything does not get the gauge at all.
    assert all("asynctrace/sinks/archive/held" not in m for _, m in health)


async def test_a_gauge_back_at_zero_reaches_trackio(project: str) -> None:
    """Trackio's stored last value of `held` is 0 after finish, not the count held mid-run."""
    await _held_then_finish(project, at.TrackioSink(process=False), at.testing.MemorySink("archive"))
    rows = [r for r in _trackio_logs(project, "g") if "asynctrace/sinks/trackio/held" in r]
    assert any(r["asynctrace/sinks/trackio/held"] > 0 for r in rows), "never logged held"
    assert rows[-1]["asynctrace/sinks/trackio/held"] == 0
