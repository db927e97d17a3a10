"""TraceCollector and TraceClient on a real local Ray cluster, writing to real Trackio storage."""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

ray = pytest.importorskip("ray")

from asynctrace import Sink, TraceRecord  # noqa: E402
from asynctrace.ray import ClientStats, TraceClient, start_collector  # noqa: E402
from asynctrace.testing import MemorySink  # noqa: E402
from tests.distributed._helpers import make_samples, read_traces, top_bottom_uids, uids_by_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _waited_for_cpu() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (Linux's schedstat; 0 where
    there is none): on a loaded machine a call's wall time includes them although the call
    itself waited for nothing."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class _Rollout:
    """A rollout actor: produces samples and logs them through a TraceClient of its own, to
    whichever collector a test `connect`s it to."""

    def connect(self, collector: Any, tag: str, **client_kwargs: Any) -> None:
        self.tag = tag
        self.client = TraceClient(collector, **client_kwargs)
        self.max_call = 0.0

    def _log(self, samples: list[dict[str, Any]], step: int) -> None:
        # The call's time less what it spent queued for a CPU: what it waited for, if anything,
        # plus its own work; the bound tests assert stays a bound on a busy machine.
        t, queued = time.perf_counter(), _waited_for_cpu()
        self.client.log_samples_nowait(samples, step=step)
        spent = time.perf_counter() - t - (_waited_for_cpu() - queued)
        self.max_call = max(self.max_call, spent)

    def generate(self, step: int, n: int, chunk: int = 10) -> list[dict[str, Any]]:
        samples = make_samples(self.tag, step, n, seed=0)
        for i in range(0, n, chunk):
            self._log(samples[i : i + chunk], step)
        return [{"uid": s["uid"], "reward": s["reward"]} for s in samples]

    def stream(
        self, seconds: float, chunk: int = 10, *, until_gone: bool = False, until_pushed_back: bool = False
    ) -> dict[str, Any]:
        """Log as fast as a busy rollout loop would for `seconds` (with `until_gone`, also until the
        client has seen the collector die; with `until_pushed_back`, until it had to drop samples
        as "queue_full"; then a little after; 120 s at most); report call latencies."""
        start = time.monotonic()
        end = start + seconds
        calls = 0
        step = 0
        waiting = until_gone or until_pushed_back
        while time.monotonic() < end or (waiting and time.monotonic() < start + 120):
            if waiting and time.monotonic() >= end:
                stats = self.client.stats()
                if (until_gone and stats.collector_gone) or (
                    until_pushed_back and stats.dropped.get("queue_full")
                ):
                    waiting, end = False, time.monotonic() + 0.5
            self._log(make_samples(self.tag, step, chunk, seed=calls), step)
            calls += 1
            if calls % 20 == 0:
                step += 1
            time.sleep(0.002)
        return {"calls": calls, "max_call": self.max_call, "stats": self.client.stats()}

    def stats(self) -> ClientStats:
        return self.client.stats()

    def close(self, timeout: float) -> tuple[ClientStats, float]:
        """Close the client; with its stats, how long the close took, less its wait for a CPU."""
        t, queued = time.monotonic(), _waited_for_cpu()
        stats = self.client.close(timeout)
        return stats, time.monotonic() - t - (_waited_for_cpu() - queued)

    def log_errors_to(self, path: str) -> int:
        """Send asynctrace's log records to a file (the test reads it after the process is gone)."""
        logging.getLogger("asynctrace").addHandler(logging.FileHandler(path))
        return os.getpid()


Rollout: Any = ray.remote(_Rollout)


@pytest.fixture(scope="module")
def pool(ray_cluster: None) -> list[Any]:
    """Four rollout actors for the tests that do not end one (an actor process takes seconds
    to start); two threads each, so `stats` answers while `stream` runs."""
    actors = [Rollout.options(max_concurrency=2).remote() for _ in range(4)]
    ray.get([a.__ray_ready__.remote() for a in actors])
    return actors


