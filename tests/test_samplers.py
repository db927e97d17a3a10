"""Samplers pick exactly what they promise; steps close on schedule; late samples are counted."""

from __future__ import annotations

import random
from typing import Any

import anyio
import pytest

import asynctrace as at
from tests._util import read_traces, sample

pytestmark = pytest.mark.anyio


def _rewards(sink: at.testing.MemorySink, step: int) -> list[float]:
    return sorted(r.sample.metadata["reward"] for r in sink.steps().get(step, []))


@pytest.mark.parametrize("k", [1, 7, 8])
async def test_top_bottom_picks_exact_extremes(k: int) -> None:
    """top_bottom keeps the ceil(k/2) highest and floor(k/2) lowest rewards of each step."""
    sink = at.testing.MemorySink()
    rng = random.Random(k)
    async with at.TraceSession("p", sinks=[sink], max_traces_per_step=k, sampler="top_bottom") as s:
        for step in range(3):
            rewards = [float(x) for x in range(100)]
            rng.shuffle(rewards)
            for chunk in range(0, 100, 13):
                await s.log_samples(
                    [sample(i, reward=r, step=step) for i, r in enumerate(rewards[chunk : chunk + 13])],
                    step=step,
                )
    top, bottom = -(-k // 2), k // 2
    expected = sorted([float(x) for x in range(bottom)] + [float(x) for x in range(100 - top, 100)])
    for step in range(3):
        assert _rewards(sink, step) == expected
    st = s.stats()
    assert st.written == 3 * k and st.dropped == {"capped": 3 * (100 - k)} and st.check()


async def test_top_bottom_uses_score_over_reward_and_requires_one() -> None:
    """`score` ranks before metadata reward; a sample with neither is refused with a clear RecordError."""
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], max_traces_per_step=2, sampler="top_bottom") as s:
        samples = [
            at.Sample(
                messages=[{"role": "user", "content": str(i)}],
                metadata={"reward": 0.0, "i": i},
                score=float(i),
            )
            for i in range(10)
        ]
        await s.log_samples(samples, step=0)
        with pytest.raises(at.RecordError, match=r"sample 0: score: .*finite"):
            await s.log_samples([{"prompt": "no reward", "response": "x"}], step=0)
        with pytest.raises(at.RecordError, match="sample 0: score"):
            await s.log_samples([{"prompt": "nan", "response": "x", "reward": float("nan")}], step=0)
    assert sorted(r.sample.metadata["i"] for r in sink.records) == [0, 9]


async def test_top_bottom_exact_into_trackio(project: str) -> None:
    """The top_bottom selection lands in Trackio intact."""
    # Trackio in a thread: the test checks its store, not the writer process (~1.5 CPU-s a start).
    async with at.TraceSession(
        project, run="tb", sinks=[at.TrackioSink(process=False)], max_traces_per_step=4, sampler="top_bottom"
    ) as s:
        await s.log_samples([sample(i, reward=float(i % 17)) for i in range(50)], step=2)
    rows = read_traces(project, "tb")
    assert sorted(r["metadata"]["reward"] for r in rows) == [0.0, 0.0, 16.0, 16.0]


async def _reservoir(seed: int) -> list[str]:
    sink = at.testing.MemorySink()
    async with at.TraceSession(
        "p", sinks=[sink], max_traces_per_step=5, sampler=at.ReservoirSampler(seed=seed)
    ) as s:
        for chunk in range(0, 200, 20):
            await s.log_samples([sample(i) for i in range(chunk, chunk + 20)], step=0)
    return sorted(r.sample.metadata["uid"] for r in sink.records)


async def test_reservoir_is_seeded_and_reproducible() -> None:
    """A seeded reservoir picks the same samples for the same input, and other seeds pick others."""
    a, b = await _reservoir(0), await _reservoir(0)
    assert a == b and len(a) == 5
    others = {tuple(await _reservoir(seed)) for seed in range(1, 6)}
    assert len(others | {tuple(a)}) > 1


async def test_reservoir_is_roughly_uniform() -> None:
    """Every position of the step is about equally likely to be kept by the reservoir."""
    counts = [0] * 10
    for seed in range(300):
        sampler = at.ReservoirSampler(seed=seed).new_step("train", 0, 2)
        from asynctrace._select.base import Entry

        kept = []
        for i in range(10):
            e = Entry(None, i)
            ok, out = sampler.offer(e)
            if out is not None:
                kept.remove(out.seq)
            if ok:
                kept.append(i)
        for i in kept:
            counts[i] += 1
    assert all(30 <= c <= 95 for c in counts), counts  # expected 60 each


