"""log_rollouts: the cap and sampler choose rows from rewards before anything is decoded."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

import asynctrace as at
from asynctrace import rollouts
from tests._util import read_traces

pytestmark = pytest.mark.anyio


def _batch(n: int) -> tuple[Any, Any, Any, list[str]]:
    tok = rollouts.toy_tokenizer()
    texts = [f"problem {i} answer {i * 7}" for i in range(n)]
    prompts = [tok.encode(f"problem {i}").ids for i in range(n)]
    answers = [tok.encode(f" answer {i * 7}").ids for i in range(n)]
    width = max(len(p) + len(a) for p, a in zip(prompts, answers, strict=True))
    ids = torch.zeros(n, width, dtype=torch.long)
    loss = torch.zeros(n, width, dtype=torch.long)
    attn = torch.zeros(n, width, dtype=torch.bool)
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        loss[i, len(p) : len(p) + len(a)] = 1
        attn[i, : len(p) + len(a)] = True
    return tok, ids, (loss, attn), texts


class CountingTokenizer:
    """Wraps a real tokenizer and counts how many sequences it was asked to decode."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.decoded = 0

    def batch_decode(self, sequences: list[list[int]], **_: Any) -> list[str]:
        self.decoded += len(sequences)
        return list(self.inner.decode_batch(sequences, skip_special_tokens=False))


async def test_cap_decides_before_decoding(project: str) -> None:
    """With a top_bottom cap of 4 of 64 rows, only kept rows are decoded and the extremes land in Trackio."""
    tok, ids, (loss, attn), _ = _batch(64)
    counting = CountingTokenizer(tok)
    rewards = torch.tensor([float((i * 37) % 64) for i in range(64)])
    # Trackio in a thread: the test checks its store, not the writer process (~1.5 CPU-s a start).
    trackio = at.TrackioSink(process=False)
    async with at.TraceSession(
        project, run="r", sinks=[trackio], max_traces_per_step=4, sampler="top_bottom"
    ) as s:
        n = await s.log_rollouts(
            ids, tokenizer=counting, step=0, rewards=rewards, loss_mask=loss, attention_mask=attn
        )
        assert n == 4
    st = s.stats()
    assert st.written == 4 and st.dropped == {"capped": 60} and st.check()
    assert counting.decoded <= 2 * 4  # a prompt and a response per kept row, never all 64
    rows = read_traces(project, "r")
    assert sorted(r["metadata"]["reward"] for r in rows) == [0.0, 1.0, 62.0, 63.0]
    for r in rows:
        i = next(i for i in range(64) if float((i * 37) % 64) == r["metadata"]["reward"])
        assert r["messages"][0] == {"role": "user", "content": f"problem {i}"}
        assert r["messages"][1] == {"role": "assistant", "content": f" answer {i * 7}"}


async def test_rows_beyond_a_filled_first_cap_are_counted_capped() -> None:
    """With `first`, a later call whose rows cannot be kept decodes nothing and counts them capped."""
    tok, ids, (loss, attn), _ = _batch(8)
    counting = CountingTokenizer(tok)
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], max_traces_per_step=5) as s:
        assert await s.log_rollouts(ids, tokenizer=counting, step=3, loss_mask=loss, attention_mask=attn) == 5
        before = counting.decoded
        assert await s.log_rollouts(ids, tokenizer=counting, step=3, loss_mask=loss) == 0
        assert counting.decoded == before
    assert s.stats().dropped == {"capped": 11} and s.stats().written == 5


async def test_a_batch_that_does_not_fit_together_raises_before_counting() -> None:
    """A loss mask with fewer rows than input_ids is a problem of the whole batch: a ValueError
    naming it, raised before anything is counted (a call that raises counts nothing)."""
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], max_traces_per_step=2, sampler="top_bottom") as s:
        with pytest.raises(ValueError, match="loss_mask"):
            await s.log_rollouts(
                [[1, 2, 3], [4, 5]],
                tokenizer=rollouts.toy_tokenizer(),
                step=0,
                rewards=[1.0, 2.0],
                loss_mask=[[0, 1]],
            )
        await anyio.sleep(0)
    st = s.stats()
    assert st.submitted == 0 and st.dropped == {} and st.check() and st.pending == 0