def _connected(actors: list[Any], collector: Any, tag: str, **client_kwargs: Any) -> list[Any]:
    """`actors`, each logging through a new client of `collector` (tagged `tag` and its index)."""
    ray.get([a.connect.remote(collector, f"{tag}{i}", **client_kwargs) for i, a in enumerate(actors)])
    return actors


def _wait_for_exit(pid: int, timeout: float = 60.0) -> None:
    # Ray reports the actor dead as soon as it starts exiting; its atexit hooks run after that.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not exit within {timeout}s")


def test_cap_and_top_bottom_hold_across_actors(project: str, pool: list[Any]) -> None:
    """4 actors x 1000 samples over 10 steps: Trackio holds exactly the 16 true top/bottom samples
    of each step across all actors, and the accounting of every process adds up."""
    collector = start_collector(
        project,
        "rollouts",
        max_traces_per_step=16,
        sampler="top_bottom",
        max_open_steps=10,  # actors may run ahead of one another by a few steps
        step_timeout=None,
        finish_at_exit=False,
    )
    actors = _connected(pool, collector, "a", flush_interval=0.05)
    produced: dict[int, list[dict[str, Any]]] = {}
    for step in range(10):
        for rows in ray.get([a.generate.remote(step, 100) for a in actors]):
            produced.setdefault(step, []).extend(rows)
    client_stats = [s for s, _ in ray.get([a.close.remote(30.0) for a in actors])]
    final = ray.get(collector.finish.remote())

    written = uids_by_step(project, "rollouts")
    assert sorted(written) == list(range(10))
    for step, uids in written.items():
        assert len(uids) == 16
        assert uids == top_bottom_uids(produced[step], 16)

    assert all(s.check() for s in client_stats)
    assert sum(s.submitted for s in client_stats) == 4000
    # Each client ships only its 16 candidates of each step; the rest is capped where it was logged.
    assert all(s.delivered == 160 and dict(s.dropped) == {"capped": 840} for s in client_stats)
    assert sum(s.delivered for s in client_stats) == final.submitted == 640
    assert final.check()
    assert final.written == 160
    assert dict(final.dropped) == {"capped": 480}


def test_straggler_step_is_counted_late(project: str) -> None:
    """A step that arrives after the collector closed it is dropped there as "late", not written."""
    # Only the collector's counts are checked: a MemorySink spares a Trackio writer process.
    collector = start_collector(
        project,
        "late",
        sinks=[MemorySink()],
        max_traces_per_step=4,
        sampler="top_bottom",
        max_open_steps=0,
        finish_at_exit=False,
    )
    with TraceClient(collector, flush_interval=0.01) as fast, TraceClient(collector) as straggler:
        fast.log_samples_nowait(make_samples("fast", 5, 10, seed=0), step=5)
        assert fast.flush(30.0)
        fast.log_samples_nowait(make_samples("fast", 6, 10, seed=0), step=6)  # closes step 5
        assert fast.flush(30.0)
        straggler.log_samples_nowait(make_samples("slow", 5, 10, seed=0), step=5)
        assert straggler.flush(30.0)
    final = ray.get(collector.finish.remote())
    # The straggler ships only its 4 candidates of step 5 (its other 6 are capped locally).
    assert straggler.stats().dropped == {"capped": 6}
    assert final.dropped.get("late") == 4
    assert final.written == 8
    assert final.check()


