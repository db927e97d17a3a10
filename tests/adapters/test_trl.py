from __future__ import annotations

import math
from collections import deque
from typing import Any

import pytest
import torch

import asynctrace as at
from asynctrace.adapters import trl_adapter
from tests._util import read_traces


def grpo_logs() -> dict[str, Any]:
    """The shape of GRPOTrainer._logs: deques of prompts, completions, per-function rewards."""
    return {
        "prompt": deque(["What is 2 + 2?"] * 2 + ["Name a colour."] * 2),
        "completion": deque(["4", "5", "blue", "seven"]),
        "rewards": {
            "accuracy": deque([1.0, 0.0, 1.0, 0.0]),
            "format": deque([0.5, 0.5, math.nan, 0.75]),
        },
        "advantages": deque([0.7, -0.7, 0.9, -0.9]),
        "extra": {"model_version": deque([3, 3, 3, 4])},
    }


def test_columns_become_samples_with_a_nested_breakdown() -> None:
    """Each reward function is a column of reward_breakdown; reward is their NaN-skipping sum."""
    logs = grpo_logs()
    samples = trl_adapter.to_samples(
        logs["prompt"],
        logs["completion"],
        rewards=logs["rewards"],
        advantages=logs["advantages"],
        extra=logs["extra"],
        num_generations=2,
    )
    assert samples[2].messages == [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "blue"},
    ]
    assert samples[0].metadata["reward_breakdown"] == {"accuracy": 1.0, "format": 0.5}
    assert samples[0].metadata["reward"] == 1.5
    assert samples[2].metadata["reward_breakdown"] == {"accuracy": 1.0, "format": None}
    assert samples[2].metadata["reward"] == 1.0
    all_nan = trl_adapter.to_samples(["q"], ["a"], rewards={"accuracy": [math.nan], "format": [math.nan]})
    assert all_nan[0].metadata["reward"] == 0.0  # TRL's nansum over the functions
    assert [s.metadata["advantage"] for s in samples] == [0.7, -0.7, 0.9, -0.9]
    assert [s.metadata["prompt_index"] for s in samples] == [0, 0, 1, 1]
    assert [s.metadata["model_version"] for s in samples] == [3, 3, 3, 4]


def test_reward_weights_scale_the_sum() -> None:
    """reward_weights weigh each function as TRL does."""
    logs = grpo_logs()
    (first, *_) = trl_adapter.to_samples(
        logs["prompt"], logs["completion"], rewards=logs["rewards"], reward_weights=[2.0, 1.0]
    )
    assert first.metadata["reward"] == 2.5
    with pytest.raises(ValueError, match="reward_weights"):
        trl_adapter.to_samples(
            logs["prompt"], logs["completion"], rewards=logs["rewards"], reward_weights=[1.0]
        )


def test_tensor_reward_weights_give_a_float_reward() -> None:
    """TRL's own reward_weights tensor weighs the sum and the reward stays a plain float."""
    logs = grpo_logs()
    samples = trl_adapter.to_samples(
        logs["prompt"], logs["completion"], rewards=logs["rewards"], reward_weights=torch.tensor([2.0, 1.0])
    )
    assert type(samples[0].metadata["reward"]) is float
    assert [s.metadata["reward"] for s in samples] == [2.5, 0.5, 2.0, 0.75]


def test_extra_columns_may_not_replace_the_adapters_keys() -> None:
    """An extra column named like a key the adapter sets (reward with rewards given, sample_index)
    is refused, naming the column; one the adapter does not set this time is kept."""
    logs = grpo_logs()
    for name in ("reward", "sample_index"):
        with pytest.raises(ValueError, match=rf"extra\['{name}'\]"):
            trl_adapter.to_samples(
                logs["prompt"], logs["completion"], rewards=logs["rewards"], extra={name: [0.0] * 4}
            )
    # Without rewards= or advantages=, the adapter sets neither: the user's own columns are kept.
    samples = trl_adapter.to_samples(
        logs["prompt"], logs["completion"], extra={"reward": [0.5] * 4, "advantage": [0.1] * 4}
    )
    assert [(s.metadata["reward"], s.metadata["advantage"]) for s in samples] == [(0.5, 0.1)] * 4