async def test_rows_without_a_score_are_skipped_as_invalid_when_asked() -> None:
    """With on_invalid="skip", rows a ranking sampler cannot score (NaN, or past a short
    rewards column) are counted as invalid and the rest are logged; with "raise", nothing is."""
    tok, ids, (loss, attn), _ = _batch(6)
    rewards = torch.tensor([5.0, float("nan"), 1.0, 4.0, 2.0])  # row 5 has no reward at all
    sink = at.testing.MemorySink()
    async with at.TraceSession(
        "p", sinks=[sink], max_traces_per_step=2, sampler="top_bottom", on_invalid="skip"
    ) as s:
        n = await s.log_rollouts(
            ids, tokenizer=tok, step=0, rewards=rewards, loss_mask=loss, attention_mask=attn
        )
    st = s.stats()
    assert n == 2 and st.check()
    assert st.dropped == {"invalid": 2, "capped": 2}
    assert sorted(x.metadata["reward"] for x in sink.samples) == [1.0, 5.0]
    async with at.TraceSession(
        "p", sinks=[at.testing.MemorySink()], max_traces_per_step=2, sampler="top_bottom"
    ) as s:
        with pytest.raises(at.RecordError, match="sample 1: rewards"):
            await s.log_rollouts(
                ids, tokenizer=tok, step=0, rewards=rewards, loss_mask=loss, attention_mask=attn
            )
    assert s.stats().submitted == 0


async def test_rows_picks_and_orders_what_the_cap_chooses_from() -> None:
    """rows= works as in decode_rollouts: only those rows, in that order, are offered to the cap."""
    import numpy as np

    tok, ids, (loss, attn), _ = _batch(6)
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], max_traces_per_step=3) as s:
        n = await s.log_rollouts(
            ids, tokenizer=tok, step=0, loss_mask=loss, attention_mask=attn, rows=[4, np.int64(1), 5, 0]
        )
    st = s.stats()
    assert n == 3 and st.submitted == 4 and st.dropped == {"capped": 1} and st.check()
    assert [x.messages[-1]["content"] for x in sink.samples] == [" answer 28", " answer 7", " answer 35"]
    async with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as s:
        with pytest.raises(ValueError, match="rows: 9 is out of range"):
            await s.log_rollouts(ids, tokenizer=tok, step=0, loss_mask=loss, rows=[9])


@pytest.mark.parametrize("watch", [None, at.Watch(ids=["nothing"])])
async def test_rows_decoded_after_finish_are_counted_closed(watch: at.Watch | None) -> None:
    """Rows reserved before finish() but decoded after it are dropped as "closed", not reported
    as accepted into a buffer nothing drains any more (with a watch list too, where every row is
    decoded first)."""
    import time

    tok, ids, (loss, _), _ = _batch(4)

    class SlowTokenizer(CountingTokenizer):
        def batch_decode(self, sequences: list[list[int]], **kw: Any) -> list[str]:
            time.sleep(0.5)
            return super().batch_decode(sequences, **kw)

    sink = at.testing.MemorySink()
    s = at.TraceSession("p", sinks=[sink], watch=watch)
    async with s:
        got: list[int] = []

        async def log() -> None:
            got.append(await s.log_rollouts(ids, tokenizer=SlowTokenizer(tok), step=0, loss_mask=loss))

        async with anyio.create_task_group() as tg:
            tg.start_soon(log)
            await anyio.sleep(0.1)
            await s.finish(timeout=1)
    st = s.stats()
    assert got == [0] and not sink.records
    assert st.dropped == {"closed": 4} and st.pending == 0 and st.check()