def test_killed_collector_never_blocks_clients(project: str, pool: list[Any]) -> None:
    """Killing the collector mid-run: actors keep logging without blocking, count their drops, and
    what the collector had already written stays in Trackio."""
    collector = start_collector(project, "killed", flush_interval=0.05, finish_at_exit=False)
    actors = _connected(pool[:2], collector, "k", flush_interval=0.02)
    # The actors keep logging until they saw the collector die, however long it takes to write.
    runs = [a.stream.remote(4.0, until_gone=True) for a in actors]
    deadline = time.monotonic() + 90

    def mid_run() -> bool:
        # Kill it mid-run: once it has written something and each actor, however late a loaded
        # machine started its process, has had samples delivered.
        delivered = [s.delivered for s in ray.get([a.stats.remote() for a in actors])]
        return ray.get(collector.stats.remote()).written >= 100 and min(delivered) > 0

    while not mid_run() and time.monotonic() < deadline:
        time.sleep(0.05)
    ray.kill(collector, no_restart=True)
    results = ray.get(runs, timeout=60)
    closed = ray.get([a.close.remote(2.0) for a in actors], timeout=60)

    for result, (stats, close_seconds) in zip(results, closed, strict=True):
        assert result["max_call"] < 0.25  # a call is an encode and an append, never a wait
        assert close_seconds < 2.5
        assert stats.check()
        assert stats.submitted == result["calls"] * 10
        assert stats.collector_gone
        assert stats.delivered > 0
        assert stats.dropped["collector_gone"] > 0
        assert stats.in_flight == 0 and stats.buffered == 0
        assert set(stats.dropped) <= {"collector_gone"}
    delivered = sum(s.delivered for s, _ in closed)
    survived = len(read_traces(project, "killed"))
    assert 0 < survived <= delivered


def test_slow_collector_bounds_client_memory(project: str, pool: list[Any]) -> None:
    """A collector whose sink hangs pushes back: clients hold at most their bound and drop the rest as
    "queue_full", while their calls stay fast."""
    collector = start_collector(
        sinks=[MemorySink(hang=True)],
        project=project,
        queue_size=100,
        on_full="block",
        finish_timeout=1.0,
        ingest_timeout=30.0,
        finish_at_exit=False,
    )
    client_kwargs = {"batch_size": 50, "max_in_flight": 2, "max_buffered": 200, "flush_interval": 0.01}
    (actor,) = _connected(pool[:1], collector, "slow", **client_kwargs)
    for step in range(4):
        ray.get(actor.generate.remote(step, 500, 50))
        time.sleep(0.2)
    stats, _ = ray.get(actor.close.remote(0.5))
    ray.kill(collector, no_restart=True)

    assert stats.check()
    assert stats.submitted == 2000
    assert stats.delivered <= 100  # all the collector's queue could take; its sink never returns
    held_at_close = stats.in_flight + stats.dropped.get("close_timeout", 0)
    assert held_at_close <= 200  # the client's bound: buffered plus in flight
    assert stats.dropped["queue_full"] >= 2000 - 200 - stats.delivered
    assert ray.get(actor.stream.remote(0.1))["max_call"] < 0.25


def test_graceful_exit_finishes_but_kill_does_not(project: str) -> None:
    """Held top/bottom samples are written when the collector exits gracefully (atexit runs) and are
    lost when it is killed: what `docs/distributed.md` says survives what."""
    runs = {"terminated": "__ray_terminate__", "killed": "kill"}
    for run, how in runs.items():
        collector = start_collector(
            project, run, max_traces_per_step=4, sampler="top_bottom", step_timeout=None, finish_at_exit=False
        )
        with TraceClient(collector) as client:
            client.log_samples_nowait(make_samples(run, 0, 20, seed=0), step=0)
            assert client.flush(30.0)
        assert ray.get(collector.stats.remote()).pending == 4  # held until step 0 closes
        pid = ray.get(collector.ready.remote())["pid"]
        if how == "kill":
            ray.kill(collector, no_restart=True)
        else:
            collector.__ray_terminate__.remote()
        _wait_for_exit(pid)
    assert len(read_traces(project, "terminated")) == 4
    assert read_traces(project, "killed") == []


