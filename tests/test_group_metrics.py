"""Per-step group metrics: how many prompt groups, how many with zero reward spread, the mean spread."""

from __future__ import annotations

import math
import random

import anyio
import pytest

import asynctrace as at
from asynctrace._records.groups import group_of
from tests._groups import summarize_groups
from tests._util import sample

pytestmark = pytest.mark.anyio


def _groups(sink: at.testing.MemorySink, split: str = "train") -> dict[int, dict[str, float]]:
    prefix = f"asynctrace/groups/{split}/"
    return {
        step: {k.removeprefix(prefix): v for k, v in m.items()}
        for step, m in sink.metrics
        if prefix + "count" in m
    }


def _batch(step: int, rng: random.Random) -> list[dict[str, object]]:
    """8 groups of 4: every other group with one reward for all its samples."""
    out = []
    for g in range(8):
        for j in range(4):
            reward = 1.0 if g % 2 == 0 else rng.choice([0.0, 0.5, 1.0]) + j
            out.append(sample(g * 4 + j, step=step, reward=reward, group_uid=f"s{step}g{g}"))
    return out


async def test_group_counts_match_a_direct_computation_before_the_cap() -> None:
    """Counts over every submitted sample (the cap keeps 2) equal summarize_groups on the batch."""
    sink = at.testing.MemorySink()
    rng = random.Random(3)
    batches = {step: _batch(step, rng) for step in range(3)}
    async with at.TraceSession(
        "p", sinks=[sink], max_traces_per_step=2, sampler="top_bottom", group_key="group_uid"
    ) as s:
        for step, batch in batches.items():
            rng.shuffle(batch)
            for chunk in range(0, len(batch), 5):  # a step arrives in several calls
                await s.log_samples(batch[chunk : chunk + 5], step=step)
    got = _groups(sink)
    assert sorted(got) == [0, 1, 2]
    for step, batch in batches.items():
        rewards: dict[object, list[float]] = {}
        for x in batch:
            rewards.setdefault(group_of(x, "group_uid"), []).append(float(x["reward"]))  # type: ignore[arg-type]
        want = summarize_groups(rewards)
        assert want.groups == 8 and want.zero_spread == 4
        assert got[step]["count"] == want.groups and got[step]["zero_spread"] == want.zero_spread
        assert math.isclose(got[step]["mean_spread"], want.mean_spread, rel_tol=1e-12)
    assert len(sink.records) == 6


async def test_a_step_is_logged_when_it_closes() -> None:
    """A step's group metrics are logged once a step max_open_steps + 1 ahead arrives, without a flush."""
    sink = at.testing.MemorySink()
    async with at.TraceSession(
        "p", sinks=[sink], group_key="prompt_index", max_open_steps=0, flush_interval=0.01
    ) as s:
        await s.log_samples([sample(i, prompt_index=i // 2) for i in range(6)], step=0)
        await s.log_samples([sample(0, step=1, prompt_index=0)], step=1)
        with anyio.fail_after(10):
            while 0 not in _groups(sink):
                await anyio.sleep(0.005)
        assert _groups(sink)[0]["count"] == 3 and 1 not in _groups(sink)
    assert _groups(sink)[1] == {"count": 1.0, "zero_spread": 1.0, "mean_spread": 0.0}


async def test_a_key_function_and_samples_without_a_group() -> None:
    """A function of the metadata names groups; samples it maps to None, or without a reward, are left out."""
    sink = at.testing.MemorySink()
    samples = [
        at.Sample(messages=[{"role": "user", "content": "a"}], metadata={"task": "x", "reward": 1.0}),
        at.Sample(messages=[{"role": "user", "content": "b"}], metadata={"task": "x", "reward": 3.0}),
        at.Sample(messages=[{"role": "user", "content": "c"}], metadata={"task": "y"}),
        at.Sample(messages=[{"role": "user", "content": "d"}], metadata={"reward": 2.0}),
    ]
    async with at.TraceSession("p", sinks=[sink], group_key=lambda m: m.get("task")) as s:
        await s.log_samples(samples, step=4, split="eval")
    assert _groups(sink, "eval") == {4: {"count": 1.0, "zero_spread": 0.0, "mean_spread": 1.0}}


def test_group_key_is_checked() -> None:
    """A group_key that is neither a key, a list of keys nor a function gets a clear ValueError."""
    with pytest.raises(ValueError, match="group_key must be"):
        at.TraceSession("p", sinks=[at.testing.MemorySink()], group_key=3)  # type: ignore[arg-type]