async def test_late_samples_after_newer_step_and_flush() -> None:
    """A step closes when one more than max_open_steps newer arrives, or on flush; later samples are late."""
    sink = at.testing.MemorySink()
    async with at.TraceSession(
        "p", sinks=[sink], max_traces_per_step=2, sampler="top_bottom", max_open_steps=2
    ) as s:
        await s.log_samples([sample(i) for i in range(3)], step=0)
        await s.log_samples([sample(i) for i in range(3)], step=2)
        assert await s.log_samples([sample(9)], step=0) == 1  # 2 - 0 is not more than 2: still open
        await s.log_samples([sample(i) for i in range(3)], step=3)  # closes step 0
        assert await s.log_samples([sample(i) for i in range(4)], step=0) == 0
        await s.flush()
        assert _rewards(sink, 0) == [0.0, 9.0]
        assert await s.log_samples([sample(5)], step=3) == 0  # closed by flush
    st = s.stats()
    assert st.dropped["late"] == 5 and st.check()


async def test_idle_step_closes_after_step_timeout() -> None:
    """A holding sampler emits a step that saw nothing for step_timeout seconds, without a flush."""
    sink = at.testing.MemorySink()
    async with at.TraceSession(
        "p", sinks=[sink], max_traces_per_step=2, sampler="top_bottom", step_timeout=0.2, flush_interval=0.05
    ) as s:
        await s.log_samples([sample(i) for i in range(5)], step=0)
        with anyio.fail_after(5):
            while len(sink.records) < 2:
                await anyio.sleep(0.05)
        assert await s.log_samples([sample(7)], step=0) == 0
    assert s.stats().dropped["late"] == 1


async def test_first_sampler_caps_stragglers_without_late() -> None:
    """The first sampler counts caps per step without closing steps, so far-behind stragglers stay exact."""
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], max_traces_per_step=3) as s:
        for step in (0, 10, 20, 0, 10, 0):
            await s.log_samples([sample(i, step=step) for i in range(2)], step=step)
        await s.flush()
        await s.log_samples([sample(5)], step=0)
    assert {st: len(v) for st, v in sink.steps().items()} == {0: 3, 10: 3, 20: 2}
    assert s.stats().dropped == {"capped": 5}


async def test_splits_are_capped_separately() -> None:
    """Caps apply per (split, step): train and eval of the same step each keep k."""
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], max_traces_per_step=2) as s:
        await s.log_samples([sample(i) for i in range(5)], step=1, split="train")
        await s.log_samples([sample(i) for i in range(5)], step=1, split="eval")
    assert (
        sorted((r.split, r.key) for r in sink.records)
        == [("eval", "eval/traces")] * 2 + [("train", "train/traces")] * 2
    )


async def test_a_cap_does_not_encode_what_it_refuses() -> None:
    """Samples the `first` cap refuses are counted as capped without being encoded, so even
    unencodable ones among them cost no RecordError; a bad one the cap would keep still raises."""
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], max_traces_per_step=4) as s:
        bad = {"prompt": "q", "response": "a", "blob": object()}
        assert await s.log_samples([sample(i) for i in range(4)], step=0) == 4
        assert await s.log_samples([bad] * 50, step=0) == 0  # step 0 is full: nothing is encoded
        with pytest.raises(at.RecordError, match=r"sample 1: metadata\.blob"):
            await s.log_samples([sample(0, step=1), bad], step=1)
        assert await s.log_samples([sample(i, step=1) for i in range(6)], step=1) == 4
    st = s.stats()
    assert st.written == 8 and st.dropped == {"capped": 52} and st.check()
    assert st.submitted == 60  # the call that raised submitted nothing


async def _top_bottom_run(precheck: bool, seed: int) -> tuple[list[tuple[int, list[str]]], at.SessionStats]:
    rng = random.Random(seed)
    sink = at.testing.MemorySink()
    async with at.TraceSession(
        "p", sinks=[sink], max_traces_per_step=6, sampler="top_bottom", on_invalid="skip", max_open_steps=2
    ) as s:
        # Compare encoding only what the cap keeps with encoding all.
        s._engine.intake.encoder.precheck = precheck
        for step in range(8):
            for _ in range(rng.randrange(1, 6)):
                calls = []
                for _i in range(rng.randrange(0, 40)):
                    reward = float(rng.randrange(-20, 20))  # ties on purpose: earlier arrival wins
                    item = sample(rng.randrange(10**6), reward=reward, step=step)
                    roll = rng.random()
                    if roll < 0.08:
                        item["blob"] = object()  # invalid: encoding fails
                    elif roll < 0.12:
                        del item["reward"]  # invalid: no score to rank by
                    calls.append(item)
                await s.log_samples(calls, step=max(0, step - rng.randrange(0, 4)))
    kept = sorted((st, sorted(r.sample.metadata["uid"] for r in recs)) for st, recs in sink.steps().items())
    return kept, s.stats()