def test_client_validates_in_the_caller(project: str) -> None:
    """An invalid sample raises RecordError in the actor's own call and nothing of the call is kept;
    with on_invalid="skip" it is counted as dropped ("invalid")."""
    from asynctrace import RecordError

    # Only the counts are checked: a MemorySink spares the collector a Trackio writer process.
    collector = start_collector(project, "invalid", sinks=[MemorySink()], finish_at_exit=False)
    bad: list[dict[str, Any]] = [
        {"prompt": "ok", "response": "fine"},
        {"prompt": "q", "response": "a", "when": {1, 2}},
    ]
    client = TraceClient(collector)
    with pytest.raises(RecordError, match=r"sample 1: metadata\.when"):
        client.log_samples_nowait(bad, step=0)
    assert client.stats().submitted == 0
    skipping = TraceClient(collector, on_invalid="skip")
    assert skipping.log_samples_nowait(bad, step=0) == 1
    stats = skipping.close(30.0)
    assert Counter(stats.dropped) == Counter({"invalid": 1})
    assert stats.delivered == 1
    client.close(1.0)
    # What is checked is where validation happens, not how fast: the finish has room to spare on
    # a loaded machine (a Trackio writer's start once took past the 30 s default there).
    assert ray.get(collector.finish.remote(75.0)).written == 1


def _blocked_collector(project: str, ingest_timeout: float) -> Any:
    """A collector with room for one sample, behind a sink that never answers: calls wait for room."""
    return start_collector(
        project,
        sinks=[MemorySink(hang=True)],
        queue_size=1,
        on_full="block",
        ingest_timeout=ingest_timeout,
        finish_at_exit=False,
    )


def _wire(step: int, n: int) -> tuple[str, int, list[bytes]]:
    return ("train", step, [orjson.dumps({"prompt": f"q{i}", "response": "a"}) for i in range(n)])


def test_ingest_call_waits_one_ingest_timeout_in_all(project: str) -> None:
    """An ingest call of several (split, step) groups that finds no room returns after ingest_timeout,
    not after one ingest_timeout per group."""
    collector = _blocked_collector(project, ingest_timeout=1.0)
    t = time.monotonic()
    accepted = ray.get(collector.ingest_encoded.remote([_wire(step, 2) for step in range(5)]))
    took = time.monotonic() - t
    stats = ray.get(collector.stats.remote())
    ray.kill(collector, no_restart=True)
    assert took < 2.5
    assert accepted == 1 and stats.dropped.get("queue_full") == 9


def test_client_merges_consecutive_calls_for_a_step(project: str) -> None:
    """Consecutive log calls for one step travel as one (split, step) group, and the merged batch
    reaches the collector whole."""
    collector = start_collector(project, sinks=[MemorySink()], finish_at_exit=False)
    client = TraceClient(collector, flush_interval=60.0)
    for step in (0, 0, 0, 1, 1, 0):
        client.log_samples_nowait(make_samples("m", step, 2, seed=0), step=step)
    with client._lock:  # take the batch the shipping thread would send
        call = client._out.take_batch()
    wire = call.parts
    # No cap: nothing is selected locally, so the groups go without a part (-1) or rows.
    assert [(split, step, part, len(p), rows) for split, step, part, p, rows in wire] == [
        ("train", 0, -1, 6, []),
        ("train", 1, -1, 4, []),
        ("train", 0, -1, 2, []),
    ]
    client._ship(call)
    stats = client.close(30.0)
    assert stats.check() and stats.delivered == 12
    assert ray.get(collector.finish.remote()).written == 12


def test_flush_racing_finish_reports_what_finish_left(project: str) -> None:
    """collector.flush() during or after a finish() that left samples unwritten returns False instead of
    hanging or claiming success, and finish() stays within its deadline."""
    collector = start_collector(
        project, sinks=[MemorySink(hang=True)], finish_timeout=1.0, finish_at_exit=False
    )
    ray.get(collector.ingest.remote(make_samples("f", 0, 1, seed=0), step=0))
    before = collector.flush.remote()  # waits on the hanging sink
    time.sleep(0.3)
    t = time.monotonic()
    finishing = collector.finish.remote(1.0)
    time.sleep(0.3)
    during = collector.flush.remote()  # finish() is under way
    final = ray.get(finishing, timeout=30)
    assert time.monotonic() - t < 5.0
    assert final.pending == 1
    assert ray.get([before, during], timeout=10) == [False, False]
    assert ray.get(collector.flush.remote(), timeout=10) is False
    ray.kill(collector, no_restart=True)


