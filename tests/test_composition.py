"""The selection tools together: the session's cap, a Selected tier and the watch list, through
every entry point, against an oracle written from docs/choosing.md and docs/concepts.md.

The oracle, per (split, step), from the docs' definitions alone:
- watched: a sample whose prompt id is on the watch list, the first `max_per_step` of a step;
  it passes the session's cap and every `Selected` sink's selection, and is written everywhere;
- the session's cap keeps, of the other samples, `first`: the first `k` to arrive,
  `top_bottom`: the `ceil(k/2)` highest and `floor(k/2)` lowest rewards;
- a plain sink holds the watched samples and what the session kept; a `Selected` sink holds the
  watched samples and its own sampler's pick of what the session kept.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asynctrace as at
from asynctrace import rollouts
from asynctrace.testing import MemorySink

WATCHED = "w"


@dataclass(frozen=True)
class Row:
    uid: str
    prompt_id: str
    reward: float


def _first(rows: Sequence[Row], k: int) -> set[str]:
    return {r.uid for r in rows[:k]}


def _top_bottom(rows: Sequence[Row], k: int) -> set[str]:
    if len(rows) <= k:
        return {r.uid for r in rows}
    order = {r.uid: i for i, r in enumerate(rows)}
    top = sorted(rows, key=lambda r: (-r.reward, order[r.uid]))[: (k + 1) // 2]
    rest = [r for r in rows if r not in top]
    bottom = sorted(rest, key=lambda r: (r.reward, order[r.uid]))[: k // 2]
    return {r.uid for r in top + bottom}


PICK = {"first": _first, "top_bottom": _top_bottom}


def oracle(
    steps: Sequence[Sequence[Row]], cap: tuple[str, int] | None, tier: int | None, watch: bool
) -> tuple[dict[int, set[str]], dict[int, set[str]]]:
    """What the plain sink and the tier hold, per step."""
    plain: dict[int, set[str]] = {}
    tiered: dict[int, set[str]] = {}
    for step, rows in enumerate(steps):
        watched = [r for r in rows if watch and r.prompt_id == WATCHED][:16]
        others = [r for r in rows if r not in watched]
        kept = others if cap is None else [r for r in others if r.uid in PICK[cap[0]](others, cap[1])]
        plain[step] = {r.uid for r in watched} | {r.uid for r in kept}
        if tier is not None:
            tiered[step] = {r.uid for r in watched} | _top_bottom(kept, tier)
    return plain, tiered


def _sample(r: Row) -> at.Sample:
    return at.Sample(
        messages=[{"role": "user", "content": r.prompt_id}, {"role": "assistant", "content": r.uid}],
        metadata={"uid": r.uid, "prompt_id": r.prompt_id, "reward": r.reward},
    )


def _rollouts(rows: Sequence[Row]) -> dict[str, Any]:
    """The rows as log_rollouts takes them: token ids, rewards and metadata columns."""
    tok = rollouts.toy_tokenizer()
    seqs = [tok.encode(f"{r.prompt_id} {r.uid}").ids for r in rows]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = True
    return {
        "input_ids": ids,
        "tokenizer": tok,
        "rewards": torch.tensor([r.reward for r in rows], dtype=torch.float64),
        "attention_mask": attn,
        "prompt_lens": [1] * len(rows),
        "metadata": {"uid": [r.uid for r in rows], "prompt_id": [r.prompt_id for r in rows]},
    }


@st.composite
def runs(draw: st.DrawFn) -> list[list[Row]]:
    """A few steps of rows with distinct rewards; some rows carry the watched prompt id."""
    n_steps = draw(st.integers(1, 5))
    sizes = [draw(st.integers(1, 14)) for _ in range(n_steps)]
    rewards = draw(st.lists(st.integers(0, 10_000), min_size=sum(sizes), max_size=sum(sizes), unique=True))
    out, i = [], 0
    for step, size in enumerate(sizes):
        rows = []
        for j in range(size):
            prompt = WATCHED if draw(st.integers(0, 4)) == 0 else f"p{j % 3}"
            rows.append(Row(f"s{step}-{j}", prompt, rewards[i] / 7.0))
            i += 1
        out.append(rows)
    return out


def _held(sink: MemorySink) -> dict[int, set[str]]:
    return {step: {r.sample.metadata["uid"] for r in recs} for step, recs in sink.steps().items()}


def _session(
    cap: tuple[str, int] | None, tier: int | None, watch: bool
) -> tuple[Any, MemorySink, MemorySink]:
    plain, tracker = MemorySink("archive"), MemorySink("tracker")
    sinks: list[at.Sink] = [plain] + (
        [at.Selected(tracker, max_traces_per_step=tier, sampler="top_bottom")] if tier else []
    )
    session = at.TraceSession(
        "composition",
        run="r",
        sinks=sinks,
        max_traces_per_step=None if cap is None else cap[1],
        sampler="first" if cap is None else cap[0],
        watch=at.Watch(ids=[WATCHED]) if watch else None,
        health_metrics=False,
    )
    return session, plain, tracker


async def _log_async(entry: str, steps: list[list[Row]], cap: Any, tier: Any, watch: bool) -> tuple[Any, ...]:
    session, plain, tracker = _session(cap, tier, watch)
    async with session as s:
        for step, rows in enumerate(steps):
            # Each step in two calls: a group or a step split over calls must not matter.
            for part in (rows[: len(rows) // 2], rows[len(rows) // 2 :]):
                if not part:
                    continue
                if entry == "log_samples":
                    await s.log_samples([_sample(r) for r in part], step=step)
                elif entry == "nowait":
                    s.log_samples_nowait([_sample(r) for r in part], step=step)
                else:
                    await s.log_rollouts(step=step, **_rollouts(part))
    return session.stats(), plain, tracker


def _log_blocking(steps: list[list[Row]], cap: Any, tier: Any, watch: bool) -> tuple[Any, ...]:
    session, plain, tracker = _session(cap, tier, watch)
    with session as s:
        for step, rows in enumerate(steps):
            for part in (rows[: len(rows) // 2], rows[len(rows) // 2 :]):
                if part:
                    s.log_samples([_sample(r) for r in part], step=step)
    return session.stats(), plain, tracker


@pytest.mark.parametrize("entry", ["log_samples", "blocking", "nowait", "log_rollouts"])
@pytest.mark.parametrize(
    "cap", [None, ("first", 5), ("top_bottom", 6)], ids=["no-cap", "first-5", "top_bottom-6"]
)
@pytest.mark.parametrize("tier", [None, 4], ids=["no-tier", "tier-4"])
@pytest.mark.parametrize("watch", [False, True], ids=["no-watch", "watch"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=runs())
def test_every_sink_holds_what_the_oracle_says(
    entry: str, cap: tuple[str, int] | None, tier: int | None, watch: bool, steps: list[list[Row]]
) -> None:
    """Every entry point, cap, tier and watch: each sink holds exactly the oracle's pick per step,
    watched prompts in every step they were logged in, nothing late, the accounting exact."""
    if entry == "blocking":
        stats, plain, tracker = _log_blocking(steps, cap, tier, watch)
    else:
        stats, plain, tracker = anyio.run(_log_async, entry, steps, cap, tier, watch)
    want_plain, want_tier = oracle(steps, cap, tier, watch)
    assert _held(plain) == {s: v for s, v in want_plain.items() if v}
    if tier is not None:
        assert _held(tracker) == {s: v for s, v in want_tier.items() if v}
        tier_stats = stats.sinks["tracker"]
        assert "late" not in tier_stats.skipped
    assert "late" not in stats.dropped
    assert stats.check() and stats.pending == 0
    assert stats.written == sum(len(v) for v in want_plain.values())


def _grpo_steps(n_steps: int) -> list[list[Row]]:
    """The issue's reproduction: 4 groups of 8 a step, a watched prompt in odd steps."""
    out = []
    for step in range(n_steps):
        rows = []
        for g in range(4):
            prompt = WATCHED if step % 2 == 1 and g == 0 else f"p{step}-{g}"
            rows += [Row(f"s{step}-{g}-{j}", prompt, float(step * 100 + g * 10 + j)) for j in range(8)]
        out.append(rows)
    return out