@pytest.mark.parametrize("seed", range(6))
async def test_top_bottom_keeps_the_same_samples_when_refused_ones_are_not_encoded(seed: int) -> None:
    """With and without the cap's check before encoding, top_bottom keeps the very same samples,
    invalid ones among the best included; an unencodable sample the cap refuses counts as
    capped (or late) instead of invalid, since it is never encoded."""
    with_check, st_with = await _top_bottom_run(True, seed)
    without, st_without = await _top_bottom_run(False, seed)
    assert with_check == without
    assert st_with.written == st_without.written and st_with.submitted == st_without.submitted
    d_with, d_without = st_with.dropped, st_without.dropped
    assert sum(d_with.values()) == sum(d_without.values())
    # Unencodable samples the cap refuses (or that come late) are counted so without encoding.
    assert d_with.get("late", 0) >= d_without.get("late", 0)
    assert d_with["capped"] >= d_without["capped"]
    assert 0 < d_with["invalid"] < d_without["invalid"]  # missing scores are still caught
    assert st_with.check() and st_without.check()


async def test_a_cap_still_rejects_what_is_not_a_sample() -> None:
    """Only samples and dicts are refused unencoded: anything else in a call to a capped
    session still gets its clear RecordError, even beyond the cap."""
    async with at.TraceSession("p", sinks=[at.testing.MemorySink()], max_traces_per_step=1) as s:
        with pytest.raises(at.RecordError, match=r"sample 2: expected an asynctrace.Sample or a mapping"):
            await s.log_samples([sample(0), sample(1), "not a sample"], step=0)
    assert s.stats().submitted == 0


async def test_stragglers_far_behind_the_newest_step_are_late() -> None:
    """A holding sampler keeps at most max_open_steps + 1 steps open: a sample for a step further
    behind the newest is late even if that step never opened."""
    sink = at.testing.MemorySink()
    async with at.TraceSession(
        "p", sinks=[sink], max_traces_per_step=4, sampler="top_bottom", max_open_steps=1
    ) as s:
        await s.log_samples([sample(0, step=100)], step=100)
        for step in range(99, 89, -1):
            await s.log_samples([sample(0, step=step)], step=step)
    st = s.stats()
    assert st.dropped == {"late": 9} and st.written == 2 and st.check()
    assert sorted(r.step for r in sink.records) == [99, 100]


class _LatestSelection(at.StepSelection):
    """Breaks the contract on purpose: lets samples through at once, then evicts them."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.kept: list[Any] = []

    def offer(self, entry: Any) -> tuple[bool, Any]:
        self.kept.append(entry)
        return True, (self.kept.pop(0) if len(self.kept) > self.k else None)

    def held(self) -> list[Any]:
        return []


class _Latest(at.Sampler):
    holds = False

    def new_step(self, split: str, step: int, k: int) -> at.StepSelection:
        return _LatestSelection(k)


async def test_a_non_holding_sampler_that_evicts_does_not_break_the_accounting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A custom sampler with holds=False that evicts a sample it already let through: the sample
    is written (it was on its way) and counted once, with a warning about the contract."""
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], max_traces_per_step=1, sampler=_Latest()) as s:
        for i in range(3):
            await s.log_samples([sample(i)], step=0)
    st = s.stats()
    assert st.written == 3 and st.dropped == {} and st.check()
    assert "holds=True" in caplog.text


@pytest.mark.parametrize("sampler", ["first", "top_bottom", "reservoir"])
async def test_a_call_refused_whole_is_counted_with_its_invalid_samples(sampler: str) -> None:
    """A call the cap refuses whole returns 0; its unscored samples count invalid, the rest capped or late."""
    sink = at.testing.MemorySink()
    async with at.TraceSession(
        "p", sinks=[sink], max_traces_per_step=2, sampler=sampler, max_open_steps=0, on_invalid="skip"
    ) as s:
        # Extremes first, so that top_bottom refuses everything in between.
        assert await s.log_samples([sample(0, reward=-1.0), sample(1, reward=9.0)], step=0) == 2
        # The reservoir keeps each later row with a small chance: offer enough that some call
        # of 4 is refused entirely, whatever the draw.
        refused_calls = 0
        for c in range(50):
            batch = [sample(10 + 4 * c + i, reward=0.5) for i in range(4)]
            batch[0]["reward"] = float("nan")  # no score: invalid for top_bottom, fine elsewhere
            if await s.log_samples(batch, step=0) == 0:
                refused_calls += 1
        assert refused_calls > 0
        await s.log_samples([sample(999, reward=0.5)], step=2)  # closes step 0 (holding samplers)
        assert await s.log_samples([sample(1000, reward=0.5)] * 3, step=0) == 0
    st = s.stats()
    invalid = 50 if sampler == "top_bottom" else 0
    late = 0 if sampler == "first" else 3  # `first` keeps counting step 0: capped, not late
    assert st.dropped.get("invalid", 0) == invalid and st.dropped.get("late", 0) == late
    assert st.written == 2 + 1 and st.submitted == 2 + 200 + 1 + 3
    assert st.dropped["capped"] == 200 - invalid + 3 - late and st.check()