def test_unclosed_client_in_an_exiting_actor_reports_its_loss(project: str, tmp_path: Any) -> None:
    """An actor that exits with samples in an unclosed client logs how many were lost (Ray has
    disconnected the process, so nothing can be shipped) instead of dying silently in a remote call."""
    collector = start_collector(project, sinks=[MemorySink()], finish_at_exit=False)
    actor = Rollout.remote()  # its own: the test ends it
    ray.get(actor.connect.remote(collector, "exit", flush_interval=60.0))
    log = tmp_path / "actor.log"
    pid = ray.get(actor.log_errors_to.remote(str(log)))
    ray.get(actor.generate.remote(0, 5, 5))
    actor.__ray_terminate__.remote()
    _wait_for_exit(pid)
    assert "5 buffered samples were lost" in log.read_text()
    assert ray.get(collector.finish.remote()).submitted == 0


def _stuck_client(project: str) -> tuple[Any, TraceClient]:
    """A client with one call stuck on a collector whose sink hangs, and samples buffered behind it."""
    collector = _blocked_collector(project, ingest_timeout=60.0)
    client = TraceClient(collector, batch_size=1, max_in_flight=1, flush_interval=0.01)
    client.log_samples_nowait(make_samples("stuck", 0, 5, seed=0), step=0)
    deadline = time.monotonic() + 30
    while client.stats().delivered < 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # the first call fills the collector's queue; the next one waits there
    return collector, client


def test_second_close_after_a_deadline_returns_at_once(project: str) -> None:
    """A close() after one that reached its deadline on an unresponsive collector returns the same
    stats at once instead of waiting out a deadline again."""
    collector, client = _stuck_client(project)
    first = client.close(1.0)
    t = time.monotonic()
    second = client.close(1.0)
    took = time.monotonic() - t
    ray.kill(collector, no_restart=True)
    assert first.in_flight == 1 and first.dropped.get("close_timeout") == 3
    assert took < 0.5
    assert second == first


def test_concurrent_close_waits_for_the_one_under_way(project: str) -> None:
    """A close() from another thread while one is draining waits for it to end and returns its final
    stats, instead of cutting its drain short with a shorter deadline of its own."""
    collector, client = _stuck_client(project)
    took: dict[str, float] = {}
    results: dict[str, ClientStats] = {}

    def close(name: str, timeout: float) -> None:
        t = time.monotonic()
        results[name] = client.close(timeout)
        took[name] = time.monotonic() - t

    first = threading.Thread(target=close, args=("first", 1.5))
    second = threading.Thread(target=close, args=("second", 0.1))
    first.start()
    deadline = time.monotonic() + 10
    while client._finish.open and time.monotonic() < deadline:
        time.sleep(0.01)  # the first close() is under way before the second begins
    time.sleep(0.2)
    second.start()
    first.join(30)
    second.join(30)
    ray.kill(collector, no_restart=True)
    # The second waited out what was left of the first one's 1.5 s, not its own 0.1 s.
    assert took["second"] > 0.5, took
    assert results["second"] == results["first"]
    assert results["first"].dropped.get("close_timeout") == 3


def test_close_reentered_from_a_signal_handler_returns(project: str) -> None:
    """A close() from a signal handler that interrupts a close() on the same thread returns at
    once instead of waiting on the one it interrupted (which can never finish meanwhile)."""
    collector, client = _stuck_client(project)
    inner: list[ClientStats] = []

    def handler(signum: int, frame: Any) -> None:
        inner.append(client.close(0.5))

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        t = time.monotonic()
        outer = client.close(2.0)
        took = time.monotonic() - t
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        ray.kill(collector, no_restart=True)
    assert len(inner) == 1 and took < 10
    assert outer.dropped.get("close_timeout") == 3