@pytest.mark.anyio
async def test_watch_with_a_tier_loses_no_step() -> None:
    """Session cap + watch + Selected(top_bottom 16): the tier has its 16 at every step, plus the
    watched prompt's 8 in odd steps; watched records never close a tier's step early."""
    steps = _grpo_steps(10)
    mem = MemorySink("tracker")
    async with at.TraceSession(
        "p",
        sinks=[at.Selected(mem, max_traces_per_step=16, sampler="top_bottom")],
        max_traces_per_step=1000,
        sampler="top_bottom",
        watch=at.Watch(ids=[WATCHED]),
        health_metrics=False,
    ) as s:
        for step, rows in enumerate(steps):
            await s.log_samples([_sample(r) for r in rows], step=step)
    held = _held(mem)
    assert sorted(held) == list(range(10))
    for step in range(10):
        assert len(held[step]) == 16 + (8 if step % 2 else 0), step
    assert "late" not in s.stats().sinks["tracker"].skipped


@pytest.mark.anyio
async def test_log_rollouts_follows_the_watch_list() -> None:
    """The same 32 rows, cap 16, a watch on one prompt: log_rollouts keeps the 8 watched rows as
    log_samples(decode_rollouts(...)) does."""
    rows = [r for r in _grpo_steps(2)[1]]
    held = {}
    for entry in ("log_rollouts", "log_samples"):
        mem = MemorySink(entry)
        async with at.TraceSession(
            "p", sinks=[mem], max_traces_per_step=16, sampler="top_bottom", watch=at.Watch(ids=[WATCHED])
        ) as s:
            if entry == "log_rollouts":
                await s.log_rollouts(step=0, **_rollouts(rows))
            else:
                kwargs = _rollouts(rows)
                await s.log_samples(rollouts.decode_rollouts(kwargs.pop("input_ids"), **kwargs), step=0)
        held[entry] = _held(mem)[0]
    watched = {r.uid for r in rows if r.prompt_id == WATCHED}
    assert len(watched) == 8 and watched <= held["log_rollouts"]
    assert held["log_rollouts"] == held["log_samples"]