async def test_one_row_too_large_is_skipped_alone_with_on_invalid_skip() -> None:
    """With on_invalid="skip", a decoded row over max_queue_bytes is counted "invalid" and the
    other kept rows are written, as log_samples does with the same samples."""
    tok = rollouts.toy_tokenizer()
    rows = [tok.encode(t).ids for t in ["hello", "The quick brown fox " * 400, "world"]]
    mem = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[mem], on_invalid="skip", max_queue_bytes=4000) as s:
        assert await s.log_rollouts(rows, tokenizer=tok, step=0) == 2
    st = s.stats()
    assert st.written == 2 and st.dropped == {"invalid": 1} and st.check()
    assert [r.sample.messages[-1]["content"] for r in mem.records] == ["hello", "world"]


@pytest.mark.parametrize("sampler", ["top_bottom", "first", "reservoir"])
async def test_an_overflowing_reward_is_one_invalid_row(sampler: str) -> None:
    """A reward of 10**400 (no float holds it) is a RecordError naming its row, or with
    on_invalid="skip" that row alone counts "invalid": never an OverflowError."""
    tok = rollouts.toy_tokenizer()
    rows = [tok.encode(t).ids for t in ["hello", "big", "world"]]
    rewards = [1.0, 10**400, 2.0]
    mem = at.testing.MemorySink()
    async with at.TraceSession(
        "p", sinks=[mem], max_traces_per_step=4, sampler=sampler, on_invalid="skip"
    ) as s:
        assert await s.log_rollouts(rows, tokenizer=tok, step=0, rewards=rewards) == 2
    st = s.stats()
    assert st.written == 2 and st.dropped == {"invalid": 1} and st.check()
    assert sorted(x.metadata["reward"] for x in mem.samples) == [1.0, 2.0]
    async with at.TraceSession(
        "p", sinks=[at.testing.MemorySink()], max_traces_per_step=4, sampler=sampler
    ) as s:
        with pytest.raises(at.RecordError, match="sample 1"):
            await s.log_rollouts(rows, tokenizer=tok, step=0, rewards=rewards)


@pytest.mark.parametrize("sampler", ["top_bottom", "first", "reservoir"])
async def test_a_batch_that_raised_takes_no_places(sampler: str) -> None:
    """A call that raised on a bad batch takes no places in the step's selection: later rows
    take them, and nothing of the failed call is counted."""
    tok = rollouts.toy_tokenizer()
    mem = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[mem], max_traces_per_step=2, sampler=sampler) as s:  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="loss_mask"):
            await s.log_rollouts(
                [[5, 6, 7], [8, 9]], tokenizer=tok, step=0, rewards=[10.0, 20.0], loss_mask=[[0, 1]]
            )
        await s.log_rollouts([[5, 6], [8, 9]], tokenizer=tok, step=0, rewards=[15.0, 1.0])
    st = s.stats()
    assert st.written == 2 and len(mem.records) == 2
    assert st.submitted == 2 and st.dropped == {} and st.pending == 0 and st.check()


def test_check_fails_on_a_negative_count() -> None:
    """stats().check() does not let a negative pending count balance a double-counted drop."""
    stats = at.SessionStats(submitted=2, accepted=2, written=1, dropped={"capped": 2}, failed=0, pending=-1)
    assert not stats.check()


async def test_steps_closed_by_log_rollouts_are_written_without_a_flush() -> None:
    """Rows a holding sampler releases when log_rollouts moves to a newer step reach the sink
    within a few flush intervals, with no flush() and no step_timeout."""
    tok = rollouts.toy_tokenizer()
    rows = [tok.encode(f"problem {i} answer {i}").ids for i in range(8)]
    sink = at.testing.MemorySink()
    async with at.TraceSession(
        "p",
        sinks=[sink],
        max_traces_per_step=2,
        sampler="top_bottom",
        max_open_steps=0,
        step_timeout=None,
        flush_interval=0.02,
    ) as s:
        for step in range(6):  # each step closes the one before it
            await s.log_rollouts(rows, tokenizer=tok, step=step, rewards=[float(i) for i in range(8)])
        with anyio.fail_after(5):
            while len(sink.records) < 10:
                await anyio.sleep(0.01)
        assert sorted({r.step for r in sink.records}) == [0, 1, 2, 3, 4]


