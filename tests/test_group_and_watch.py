"""The group sampler and the watch list inside a session: whole groups, watched prompts every step."""

from __future__ import annotations

import random
import threading

import pytest

import asynctrace as at
from asynctrace.testing import MemorySink
from tests._util import read_traces

pytestmark = pytest.mark.anyio


def _batch(step: int, groups: int, size: int, rng: random.Random) -> list[dict[str, object]]:
    """One step of GRPO-style samples: `groups` prompts with `size` samples each."""
    out = []
    for g in range(groups):
        for j in range(size):
            out.append(
                {
                    "prompt": f"prompt {g}",
                    "response": f"answer {j}",
                    "reward": rng.random(),
                    "prompt_id": f"p{g}",
                    "group_uid": f"s{step}-p{g}",
                }
            )
    return out


def _mean_rank(batch: list[dict[str, object]]) -> list[str]:
    sums: dict[str, list[float]] = {}
    for s in batch:
        sums.setdefault(str(s["group_uid"]), []).append(float(s["reward"]))  # type: ignore[arg-type]
    return sorted(sums, key=lambda g: -sum(sums[g]) / len(sums[g]))


async def test_group_sampler_writes_whole_top_and_bottom_groups() -> None:
    """With a cap of 8 samples and groups of 4, the best and the worst group of each step are
    written whole, and every other sample is counted as capped."""
    rng = random.Random(0)
    batches = [_batch(step, 16, 4, rng) for step in range(3)]
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], max_traces_per_step=8, sampler="group") as s:
        for step, batch in enumerate(batches):
            for c in range(0, len(batch), 16):  # whole groups per call
                await s.log_samples(batch[c : c + 16], step=step)
    for step, batch in enumerate(batches):
        ranked = _mean_rank(batch)
        got = sorted(r.sample.metadata["group_uid"] for r in sink.steps()[step])
        assert got == sorted([ranked[0]] * 4 + [ranked[-1]] * 4)
    st = s.stats()
    assert st.written == 24 and st.dropped == {"capped": 3 * 64 - 24} and st.check()


async def test_group_sampler_in_threads_is_exact() -> None:
    """Four threads logging whole groups of one step concurrently get the whole-step pick."""
    rng = random.Random(1)
    batch = _batch(0, 40, 4, rng)
    sink = at.testing.MemorySink()
    sampler = at.GroupSampler("top", count="groups")
    with at.TraceSession("p", sinks=[sink], max_traces_per_step=3, sampler=sampler) as s:
        chunks = [batch[i : i + 40] for i in range(0, len(batch), 40)]
        threads = [threading.Thread(target=s.log_samples, args=(c,), kwargs={"step": 0}) for c in chunks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    got = sorted({r.sample.metadata["group_uid"] for r in sink.records})
    assert got == sorted(_mean_rank(batch)[:3]) and len(sink.records) == 12


def test_watched_prompt_appears_at_every_step_alongside_the_cap(project: str) -> None:
    """A watched prompt reaches Trackio at every step it occurs in, although a cap of 1 with
    `first` would have dropped it; the watch cap limits it and the accounting stays exact."""
    rng = random.Random(2)
    watch = at.Watch(ids=["p7"], max_per_step=3)
    steps = [0, 1, 3, 4]  # p7 occurs at every step but step 2 (not logged at all there)
    # Trackio in a thread: the test checks its store, not the writer process (~1.5 CPU-s a start).
    trackio = at.TrackioSink(process=False)
    with at.TraceSession(project, run="w", sinks=[trackio], max_traces_per_step=1, watch=watch) as s:
        for step in range(5):
            batch = _batch(step, 10, 4, rng)
            if step not in steps:
                batch = [b for b in batch if b["prompt_id"] != "p7"]
            s.log_samples(batch, step=step)
    rows = read_traces(project, "w")
    for step in range(5):
        ids = [r["metadata"]["prompt_id"] for r in rows if r["step"] == step]
        # The cap's one sample (the first: p0), plus three of p7's four where it occurs.
        assert sorted(ids) == (["p0", "p7", "p7", "p7"] if step in steps else ["p0"])
    st = s.stats()
    assert st.written == 5 + 3 * 4
    assert st.submitted == 4 * 40 + 36 and st.dropped == {"capped": st.submitted - st.written}
    assert st.check()


async def test_watch_by_predicate_and_nowait() -> None:
    """A predicate on the sample picks watched samples, through log_samples_nowait too."""
    sink = at.testing.MemorySink()
    watch = at.Watch(predicate=lambda sample: sample.metadata["reward"] > 0.9, max_per_step=10)
    async with at.TraceSession(
        "p", sinks=[sink], max_traces_per_step=2, sampler="top_bottom", watch=watch
    ) as s:
        for step in range(3):
            samples = [{"prompt": "q", "response": str(i), "reward": i / 100} for i in range(100)]
            assert s.log_samples_nowait(samples, step=step) == 9 + 2
    # The watch list takes 0.91..0.99; top_bottom keeps the rest's extremes, 0.9 and 0.0.
    for step, records in sink.steps().items():
        rewards = sorted(r.sample.metadata["reward"] for r in records)
        assert rewards == [0.0, 0.9] + [i / 100 for i in range(91, 100)], step
    assert s.stats().check()


def test_watch_rejects_bad_arguments() -> None:
    """A Watch without ids or predicate, with a string for ids, or a bad cap says what is wrong."""
    with pytest.raises(ValueError, match="ids, a predicate"):
        at.Watch()
    with pytest.raises(ValueError, match="collection of prompt ids"):
        at.Watch(ids="p7")
    with pytest.raises(ValueError, match="max_per_step"):
        at.Watch(ids=["p7"], max_per_step=0)
    with pytest.raises(ValueError, match=r"watch must be an asynctrace\.Watch"):
        at.TraceSession("p", max_traces_per_step=1, watch=["p7"])  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_an_invalid_watched_sample_takes_no_watch_place() -> None:
    """choosing.md's order is validate + encode, then the watch list: under on_invalid="skip" an
    invalid watched sample is counted invalid and the next watched sample gets its place."""
    mem = MemorySink()
    ok = {"prompt": "q", "response": "a", "reward": 1.0}
    async with at.TraceSession(
        "p",
        sinks=[mem],
        max_traces_per_step=1,
        on_invalid="skip",
        watch=at.Watch(ids=["w"], max_per_step=1),
        health_metrics=False,
    ) as s:
        call = [
            dict(ok, prompt_id="w", bad=object()),
            dict(ok, uid="other"),
            dict(ok, prompt_id="w", uid="w2"),
        ]
        await s.log_samples(call, step=0)
    stats = s.stats()
    assert sorted((r.sample.metadata.get("uid"), r.watched) for r in mem.records) == [
        ("other", False),
        ("w2", True),
    ]
    assert stats.dropped == {"invalid": 1} and stats.written == 2 and stats.check()
