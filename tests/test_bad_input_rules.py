"""Bad group keys, bad token fields and bad rollout rows follow the error rules in every entry point:
a RecordError naming the sample and field (and nothing counted), or counted "invalid" with
on_invalid="skip" (and the good samples logged)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import asynctrace as at
from asynctrace import rollouts
from asynctrace.sinks import Selected

pytestmark = pytest.mark.anyio

BAD_GROUP: dict[str, Any] = {"uid": 7}  # a dict cannot be a dict key: it names no group


def _samples() -> list[at.Sample]:
    """Two groups of two, with a sample between them whose group_uid is a dict."""
    out = []
    for i, group in enumerate(["a", "a", BAD_GROUP, "b", "b"]):
        out.append(
            at.Sample(
                messages=[{"role": "user", "content": f"p{i}"}, {"role": "assistant", "content": f"r{i}"}],
                metadata={"reward": float(i), "group_uid": group},
            )
        )
    return out


def _selections() -> list[dict[str, Any]]:
    """Session arguments under which a selection reads each sample's group."""
    return [
        {"max_traces_per_step": 8, "sampler": at.GroupSampler("top")},
        {"max_traces_per_step": 8, "sampler": at.GroupSampler("first"), "redact": lambda s: s},
        {"tier": at.GroupSampler("top_bottom")},  # only a Selected tier reads groups
    ]


def _session(mem: at.testing.MemorySink, on_invalid: str, **kw: Any) -> at.TraceSession:
    tier = kw.pop("tier", None)
    sinks = [Selected(mem, max_traces_per_step=8, sampler=tier)] if tier is not None else [mem]
    return at.TraceSession("p", sinks=sinks, on_invalid=on_invalid, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("kw", _selections(), ids=["cap", "cap-redact", "tier"])
async def test_an_unhashable_group_key_is_a_record_error_in_log_samples(kw: dict[str, Any]) -> None:
    """A dict as metadata["group_uid"] is a RecordError naming sample and field, and the call
    counts nothing; with on_invalid="skip" that sample alone is "invalid", the groups are written."""
    mem = at.testing.MemorySink()
    async with _session(mem, "raise", **dict(kw)) as s:
        with pytest.raises(at.RecordError) as info:
            await s.log_samples(_samples(), step=0)
        assert info.value.index == 2 and info.value.path == "metadata.group_uid"
    assert s.stats().submitted == 0 and not mem.records
    mem = at.testing.MemorySink()
    async with _session(mem, "skip", **dict(kw)) as s:
        await s.log_samples(_samples(), step=0)
    st = s.stats()
    assert st.dropped == {"invalid": 1} and st.written == 4 and st.check()
    assert sorted(x.metadata["group_uid"] for x in mem.samples) == ["a", "a", "b", "b"]


def test_an_unhashable_group_key_in_the_blocking_and_nowait_forms() -> None:
    """The blocking session and log_samples_nowait follow the same rule as the async call."""
    for on_invalid in ("raise", "skip"):
        for nowait in (False, True):
            mem = at.testing.MemorySink()
            with _session(mem, on_invalid, max_traces_per_step=8, sampler=at.GroupSampler("top")) as s:
                log = s.log_samples_nowait if nowait else s.log_samples
                if on_invalid == "raise":
                    with pytest.raises(at.RecordError, match=r"sample 2: metadata\.group_uid"):
                        log(_samples(), step=0)
                else:
                    log(_samples(), step=0)
            st = s.stats()
            if on_invalid == "raise":
                assert st.submitted == 0 and not mem.records
            else:
                assert st.dropped == {"invalid": 1} and st.written == 4 and st.check()


async def test_a_key_function_that_fails_or_returns_a_dict_names_its_sample() -> None:
    """A group key function's failure or unhashable result is the sample's error, path "metadata"."""

    def key(metadata: dict[str, Any]) -> Any:
        if metadata["reward"] == 1.0:
            raise KeyError("no group here")
        return metadata["group_uid"]

    mem = at.testing.MemorySink()
    async with at.TraceSession(
        "p", sinks=[mem], max_traces_per_step=8, sampler=at.GroupSampler("top", key=key), on_invalid="skip"
    ) as s:
        await s.log_samples(_samples(), step=0)
    st = s.stats()
    assert st.dropped == {"invalid": 2} and st.written == 3 and st.check()


async def test_group_metrics_do_not_count_a_sample_whose_group_cannot_be_named() -> None:
    """With group_key= alone (no group selection), the sample is logged and the metrics count
    the two named groups only."""
    mem = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[mem], group_key="group_uid") as s:
        assert await s.log_samples(_samples(), step=0) == 5
    assert mem.metrics and mem.metrics[0][1]["asynctrace/groups/train/count"] == 2.0
    assert s.stats().written == 5


