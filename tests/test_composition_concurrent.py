"""The selection tools together under concurrent arrival: each step's rows shuffled over several
threads (a blocking session) or tasks (an async one) logging at once, against the oracle of
tests/_composition.py. Only selections whose pick does not depend on arrival order are checked
(`first` does, by definition), and the watch's budget is larger than a step's watched rows."""

from __future__ import annotations

import random
import threading
import zlib
from typing import Any

import anyio
import pytest

import asynctrace as at
from asynctrace.testing import MemorySink

from ._composition import GROUP_SEED, WATCHED, Row, held, oracle, sample

GROUP_SIZE = 4
CAPS: dict[str, tuple[tuple[str, int] | None, Any, str]] = {
    "no-cap": (None, "first", "first"),
    "top_bottom-6": (("top_bottom", 6), "top_bottom", "first"),
    "group-top-8": (("group:top", 8), at.GroupSampler("top", key="prompt_id", seed=GROUP_SEED), "first"),
    "group-random-8": (
        ("group:random", 8),
        at.GroupSampler("random", key="prompt_id", seed=GROUP_SEED, group_size=GROUP_SIZE),
        "first",
    ),
}


def _steps(seed: int, n_steps: int = 4, groups: int = 4) -> list[list[Row]]:
    """GRPO-like steps with distinct rewards; the watched prompt's group in every odd step."""
    rng = random.Random(seed)
    per_step = (groups + 1) * GROUP_SIZE
    rewards = iter(rng.sample(range(10_000), n_steps * per_step))
    out = []
    for step in range(n_steps):
        prompts = [f"p{step}-{g}" for g in range(groups)] + ([WATCHED] if step % 2 else [])
        out.append(
            [Row(f"s{step}-{p}-{j}", p, next(rewards) / 7.0) for p in prompts for j in range(GROUP_SIZE)]
        )
    return out


def _deal(rows: list[Row], n: int, rng: random.Random) -> list[list[list[Row]]]:
    """A step's rows shuffled over `n` loggers, each one's share in calls of 1 to 3 rows."""
    shuffled = rows[:]
    rng.shuffle(shuffled)
    out = []
    for mine in (shuffled[i::n] for i in range(n)):
        calls, i = [], 0
        while i < len(mine):
            size = rng.randint(1, 3)
            calls.append(mine[i : i + size])
            i += size
        out.append(calls)
    return out


def _session(
    cap: tuple[str, int] | None, sampler: Any, tier: bool, watch: bool
) -> tuple[Any, MemorySink, MemorySink]:
    plain, tracker = MemorySink("archive"), MemorySink("tracker")
    tiers: list[at.Sink] = [at.Selected(tracker, max_traces_per_step=4, sampler="top_bottom")] if tier else []
    session = at.TraceSession(
        "composition",
        run="concurrent",
        sinks=[plain, *tiers],
        max_traces_per_step=None if cap is None else cap[1],
        sampler=sampler,
        group_key="prompt_id",
        watch=at.Watch(ids=[WATCHED]) if watch else None,
        health_metrics=False,
    )
    return session, plain, tracker


@pytest.mark.parametrize("cap", sorted(CAPS))
@pytest.mark.parametrize("front", ["threads", "tasks"])
@pytest.mark.parametrize("tier", [False, True], ids=["no-tier", "tier-4"])
@pytest.mark.parametrize("watch", [False, True], ids=["no-watch", "watch"])
def test_concurrent_arrival_holds_what_the_oracle_says(cap: str, front: str, tier: bool, watch: bool) -> None:
    """Rows shuffled over 3 threads or tasks logging each step at once: every sink holds the
    oracle's pick, groups whole, the watched prompt in every step it was logged, nothing late,
    the accounting exact."""
    want_cap, sampler, _ = CAPS[cap]
    case = f"{cap}/{front}/{tier}/{watch}"
    steps = _steps(seed=zlib.crc32(case.encode()))
    rng = random.Random(case)
    dealt = [_deal(rows, 3, rng) for rows in steps]
    session, plain, tracker = _session(want_cap, sampler, tier, watch)
    if front == "threads":
        with session as s:
            for step, shares in enumerate(dealt):
                barrier = threading.Barrier(len(shares))

                def log(
                    calls: list[list[Row]], step: int = step, barrier: threading.Barrier = barrier
                ) -> None:
                    barrier.wait(timeout=30)
                    for call in calls:
                        s.log_samples([sample(r) for r in call], step=step)

                threads = [threading.Thread(target=log, args=(calls,)) for calls in shares]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=60)
    else:

        async def main() -> None:
            async with session as s:
                for step, shares in enumerate(dealt):

                    async def log(calls: list[list[Row]], step: int = step) -> None:
                        for call in calls:
                            await s.log_samples([sample(r) for r in call], step=step)
                            await anyio.sleep(0)  # let the other tasks' calls interleave

                    async with anyio.create_task_group() as tg:
                        for calls in shares:
                            tg.start_soon(log, calls)

        anyio.run(main)
    stats = session.stats()
    want_plain, want_tier = oracle(steps, want_cap, 4 if tier else None, watch)
    assert held(plain) == {s: v for s, v in want_plain.items() if v}
    if tier:
        assert held(tracker) == {s: v for s, v in want_tier.items() if v}
        assert "late" not in stats.sinks["tracker"].skipped
    if watch:
        for step, rows in enumerate(steps):
            assert {r.uid for r in rows if r.prompt_id == WATCHED} <= held(plain).get(step, set())
    if cap.startswith("group"):
        by_group: dict[tuple[int, str], int] = {}
        for r in plain.records:
            key = (r.step, r.sample.metadata["prompt_id"])
            by_group[key] = by_group.get(key, 0) + 1
        assert set(by_group.values()) == {GROUP_SIZE}
    assert "late" not in stats.dropped
    assert stats.check() and stats.pending == 0
