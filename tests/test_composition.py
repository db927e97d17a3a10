"""The selection tools together: the session's cap, a Selected tier and the watch list, through
every entry point, against the oracle of tests/_composition.py (written from the docs)."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings

import asynctrace as at
from asynctrace import rollouts
from asynctrace.testing import MemorySink

from ._composition import (
    GROUP_KEY,
    WATCHED,
    Row,
    Selection,
    held,
    oracle,
    rollout_columns,
    runs,
    sample,
    top_bottom,
)

ENTRIES = ("log_samples", "blocking", "nowait", "log_rollouts")
# The session's cap: none, each sampler, each group mode and count (a count of groups keeps 2).
CAPS: tuple[Selection | None, ...] = (
    None,
    ("first", 5),
    ("top_bottom", 6),
    ("reservoir", 5),
    *(
        ("group", 6 if count == "samples" else 2, policy, count)
        for policy in ("first", "top", "bottom", "top_bottom", "random")
        for count in ("samples", "groups")
    ),
)
TIERS: tuple[Selection | None, ...] = (None, ("top_bottom", 4), ("group", 5, "top_bottom"))


def _name(selection: Selection | None) -> str:
    return "none" if selection is None else "-".join(map(str, selection))


# Every cap with every entry point; each cap, and each entry point, with every tier and both
# watch settings; every tier with both watch settings (a covering set of the whole product).
def _cases() -> list[Any]:
    out = []
    for i, cap in enumerate(CAPS):
        for j, entry in enumerate(ENTRIES):
            tier, watch = TIERS[(i + j) % len(TIERS)], (i + j) % 2 == 0
            name = f"{entry}-{_name(cap)}-tier-{_name(tier)}-{'watch' if watch else 'no-watch'}"
            out.append(pytest.param(entry, cap, tier, watch, id=name))
    return out


def _sampler(selection: Selection) -> Any:
    if selection[0] == "group":
        count = selection[3] if len(selection) > 3 else "samples"
        return at.GroupSampler(selection[2], key=GROUP_KEY, count=count)
    return selection[0]


def _session(
    cap: Selection | None, tier: Selection | None, watch: bool
) -> tuple[Any, MemorySink, MemorySink]:
    plain, tracker = MemorySink("archive"), MemorySink("tracker")
    sinks: list[at.Sink] = [plain] + (
        [at.Selected(tracker, max_traces_per_step=tier[1], sampler=_sampler(tier))] if tier else []
    )
    session = at.TraceSession(
        "composition",
        run="r",
        sinks=sinks,
        max_traces_per_step=None if cap is None else cap[1],
        sampler="first" if cap is None else _sampler(cap),
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
                    await s.log_samples([sample(r) for r in part], step=step)
                elif entry == "nowait":
                    s.log_samples_nowait([sample(r) for r in part], step=step)
                else:
                    await s.log_rollouts(step=step, **rollout_columns(part))
    return session.stats(), plain, tracker


def _log_blocking(steps: list[list[Row]], cap: Any, tier: Any, watch: bool) -> tuple[Any, ...]:
    session, plain, tracker = _session(cap, tier, watch)
    with session as s:
        for step, rows in enumerate(steps):
            for part in (rows[: len(rows) // 2], rows[len(rows) // 2 :]):
                if part:
                    s.log_samples([sample(r) for r in part], step=step)
    return session.stats(), plain, tracker


@pytest.mark.parametrize(("entry", "cap", "tier", "watch"), _cases())
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=runs())
def test_every_sink_holds_what_the_oracle_says(
    entry: str, cap: Selection | None, tier: Selection | None, watch: bool, steps: list[list[Row]]
) -> None:
    """Every entry point, cap (each sampler, each group mode and count), tier and watch: each sink
    holds exactly the oracle's pick per step, groups whole, watched prompts in every step they
    were logged in, nothing late, the accounting exact."""
    if entry == "blocking":
        stats, plain, tracker = _log_blocking(steps, cap, tier, watch)
    else:
        stats, plain, tracker = anyio.run(_log_async, entry, steps, cap, tier, watch)
    want_plain, want_tier = oracle(steps, cap, tier, watch, plain_held=held(plain))
    assert held(plain) == {s: v for s, v in want_plain.items() if v}
    if tier is not None:
        assert held(tracker) == {s: v for s, v in want_tier.items() if v}
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
            await s.log_samples([sample(r) for r in rows], step=step)
    got = held(mem)
    assert sorted(got) == list(range(10))
    for step in range(10):
        assert len(got[step]) == 16 + (8 if step % 2 else 0), step
    assert "late" not in s.stats().sinks["tracker"].skipped


@pytest.mark.anyio
async def test_a_watched_sample_for_a_closed_step_is_not_late() -> None:
    """After flush() closed step 0 (the session's and the tier's), a watched sample for it still
    passes every selection by and reaches both sinks; an unwatched one is "late"."""
    rows = [Row(f"u{i}", "p", float(i)) for i in range(4)]
    archive, tracker = MemorySink("archive"), MemorySink("tracker")
    async with at.TraceSession(
        "p",
        sinks=[archive, at.Selected(tracker, max_traces_per_step=1, sampler="top_bottom")],
        max_traces_per_step=2,
        sampler="top_bottom",
        watch=at.Watch(ids=[WATCHED]),
        health_metrics=False,
    ) as s:
        await s.log_samples([sample(r) for r in rows], step=0)
        await s.flush()
        await s.log_samples([sample(Row("w0", WATCHED, 0.5)), sample(Row("late", "p", 9.0))], step=0)
    assert held(archive) == {0: {"u0", "u3", "w0"}} and held(tracker) == {0: {"u3", "w0"}}
    assert [r.sample.metadata["uid"] for r in archive.records if r.watched] == ["w0"]
    stats = s.stats()
    assert stats.dropped == {"capped": 2, "late": 1} and stats.check()


@pytest.mark.anyio
async def test_log_rollouts_follows_the_watch_list() -> None:
    """The same 32 rows, cap 16, a watch on one prompt: log_rollouts keeps the 8 watched rows as
    log_samples(decode_rollouts(...)) does."""
    rows = [r for r in _grpo_steps(2)[1]]
    kept = {}
    for entry in ("log_rollouts", "log_samples"):
        mem = MemorySink(entry)
        async with at.TraceSession(
            "p", sinks=[mem], max_traces_per_step=16, sampler="top_bottom", watch=at.Watch(ids=[WATCHED])
        ) as s:
            if entry == "log_rollouts":
                await s.log_rollouts(step=0, **rollout_columns(rows))
            else:
                kwargs = rollout_columns(rows)
                await s.log_samples(rollouts.decode_rollouts(kwargs.pop("input_ids"), **kwargs), step=0)
        kept[entry] = held(mem)[0]
    watched = {r.uid for r in rows if r.prompt_id == WATCHED}
    assert len(watched) == 8 and watched <= kept["log_rollouts"]
    assert kept["log_rollouts"] == kept["log_samples"]


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
            await s.log_samples([sample(r) for r in rows], step=step)
    assert {step: len(v) for step, v in held(archive).items()} == {0: 32, 1: 32, 2: 32, 3: 32}
    want = {
        step: top_bottom([r for r in rows if r.prompt_id != WATCHED], 4) for step, rows in enumerate(steps)
    }
    for step, rows in enumerate(steps):
        want[step] |= {r.uid for r in rows if r.prompt_id == WATCHED}
    assert held(tracker) == want


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
        await s.log_samples([sample(r) for r in rows], step=0)
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