@pytest.mark.anyio
async def test_archive_everything_and_watch_the_tracker_without_a_session_cap() -> None:
    """No session cap, every sample to the archive, a top_bottom 4 to the tracker and the watched
    prompt in the tracker at every step it occurs in."""
    steps = _grpo_steps(4)
    archive, tracker = MemorySink("archive"), MemorySink("tracker")
    async with at.TraceSession(
        "p",
        sinks=[archive, at.Selected(tracker, max_traces_per_step=4, sampler="top_bottom")],
        watch=at.Watch(ids=[WATCHED]),
        health_metrics=False,
    ) as s:
        for step, rows in enumerate(steps):
            await s.log_samples([_sample(r) for r in rows], step=step)
    assert {step: len(v) for step, v in _held(archive).items()} == {0: 32, 1: 32, 2: 32, 3: 32}
    want = {
        step: _top_bottom([r for r in rows if r.prompt_id != WATCHED], 4) for step, rows in enumerate(steps)
    }
    for step, rows in enumerate(steps):
        want[step] |= {r.uid for r in rows if r.prompt_id == WATCHED}
    assert _held(tracker) == want


@pytest.mark.anyio
async def test_a_watch_that_can_never_apply_warns(caplog: pytest.LogCaptureFixture) -> None:
    """A watch list with no cap and no Selected sink passes nothing by: one warning says so."""
    with caplog.at_level(logging.WARNING, logger="asynctrace"):
        at.TraceSession("p", sinks=[MemorySink()], watch=at.Watch(ids=[WATCHED]))
    assert sum("watch= changes nothing" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.anyio
async def test_a_call_that_raises_counts_nothing_anywhere() -> None:
    """A call whose sample cannot be encoded raises RecordError and counts nothing: not in the
    stats, not in the group metrics, not in the watch list's budget."""
    mem = MemorySink()
    async with at.TraceSession(
        "p",
        sinks=[mem],
        max_traces_per_step=4,
        sampler="top_bottom",
        group_key="group_uid",
        watch=at.Watch(ids=[WATCHED], max_per_step=1),
    ) as s:
        bad = [
            {"prompt": "q", "response": "a", "reward": 1.0, "group_uid": "g", "prompt_id": WATCHED},
            {"prompt": "q", "response": "a", "reward": 2.0, "group_uid": "g", "bad": object()},
        ]
        with pytest.raises(at.RecordError):
            await s.log_samples(bad, step=0)
        assert s.stats().submitted == 0
        good = {"prompt": "q", "response": "a", "reward": 1.0, "group_uid": "h", "prompt_id": WATCHED}
        assert await s.log_samples([good], step=0) == 1
        await s.flush()
    groups = {step: m for step, m in mem.metrics if any(k.startswith("asynctrace/groups/") for k in m)}
    assert groups[0]["asynctrace/groups/train/count"] == 1.0  # the raising call's group "g" is not there
    assert [r.step for r in mem.records] == [0] and mem.records[0].watched  # its watch place was given back


@pytest.mark.anyio
async def test_the_choosing_page_snippet_runs_as_written(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/choosing.md's archive + tracker tier + watch snippet, executed as written, keeps the
    watched prompt's samples in the tracker beside the tier's 16."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "choosing.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    (snippet,) = [b for b in blocks if "at.Selected(at.TrackioSink()" in b]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    scope: dict[str, Any] = {"at": at}
    exec(compile(__import__("textwrap").dedent(snippet), "choosing.md", "exec"), scope)
    rows = [Row(f"r{i}", "gsm8k-0042" if i < 3 else f"p{i % 4}", float(i)) for i in range(40)]
    async with scope["session"] as s:
        await s.log_samples([_sample(r) for r in rows], step=0)
    stats = s.stats()
    assert stats.sinks["trackio"].written == 16 + 3 and stats.sinks["parquet"].written == 40


@pytest.mark.anyio
async def test_a_record_error_names_the_callers_index_when_the_watch_split_the_call() -> None:
    """With a watch list, RecordError names the sample's place in the caller's list, whether the
    bad sample is watched or not."""
    ok = {"prompt": "q", "response": "a", "reward": 1.0}
    async with at.TraceSession(
        "p", sinks=[MemorySink()], max_traces_per_step=4, watch=at.Watch(ids=[WATCHED])
    ) as s:
        calls = [
            [dict(ok, prompt_id=WATCHED), ok, dict(ok, bad=object())],
            [ok, dict(ok, prompt_id=WATCHED, bad=object()), ok],
        ]
        for where, call in zip((2, 1), calls, strict=True):
            with pytest.raises(at.RecordError) as info:
                await s.log_samples(call, step=0)
            assert info.value.index == where and str(info.value).startswith(f"sample {where}:")
        assert s.stats().submitted == 0