def _rows() -> tuple[Any, list[list[int]]]:
    tok = rollouts.toy_tokenizer()
    return tok, [tok.encode(f"problem {i} answer {i}").ids for i in range(4)]


async def test_log_rollouts_names_an_unhashable_group_key() -> None:
    """A metadata column whose row holds a dict as group_uid: a RecordError naming that row, or
    "invalid" for that row alone."""
    tok, ids = _rows()
    groups = ["a", "a", BAD_GROUP, "b"]
    kw: dict[str, Any] = {"max_traces_per_step": 8, "sampler": at.GroupSampler("top")}
    rewards = [1.0, 2.0, 3.0, 4.0]
    async with at.TraceSession("p", sinks=[at.testing.MemorySink()], **kw) as s:
        with pytest.raises(at.RecordError) as info:
            await s.log_rollouts(ids, tokenizer=tok, step=0, rewards=rewards, metadata={"group_uid": groups})
        assert info.value.index == 2 and info.value.path == "metadata.group_uid"
    assert s.stats().submitted == 0
    mem = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[mem], on_invalid="skip", **kw) as s:
        n = await s.log_rollouts(ids, tokenizer=tok, step=0, rewards=rewards, metadata={"group_uid": groups})
    st = s.stats()
    assert n == 3 and st.dropped == {"invalid": 1} and st.written == 3 and st.check()


async def test_log_rollouts_token_field_errors_name_the_row_and_tokens() -> None:
    """A row whose log-probs do not match its tokens is RecordError(index=row, path="tokens")
    and the call counts nothing; with on_invalid="skip" only that row is "invalid"."""
    tok, ids = _rows()
    logprobs = [[-0.5] * len(row) for row in ids]
    logprobs[1] = logprobs[1][:-1]  # one value short
    fields = {"logprobs": logprobs}
    async with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as s:
        with pytest.raises(at.RecordError) as info:
            await s.log_rollouts(ids, tokenizer=tok, step=0, token_fields=fields)
        assert info.value.index == 1 and info.value.path == "tokens"
        assert "logprobs" in str(info.value)
    assert s.stats().submitted == 0 and s.stats().dropped == {}
    mem = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[mem], on_invalid="skip") as s:
        assert await s.log_rollouts(ids, tokenizer=tok, step=0, token_fields=fields) == 3
    st = s.stats()
    assert st.dropped == {"invalid": 1} and st.written == 3 and st.check()
    assert sorted(x.metadata["sample_index"] for x in mem.samples) == [0, 2, 3]


@pytest.mark.parametrize("cap", [{}, {"max_traces_per_step": 2, "sampler": "top_bottom"}])
async def test_log_rollouts_with_a_watch_list_treats_a_bad_row_alike(cap: dict[str, Any]) -> None:
    """With a watch list (every row decoded), a row whose log-probs do not match its tokens is
    still RecordError(index=row, path="tokens") naming the row asked for, or with
    on_invalid="skip" that row alone "invalid", the others logged as log_samples would."""
    tok, ids = _rows()
    logprobs = [[-0.5] * len(row) for row in ids]
    logprobs[1] = logprobs[1][:-1]  # one value short
    kw: dict[str, Any] = {
        "tokenizer": tok,
        "step": 0,
        "rewards": [1.0, 2.0, 3.0, 4.0],
        "token_fields": {"logprobs": logprobs},
        "metadata": {"prompt_id": ["w", "x", "y", "z"]},
    }
    watch = at.Watch(ids=["w"])
    async with at.TraceSession("p", sinks=[at.testing.MemorySink()], watch=watch, **cap) as s:
        with pytest.raises(at.RecordError) as info:
            await s.log_rollouts(ids, rows=[3, 1, 0], **kw)
        assert info.value.index == 1 and info.value.path == "tokens"
    assert s.stats().submitted == 0
    mem = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[mem], watch=watch, on_invalid="skip", **cap) as s:
        assert await s.log_rollouts(ids, **kw) == 3
    st = s.stats()
    assert st.dropped == {"invalid": 1} and st.written == 3 and st.check()
    assert sorted(x.metadata["sample_index"] for x in mem.samples) == [0, 2, 3]


