from __future__ import annotations

from typing import Any

import pytest

import asynctrace as at
from asynctrace.adapters import areal_adapter
from tests._util import read_traces
from tests.rollouts._helpers import CONVERSATIONS, expected_messages, padded_batch

torch = pytest.importorskip("torch")


def rollout_batch(tokenizer: Any, conversations: list[Any]) -> dict[str, Any]:
    """AReaL's padded dict: input_ids, attention_mask, loss_mask, logprobs, versions, rewards."""
    batch = padded_batch(tokenizer, conversations)
    batch["logprobs"] = torch.zeros(batch["input_ids"].shape)
    batch["rewards"] = torch.arange(len(conversations), dtype=torch.float32) / 2
    return batch


def test_group_of_samples_per_prompt(tokenizer: Any) -> None:
    """Several samples of one prompt decode to their own turns and share the prompt text."""
    group = [CONVERSATIONS[0], CONVERSATIONS[0], CONVERSATIONS[2]]
    group[1] = [*CONVERSATIONS[0][:3], ("assistant", "A different final answer.")]
    batch = rollout_batch(tokenizer, group)
    samples = areal_adapter.to_samples(batch, tokenizer=tokenizer, metadata={"group_id": [0, 0, 1]})
    assert [s.messages for s in samples] == [expected_messages(c) for c in group]
    assert [s.metadata["reward"] for s in samples] == [0.0, 0.5, 1.0]
    assert [s.metadata["group_id"] for s in samples] == [0, 0, 1]
    assert samples[0].messages[0] == samples[1].messages[0]


def test_multi_turn_tool_turns_and_versions(tokenizer: Any) -> None:
    """Tool feedback between assistant turns comes back as tool messages; versions give min/max."""
    batch = rollout_batch(tokenizer, [CONVERSATIONS[2]])
    (sample,) = areal_adapter.to_samples(batch, tokenizer=tokenizer)
    assert [m["role"] for m in sample.messages] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert sample.messages == expected_messages(CONVERSATIONS[2])
    assert sample.metadata["policy_version_min"] == sample.metadata["policy_version_max"] == 3
    assert sample.metadata["num_turns"] == 3


def test_eval_batches_without_rewards_or_versions(tokenizer: Any) -> None:
    """An eval batch with only ids and masks still decodes; reward and versions are left out."""
    batch = rollout_batch(tokenizer, CONVERSATIONS[:2])
    del batch["rewards"], batch["versions"]
    samples = areal_adapter.to_samples(batch, tokenizer=tokenizer)
    assert [s.messages for s in samples] == [expected_messages(c) for c in CONVERSATIONS[:2]]
    assert all("reward" not in s.metadata and "policy_version_min" not in s.metadata for s in samples)
    with pytest.raises(ValueError, match="input_ids"):
        areal_adapter.to_samples({"attention_mask": batch["attention_mask"]}, tokenizer=tokenizer)


def test_short_rewards_warn_once(tokenizer: Any) -> None:
    """A rewards tensor shorter than the batch leaves the reward out of the last samples."""
    batch = rollout_batch(tokenizer, CONVERSATIONS)
    batch["rewards"] = batch["rewards"][:2]
    with pytest.warns(UserWarning, match="rewards has 2 values for 4 samples") as record:
        samples = areal_adapter.to_samples(batch, tokenizer=tokenizer)
    assert len(record) == 1
    assert [s.metadata.get("reward") for s in samples] == [0.0, 0.5, None, None]


def test_rows_pick_samples_before_decoding(tokenizer: Any) -> None:
    """`rows` decodes only the chosen samples, in that order."""
    batch = rollout_batch(tokenizer, CONVERSATIONS)
    samples = areal_adapter.to_samples(batch, tokenizer=tokenizer, rows=[2, 0])
    assert [s.metadata["sample_index"] for s in samples] == [2, 0]
    assert samples[0].messages == expected_messages(CONVERSATIONS[2])


@pytest.mark.anyio
async def test_end_to_end_log_rollouts_decodes_only_capped_rows(tokenizer: Any, project: str) -> None:
    """Through log_rollouts with a top/bottom cap of 2, Trackio holds the best and worst samples."""
    batch = rollout_batch(tokenizer, CONVERSATIONS)
    async with at.TraceSession(project, run="r", max_traces_per_step=2, sampler="top_bottom") as session:
        await session.log_rollouts(**areal_adapter.rollout_kwargs(batch), tokenizer=tokenizer, step=3)
        await session.log_samples(
            areal_adapter.to_samples(batch, tokenizer=tokenizer, rows=[1]), step=3, split="eval"
        )
    stats = session.stats()
    assert stats.dropped.get("capped") == 2
    traces = read_traces(project, "r")
    train = sorted((t for t in traces if t["key"] == "train/traces"), key=lambda t: t["metadata"]["reward"])
    assert [t["metadata"]["sample_index"] for t in train] == [0, 3]
    assert train[1]["messages"] == expected_messages(CONVERSATIONS[3])
    assert [t["metadata"]["sample_index"] for t in traces if t["key"] == "eval/traces"] == [1]