def test_infinite_timeouts_of_the_client_are_no_limit(project: str) -> None:
    """flush(inf) and close(inf) mean no limit, for the client and the collector (also once
    finished): they wait like None instead of raising OverflowError."""
    collector = start_collector(project, sinks=[MemorySink()], finish_at_exit=False)
    try:
        client = TraceClient(collector, batch_size=4, flush_interval=0.01)
        client.log_samples_nowait(make_samples("inf", 0, 5, seed=0), step=0)
        assert client.flush(float("inf"))
        assert client.close(float("inf")).delivered == 5
        assert ray.get(collector.flush.remote(float("inf")))
        ray.get(collector.finish.remote())
        assert ray.get(collector.flush.remote(float("inf")))  # answered by the finished session
    finally:
        ray.kill(collector, no_restart=True)


def test_client_refuses_what_a_sink_cannot_store(project: str) -> None:
    """A step beyond SQLite's INTEGER or a split with a lone surrogate is a ValueError in the
    client's caller; an overflowing score is a RecordError (skipped under "skip"); the valid
    samples shipped around them all reach Trackio instead of failing in one write."""
    from asynctrace import RecordError

    collector = start_collector(project, "poison", finish_at_exit=False)
    client = TraceClient(collector, on_invalid="skip")
    good = [{"prompt": f"q{i}", "response": "a", "reward": float(i)} for i in range(4)]
    assert client.log_samples_nowait(good[:2], step=0) == 2
    with pytest.raises(ValueError, match="step"):
        client.log_samples_nowait(good[:1], step=2**63)
    with pytest.raises(ValueError, match="split"):
        client.log_samples_nowait(good[:1], step=0, split="\ud800")
    assert client.log_samples_nowait([*good[2:], {"prompt": "q", "score": 10**400}], step=1) == 2
    strict = TraceClient(collector)
    with pytest.raises(RecordError):
        strict.log_samples_nowait([{"prompt": "q", "k\ud800": 1}], step=0)
    strict.close(1.0)
    stats = client.close(30.0)
    assert stats.delivered == 4 and Counter(stats.dropped) == Counter({"invalid": 1})
    final = ray.get(collector.finish.remote())
    assert final.written == 4 and final.failed == 0
    assert len(read_traces(project, "poison")) == 4


def test_sigterm_keeps_its_deadline_while_a_finish_is_under_way(project: str) -> None:
    """A SIGTERM from outside Ray, landing while a finish(60) is under way behind a sink that
    never answers, ends the collector within its SIGTERM bound instead of waiting out that finish."""
    from asynctrace._runtime.lifecycle import finish_bound

    collector = start_collector(
        project,
        sinks=[MemorySink(hang=True)],
        finish_timeout=60.0,
        sigterm_timeout=0.5,
        finish_at_exit=False,
    )
    pid = ray.get(collector.ready.remote())["pid"]
    ray.get(collector.ingest.remote(make_samples("t", 0, 1, seed=0), step=0))
    finishing = collector.finish.remote(60.0)
    time.sleep(1.0)  # that finish holds the collector's finish lock (sooner would only pass vacuously)
    sent = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    _wait_for_exit(pid, timeout=60.0)
    took = time.monotonic() - sent
    del finishing
    # The bound is 0.5 + 2 + 0.5 + 1 s; the slack is for a loaded machine, far below finish(60).
    assert took < finish_bound(0.5) + 1.0 + 6.0, f"the collector exited {took:.1f}s after SIGTERM"