@pytest.mark.parametrize("watch", [None, at.Watch(ids=["w"])])
async def test_log_rollouts_names_the_batch_row_with_rows_and_a_watch(watch: at.Watch | None) -> None:
    """rows=[2, 0] with row 2's group_uid a dict: the RecordError names row 2 of the batch, with
    or without a watch list (which decodes every row and takes log_samples' path)."""
    tok, ids = _rows()
    async with at.TraceSession(
        "p",
        sinks=[at.testing.MemorySink()],
        watch=watch,
        max_traces_per_step=8,
        sampler=at.GroupSampler("top"),
    ) as s:
        with pytest.raises(at.RecordError) as info:
            await s.log_rollouts(
                ids,
                tokenizer=tok,
                step=0,
                rewards=[1.0, 2.0, 3.0, 4.0],
                rows=[2, 0],
                metadata={"prompt_id": ["w", "x", "y", "z"], "group_uid": ["a", "a", BAD_GROUP, "b"]},
            )
        assert info.value.index == 2 and info.value.path == "metadata.group_uid"
    assert s.stats().submitted == 0


async def test_log_rollouts_with_a_cap_counts_only_the_bad_row() -> None:
    """Under a cap with on_invalid="skip", a bad row is "invalid", the others capped or logged,
    and nothing is counted twice."""
    tok, ids = _rows()
    logprobs = [[-0.5] * len(row) for row in ids]
    logprobs[3] = [-0.5]  # the best row is bad
    mem = at.testing.MemorySink()
    async with at.TraceSession(
        "p", sinks=[mem], max_traces_per_step=2, sampler="top_bottom", on_invalid="skip"
    ) as s:
        n = await s.log_rollouts(
            ids, tokenizer=tok, step=0, rewards=[1.0, 2.0, 3.0, 4.0], token_fields={"logprobs": logprobs}
        )
    st = s.stats()
    assert n == 2 and st.dropped == {"invalid": 1, "capped": 1} and st.written == 2 and st.check()


@pytest.mark.parametrize("on_invalid", ["raise", "skip"])
async def test_log_rollouts_whole_batch_problem_raises_before_counting(on_invalid: str) -> None:
    """Rewards for more rows than input_ids, or a loss mask of another shape, is a ValueError
    raised before anything is counted, whatever on_invalid says."""
    tok, _ = _rows()
    ids = torch.ones(3, 4, dtype=torch.long)
    async with at.TraceSession(
        "p",
        sinks=[at.testing.MemorySink()],
        max_traces_per_step=2,
        sampler="top_bottom",
        on_invalid=on_invalid,
    ) as s:
        with pytest.raises(ValueError, match="loss_mask: shape"):
            await s.log_rollouts(
                ids, tokenizer=tok, step=0, rewards=[1.0, 2.0, 3.0], loss_mask=torch.ones(2, 4)
            )
        with pytest.raises(ValueError, match="token_fields"):
            await s.log_rollouts(
                ids,
                tokenizer=tok,
                step=0,
                rewards=[1.0, 2.0, 3.0],
                token_fields={"logprobs": torch.ones(3, 5)},
            )
    st = s.stats()
    assert st.submitted == 0 and st.dropped == {} and st.check()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
async def test_a_complex_tensor_in_token_fields_is_refused(dtype: torch.dtype) -> None:
    """A complex torch tensor is refused naming the field (as numpy's complex is), not cut to
    its real part: in Sample.tokens and in log_rollouts' token_fields."""
    sample = at.Sample(
        messages=[{"role": "user", "content": "p"}],
        metadata={},
        tokens={"logprobs": torch.tensor([-0.5 + 1j, -0.25], dtype=dtype)},
    )
    numpy_sample = at.Sample(
        messages=sample.messages, metadata={}, tokens={"logprobs": np.array([-0.5 + 1j])}
    )
    async with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as s:
        for each in (sample, numpy_sample):
            with pytest.raises(at.RecordError) as info:
                await s.log_samples([each], step=0)
            assert info.value.path == "tokens" and "logprobs" in str(info.value)
        tok, _ = _rows()
        ids = torch.ones(2, 3, dtype=torch.long)
        with pytest.raises(ValueError, match=r"logprobs.*complex"):
            await s.log_rollouts(
                ids, tokenizer=tok, step=0, token_fields={"logprobs": torch.ones(2, 3, dtype=dtype)}
            )
    assert s.stats().submitted == 0
