"""Caps are exact when many tasks and threads log the same steps into real Trackio storage."""

from __future__ import annotations

import random
import threading

import anyio
import orjson
import pytest

import asynctrace as at
from tests._util import read_traces, sample

pytestmark = pytest.mark.anyio

STEPS = 5
PER_STEP = 200
TASKS = 16
THREADS = 4
CAP = 8


async def test_sixteen_tasks_four_threads_exact_cap(project: str) -> None:
    """16 tasks and 4 threads log 5 steps x 200 samples, cap 8: exactly 8 per step land in Trackio."""
    producers = TASKS + THREADS
    per_producer = PER_STEP // producers
    # Trackio in a thread: the test checks its store, not the writer process (~1.5 CPU-s a start).
    sink = at.TrackioSink(process=False)
    violations: list[at.SessionStats] = []
    async with at.TraceSession(project, run="r", sinks=[sink], max_traces_per_step=CAP) as session:

        def make(producer: int, step: int) -> list[dict[str, object]]:
            return [
                sample(producer * per_producer + j, step=step, producer=producer) for j in range(per_producer)
            ]

        async def task_producer(p: int) -> None:
            for step in range(STEPS):
                for s in make(p, step):
                    await session.log_samples(s, step=step)
                    await anyio.lowlevel.checkpoint()

        def thread_producer(p: int) -> None:
            for step in range(STEPS):
                for s in make(p, step):
                    session.log_samples_nowait([s], step=step)

        stop = anyio.Event()

        async def monitor() -> None:
            while not stop.is_set():
                st = session.stats()
                if not st.check():
                    violations.append(st)
                await anyio.sleep(0.001)

        async with anyio.create_task_group() as tg:
            tg.start_soon(monitor)
            threads = [threading.Thread(target=thread_producer, args=(TASKS + t,)) for t in range(THREADS)]
            for t in threads:
                t.start()
            async with anyio.create_task_group() as producers_tg:
                for p in range(TASKS):
                    producers_tg.start_soon(task_producer, p)
            await anyio.to_thread.run_sync(lambda: [t.join() for t in threads])
            stop.set()
    stats = session.stats()

    assert violations == []
    assert stats.check()
    assert stats.submitted == STEPS * PER_STEP
    assert stats.written == STEPS * CAP
    assert stats.dropped == {"capped": STEPS * (PER_STEP - CAP)}
    assert stats.pending == 0 and stats.failed == 0
    assert sink.finished

    traces = read_traces(project, "r")
    by_step: dict[int, list[dict[str, object]]] = {}
    for t in traces:
        by_step.setdefault(int(t["step"]), []).append(t)  # type: ignore[arg-type]
    assert sorted(by_step) == list(range(STEPS))
    for step, rows in by_step.items():
        assert len(rows) == CAP
        for row in rows:
            meta = row["metadata"]
            assert isinstance(meta, dict)
            i = int(str(meta["uid"]).split(":")[1])
            assert meta["uid"] == f"{step}:{i}"
            assert meta["reward"] == float(i)
            assert row["messages"] == [
                {"role": "user", "content": f"question {i} of step {step}"},
                {"role": "assistant", "content": f"answer {i}"},
            ]
            assert row["key"] == "train/traces"


async def test_sync_session_threads_exact_cap(project: str) -> None:
    """The blocking `with` form keeps caps exact across threads and finishes the Trackio run."""
    # Trackio in a thread: the test checks its store, not the writer process (~1.5 CPU-s a start).
    sink = at.TrackioSink(process=False)

    def run() -> at.SessionStats:
        with at.TraceSession(project, run="sync", sinks=[sink], max_traces_per_step=3) as s:
            threads = [
                threading.Thread(
                    target=lambda p=p: [
                        s.log_samples([sample(p * 10 + j, step=st)], step=st)
                        for st in range(2)
                        for j in range(10)
                    ]
                )
                for p in range(4)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert s.flush(timeout=30)
        return s.stats()

    stats = await anyio.to_thread.run_sync(run)
    assert stats.written == 6 and stats.dropped == {"capped": 74} and stats.check()
    assert sink.finished
    rows = read_traces(project, "sync")
    assert sorted(r["step"] for r in rows) == [0, 0, 0, 1, 1, 1]
    assert all(orjson.dumps(r["messages"]) for r in rows)


async def test_top_bottom_is_exact_when_tasks_and_threads_race_on_a_step() -> None:
    """8 tasks and 4 threads log shuffled rewards into the same steps under top_bottom (cap 8):
    each step keeps exactly its 4 highest and 4 lowest rewards, though each caller asks the
    cap what it would keep before encoding while the others change the selection."""
    sink = at.testing.MemorySink()
    producers, per_step = 12, 240
    rewards = {step: random.Random(step).sample(range(per_step), per_step) for step in range(STEPS)}
    async with at.TraceSession(
        "p", sinks=[sink], max_traces_per_step=CAP, sampler="top_bottom", max_open_steps=STEPS
    ) as session:

        def share(p: int, step: int) -> list[dict[str, object]]:
            mine = rewards[step][p::producers]
            return [sample(r, reward=float(r), step=step) for r in mine]

        async def task_producer(p: int) -> None:
            for step in range(STEPS):
                batch = share(p, step)
                for c in range(0, len(batch), 3):
                    await session.log_samples(batch[c : c + 3], step=step)
                    await anyio.lowlevel.checkpoint()

        def thread_producer(p: int) -> None:
            for step in range(STEPS):
                batch = share(p, step)
                for c in range(0, len(batch), 3):
                    session.log_samples_nowait(batch[c : c + 3], step=step)

        threads = [threading.Thread(target=thread_producer, args=(8 + t,)) for t in range(4)]
        for t in threads:
            t.start()
        async with anyio.create_task_group() as tg:
            for p in range(8):
                tg.start_soon(task_producer, p)
        await anyio.to_thread.run_sync(lambda: [t.join() for t in threads])
    stats = session.stats()
    assert stats.check() and stats.written == STEPS * CAP
    assert stats.dropped == {"capped": STEPS * (per_step - CAP)}
    expected = [0.0, 1.0, 2.0, 3.0, *(float(per_step - i) for i in range(4, 0, -1))]
    for step, records in sink.steps().items():
        assert sorted(r.sample.metadata["reward"] for r in records) == expected, step