def test_collector_queue_stays_bounded_with_a_holding_sampler(project: str, pool: list[Any]) -> None:
    """A client streaming step after step into a collector whose session keeps top_bottom
    selections, behind a sink slower than the stream, until the collector pushes back (its
    ingest calls wait for room, so the client's own bounded buffer fills): the collector's queue
    never holds more than queue_size plus a selection per open step."""
    collector = start_collector(
        sinks=[MemorySink(delay=0.5)],
        project=project,
        sampler="top_bottom",
        max_traces_per_step=8,
        queue_size=100,
        max_open_steps=2,
        on_full="block",
        finish_timeout=2.0,
        ingest_timeout=30.0,
        finish_at_exit=False,
    )
    (actor,) = _connected(pool[:1], collector, "bound", batch_size=50, max_buffered=100, flush_interval=0.01)
    streaming = actor.stream.remote(1.0, 5, until_pushed_back=True)
    peak = 0
    while not ray.wait([streaming], timeout=0.02)[0]:
        peak = max(peak, ray.get(collector.stats.remote()).queue_depth)
    result = ray.get(streaming)
    ray.get(actor.close.remote(0.5))
    ray.kill(collector, no_restart=True)
    assert result["stats"].check()
    assert result["stats"].dropped.get("queue_full", 0) > 0  # the stream outran the sink
    assert 0 < peak <= 100 + 8 * 3, peak


def test_collector_refuses_a_factory_session_that_raises_on_invalid() -> None:
    """A session_factory whose session would raise on invalid samples is refused, not rewritten."""
    from asynctrace import TraceSession
    from asynctrace.ray._collector import TraceCollector

    with pytest.raises(ValueError, match="on_invalid must be 'skip'"):
        TraceCollector(session_factory=lambda: TraceSession("p", sinks=[MemorySink()]))
    collector = TraceCollector(
        session_factory=lambda: TraceSession("p", sinks=[MemorySink()], on_invalid="skip")
    )
    assert collector.finish(5.0).check()


class _LockedSink(Sink):
    """A user's own sink that cannot be pickled (it holds a lock): it appends the ids it gets to a file."""

    def __init__(self, path: str) -> None:
        self.name = "locked"
        self.path = path
        self._lock = threading.Lock()

    async def write(self, records: Sequence[TraceRecord]) -> None:
        with self._lock, open(self.path, "a") as f:
            f.writelines(r.id + "\n" for r in records)


def _docs_block(containing: str) -> str:
    """The python block of docs/distributed.md that contains `containing`."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text(encoding="utf-8")
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL) if containing in b]
    return block


def test_start_collector_takes_sinks_that_hold_locks(
    project: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/distributed.md's sinks block as written: JsonlSink and ParquetSink passed to
    start_collector, and a user's sink given as a SinkSpec inside a Selected tier, get every
    record; an unpicklable sink given as it is is a TypeError naming it and SinkSpec."""
    import pyarrow.parquet as pq

    with pytest.raises(TypeError, match=r"_LockedSink cannot be sent.*SinkSpec"):
        start_collector(project, sinks=[_LockedSink(str(tmp_path / "x"))], finish_at_exit=False)
    monkeypatch.chdir(tmp_path)  # the block writes under traces/, here and in the actor (same node)
    (tmp_path / "traces").mkdir()
    namespace: dict[str, Any] = {"MySink": _LockedSink}
    exec(_docs_block("SinkSpec(Selected"), namespace)
    collector = namespace["collector"]
    with TraceClient(collector) as client:
        for step in range(3):
            client.log_samples_nowait(make_samples("a", step, 4, seed=0), step=step)
    stats = ray.get(collector.finish.remote(30.0))
    assert stats.written == 12 and stats.check()
    rows = [orjson.loads(line) for line in (tmp_path / "traces/run.jsonl").read_text().splitlines()]
    traces = [r for r in rows if "metrics" not in r]  # the session's health metrics share the file
    ids = {r["id"] for r in traces}
    assert len(traces) == 12 and len(ids) == 12
    assert set(pq.read_table(tmp_path / "traces/parquet").column("id").to_pylist()) == ids
    assert set((tmp_path / "traces/ids.txt").read_text().split()) == ids

    (tmp_path / "traces/ids.txt").unlink()
    namespace = {"MySink": _LockedSink}
    exec(_docs_block("session_factory=make_session"), namespace)
    collector = namespace["collector"]
    with TraceClient(collector) as client:
        client.log_samples_nowait(make_samples("b", 0, 5, seed=0), step=0)
    assert ray.get(collector.finish.remote(30.0)).written == 5
    assert len((tmp_path / "traces/ids.txt").read_text().split()) == 5