def test_reward_weights_may_be_any_iterable() -> None:
    """Weights given as a generator (or a tensor, as TRL keeps them) weigh the reward functions."""
    logs = grpo_logs()
    names = list(logs["rewards"])
    by_list = trl_adapter.to_samples(
        logs["prompt"], logs["completion"], rewards=logs["rewards"], reward_weights=[0.5] * len(names)
    )
    by_gen = trl_adapter.to_samples(
        logs["prompt"], logs["completion"], rewards=logs["rewards"], reward_weights=(0.5 for _ in names)
    )
    assert [s.metadata["reward"] for s in by_gen] == [s.metadata["reward"] for s in by_list]


def test_malformed_messages_name_the_entry() -> None:
    """A prompt or completion that is neither text nor a list of messages names its column and row."""
    with pytest.raises(ValueError, match=r"prompt\[1\]: expected a string"):
        trl_adapter.to_samples(["q", None], ["a", "b"])
    with pytest.raises(ValueError, match=r"completion\[0\]\[1\]: expected a message"):
        trl_adapter.to_samples(["q"], [[{"role": "assistant", "content": "a"}, "b"]])


def test_conversational_completions_with_tool_turns() -> None:
    """Conversational prompts and completions (tool calls and tool results) keep every message."""
    prompt = [[{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}]]
    completion = [
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "name": "weather", "content": "18C, sunny"},
            {"role": "assistant", "content": "It is 18C and sunny."},
        ]
    ]
    (sample,) = trl_adapter.to_samples(prompt, completion)
    assert sample.messages == [*prompt[0], *completion[0]]
    assert sample.messages is not completion[0]


def test_eval_mode_without_advantages() -> None:
    """Eval completions come without advantages; the samples simply lack them."""
    (sample,) = trl_adapter.to_samples(["q"], ["a"], rewards={"accuracy": [1.0]})
    assert sample.metadata == {"sample_index": 0, "reward_breakdown": {"accuracy": 1.0}, "reward": 1.0}


def test_short_optional_columns_warn_once() -> None:
    """Short reward, advantage and extra columns are left out where they fall short."""
    logs = grpo_logs()
    logs["rewards"]["format"].pop()
    with pytest.warns(UserWarning) as record:
        samples = trl_adapter.to_samples(
            logs["prompt"], logs["completion"], rewards=logs["rewards"], advantages=[0.1], extra={"id": ["a"]}
        )
    assert len(record) == 1
    assert samples[3].metadata["reward_breakdown"] == {"accuracy": 0.0}
    assert [s.metadata.get("advantage") for s in samples] == [0.1, None, None, None]
    assert [s.metadata.get("id") for s in samples] == ["a", None, None, None]


def test_required_columns_must_agree() -> None:
    """Prompt and completion of different lengths, or broken groups, are refused."""
    with pytest.raises(ValueError, match="prompt: has 1 entries but completion has 2"):
        trl_adapter.to_samples(["q"], ["a", "b"])
    with pytest.raises(ValueError, match="num_generations"):
        trl_adapter.to_samples(["q"] * 3, ["a"] * 3, num_generations=2)


@pytest.mark.anyio
async def test_end_to_end_into_trackio(project: str) -> None:
    """TRL columns land in Trackio; the top/bottom cap ranks by the summed reward."""
    logs = grpo_logs()
    samples = trl_adapter.to_samples(
        logs["prompt"], logs["completion"], rewards=logs["rewards"], num_generations=2
    )
    async with at.TraceSession(project, run="r", max_traces_per_step=2, sampler="top_bottom") as session:
        await session.log_samples(samples, step=5)
        await session.log_samples(samples[:1], step=5, split="eval")
    traces = read_traces(project, "r")
    train = sorted((t for t in traces if t["key"] == "train/traces"), key=lambda t: t["metadata"]["reward"])
    assert [t["messages"][-1]["content"] for t in train] == ["5", "4"]
    assert train[1]["metadata"]["reward_breakdown"] == {"accuracy": 1.0, "format": 0.5}
    assert [t["key"] for t in traces].count("eval/traces") == 1