async def test_the_group_sampler_keeps_whole_groups_of_rollouts() -> None:
    """Rows reserved by reward before decoding are ranked in the groups their metadata names when
    the step closes: the best whole group is written, not the best rows of several groups."""
    tok, ids, (loss, _), _ = _batch(12)
    rewards = [3.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    groups = [f"g{i // 4}" for i in range(12)]
    mem = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[mem], max_traces_per_step=4, sampler=at.GroupSampler("top")) as s:
        await s.log_rollouts(
            ids, tokenizer=tok, step=0, rewards=rewards, loss_mask=loss, metadata={"group_uid": groups}
        )
    assert sorted(r.sample.metadata["group_uid"] for r in mem.records) == ["g1"] * 4
    st = s.stats()
    assert st.written == 4 and st.dropped == {"capped": 8} and st.check()


def _reward_halved(sample: at.Sample) -> at.Sample:
    return at.Sample(
        messages=sample.messages, metadata={**sample.metadata, "reward": sample.metadata["reward"] // 2}
    )


@pytest.mark.parametrize(
    "session",
    [
        {"redact": _reward_halved, "max_traces_per_step": 3, "sampler": "top_bottom"},
        {"group_key": "g", "max_traces_per_step": 4, "sampler": at.GroupSampler("top", key="g")},
    ],
    ids=["redact-changes-scores", "group-metrics"],
)
async def test_log_rollouts_keeps_and_counts_what_log_samples_of_the_decoded_rows_does(
    session: dict[str, Any],
) -> None:
    """A redact that changes rewards ranks by the redacted score, and group_key= counts every row
    in the group metrics, in log_rollouts as in log_samples(decode_rollouts(...))."""
    tok, ids, (loss, _), _ = _batch(8)
    kw: dict[str, Any] = {
        "tokenizer": tok,
        "loss_mask": loss,
        "rewards": [3.0, 7.0, 2.0, 6.0, 1.0, 5.0, 0.0, 4.0],
        "metadata": {"g": ["a", "a", "b", "b", "c", "c", "d", "d"]},
    }
    got = []
    for entry in ("log_rollouts", "log_samples"):
        mem = at.testing.MemorySink()
        async with at.TraceSession("p", sinks=[mem], health_metrics=False, **session) as s:
            if entry == "log_rollouts":
                await s.log_rollouts(ids, step=0, **kw)
            else:
                await s.log_samples(rollouts.decode_rollouts(ids, **kw), step=0)
        assert s.stats().check()
        got.append((sorted(x.metadata["sample_index"] for x in mem.samples), mem.metrics, s.stats().dropped))
    assert got[0] == got[1]


@pytest.mark.parametrize("sampler", ["first", "top_bottom"])
async def test_a_row_named_twice_in_rows_is_two_samples_under_a_cap(sampler: str) -> None:
    """rows=[1, 1, 0, 2] with row 1's log-probs a value short, and rows=[0, 0, 2]: under a cap
    each place is a sample of its own, as decode_rollouts returns it: a record and an id each,
    and row 1 counted "invalid" twice (the accounting adds up to the four rows passed)."""
    tok = rollouts.toy_tokenizer()
    ids = [tok.encode(f"problem {i} answer {i}").ids for i in range(4)]
    logprobs = [[-0.5] * len(row) for row in ids]
    logprobs[1] = logprobs[1][:-1]
    kw: dict[str, Any] = {"tokenizer": tok, "rewards": [1.0, 2.0, 3.0, 4.0]}
    mem = at.testing.MemorySink()
    async with at.TraceSession(
        "p", sinks=[mem], max_traces_per_step=8, sampler=sampler, on_invalid="skip", health_metrics=False
    ) as s:
        assert await s.log_rollouts(ids, step=0, rows=[0, 0, 2], **kw) == 3
        fields = {"logprobs": logprobs}
        assert await s.log_rollouts(ids, step=1, rows=[1, 1, 0, 2], token_fields=fields, **kw) == 2
    stats = s.stats()
    assert stats.submitted == 7 and stats.dropped == {"invalid": 2} and stats.written == 5 and stats.check()
    assert len({r.id for r in mem.records}) == 5
    assert sorted(r.sample.metadata["sample_index"] for r in mem.records if r.step == 0) == [0, 0, 2]