@pytest.mark.parametrize("where", ["cap", "tier"])
def test_client_refuses_an_unhashable_group_key(project: str, where: str) -> None:
    """A client refuses a dict as group_uid in the caller where a group sampler of the collector's
    session reads it, its cap's or (with no cap) a Selected tier's: a RecordError naming the
    field, or with on_invalid="skip" that sample alone "invalid"."""
    from asynctrace import GroupSampler, RecordError, Selected

    if where == "cap":
        # Only the counts are checked: a MemorySink spares the collector a Trackio writer process.
        collector = start_collector(
            project,
            "groups",
            sinks=[MemorySink()],
            max_traces_per_step=8,
            sampler=GroupSampler("top"),
            finish_at_exit=False,
        )
    else:
        tier = Selected(MemorySink("tier"), max_traces_per_step=2, sampler=GroupSampler("top"))
        collector = start_collector(project, "tier-groups", sinks=[MemorySink(), tier], finish_at_exit=False)
    samples = make_samples("g", 0, 4, seed=0)
    for i, s in enumerate(samples):
        s["group_uid"] = {"bad": 1} if i == 1 else f"g{i // 2}"
    client = TraceClient(collector)
    with pytest.raises(RecordError, match=r"sample 1: metadata\.group_uid"):
        client.log_samples_nowait(samples, step=0)
    assert client.close(10.0).submitted == 0
    with TraceClient(collector, on_invalid="skip") as skipping:
        assert skipping.log_samples_nowait(samples, step=0) == 3
    assert Counter(skipping.stats().dropped) == Counter({"invalid": 1})
    assert ray.get(collector.finish.remote(30.0)).written == 3


def test_group_metrics_count_every_sample_of_a_capped_collector(project: str, tmp_path: Path) -> None:
    """With group_key= and a cap, clients ship every sample (no local selection), so the
    collector's group metrics count the step's three groups, not the two samples kept."""
    from asynctrace import JsonlSink

    path = tmp_path / "run.jsonl"
    collector = start_collector(
        project,
        "group-metrics",
        sinks=[JsonlSink(str(path))],
        max_traces_per_step=2,
        sampler="top_bottom",
        group_key="g",
        health_metrics=False,
        finish_at_exit=False,
    )
    rows = [
        {"prompt": f"{g}{j}", "reward": float(g * 4 + j % 2), "g": f"g{g}"}
        for g in range(3)
        for j in range(4)
    ]
    with TraceClient(collector) as client:
        assert client.log_samples_nowait(rows, step=0) == 12
    assert ray.get(collector.finish.remote(30.0)).written == 2
    lines = [orjson.loads(line) for line in path.read_text().splitlines()]
    (metrics,) = [line["metrics"] for line in lines if "metrics" in line]
    assert (
        metrics["asynctrace/groups/train/count"] == 3.0
        and metrics["asynctrace/groups/train/zero_spread"] == 0.0
    )


def test_a_driver_exiting_with_an_open_client_ships_before_finishing_its_collector(project: str) -> None:
    """A driver that exits with a client still open and its collector started with
    finish_at_exit: the client ships its samples first, then the collector is finished, so the
    step its sampler held is written (not counted "closed" by a collector finished first)."""
    import subprocess
    import sys
    import textwrap

    address = ray.get_runtime_context().gcs_address
    script = f"""
        import ray
        from asynctrace.ray import TraceClient, start_collector
        from tests.distributed._helpers import make_samples
        ray.init(address={address!r}, log_to_driver=False, configure_logging=False)
        collector = start_collector(
            {project!r}, "driver-exit", max_traces_per_step=4, sampler="top_bottom", step_timeout=None
        )
        client = TraceClient(collector, flush_interval=60.0)
        client.log_samples_nowait(make_samples("d", 0, 10, seed=0), step=0)
    """
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr
    assert len(read_traces(project, "driver-exit")) == 4
