from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import pytest

import asynctrace as at
from asynctrace.adapters import torchforge_adapter
from tests._util import read_traces
from tests.rollouts._helpers import encode

# Mirrors of torchforge's types (apps/grpo/main.py, forge/data_models), same field names.


class Role(enum.Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass
class Message:
    context: str
    role: Role


@dataclass
class Prompt:
    messages: list[Message]
    metadata: Any | None = None


@dataclass
class FunctionCall:
    name: str
    arguments: str


@dataclass
class ToolCall:
    id: str
    function: FunctionCall
    type: str = "function"


@dataclass
class Completion:
    prompt: Any
    text: str | None
    prompt_ids: Any
    token_ids: Any
    logprobs: Any = None
    stop_reason: str | None = None
    generator_version: int | None = None
    metadata: dict[str, Any] | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None


@dataclass
class Episode:
    episode_id: str
    pad_id: int
    request_len: int
    response_len: int
    target: Any | None = None
    request: str | None = None
    response: str | None = None
    completion: Completion | None = None
    ref_logprobs: Any = None
    reward: float | None = None
    reward_breakdown: dict[str, float] | None = None
    advantage: float | None = None


def episode(tokenizer: Any, k: int, question: str = "What is 3 + 4?", **extra: Any) -> Episode:
    answer = f"<answer>{k}</answer>"
    completion = Completion(
        prompt=question,
        text=answer,
        prompt_ids=encode(tokenizer, [("user", question)])[0],
        token_ids=encode(tokenizer, [("assistant", answer)])[0],
        stop_reason="stop",
        generator_version=k,
        metadata={"latency_s": 0.5},
    )
    fields: dict[str, Any] = {
        "episode_id": f"ep-{k}",
        "pad_id": 0,
        "request_len": 512,
        "response_len": 512,
        "target": "7",
        "request": question,
        "response": answer,
        "completion": completion,
        "reward": float(k == 7),
        "reward_breakdown": {"MathReward": float(k == 7), "ThinkingReward": 0.2, "reward": 0.5},
        "advantage": 0.25,
    }
    fields.update(extra)
    return Episode(**fields)


def test_several_episodes_per_prompt_keep_the_breakdown_nested(tokenizer: Any) -> None:
    """Each episode of a group is a sample; reward_breakdown stays a nested mapping."""
    samples = torchforge_adapter.to_samples([episode(tokenizer, k) for k in (6, 7)])
    assert samples[1].messages == [
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "<answer>7</answer>"},
    ]
    meta = samples[1].metadata
    assert meta["reward"] == 1.0
    assert meta["reward_breakdown"] == {"MathReward": 1.0, "ThinkingReward": 0.2, "reward": 0.5}
    assert "MathReward" not in meta
    assert meta["policy_version"] == 7 and meta["stop_reason"] == "stop" and meta["target"] == "7"
    assert meta["episode_id"] == "ep-7" and meta["advantage"] == 0.25
    assert meta["completion_metadata"] == {"latency_s": 0.5}
    # request_len / response_len are torchforge's padding budgets; the lengths are the tokens'.
    completion = episode(tokenizer, 7).completion
    assert meta["max_request_len"] == meta["max_response_len"] == 512
    assert meta["response_len"] == len(completion.token_ids) < 512
    assert meta["prompt_len"] == len(completion.prompt_ids) < 512


def test_a_single_episode_is_accepted(tokenizer: Any) -> None:
    """A lone Episode is normalised to a list once."""
    (sample,) = torchforge_adapter.to_samples(episode(tokenizer, 1))
    assert sample.metadata["episode_id"] == "ep-1"


def test_groups_or_other_objects_are_refused_not_logged_empty(tokenizer: Any) -> None:
    """A list of GRPO groups is refused naming the entry, not turned into blank samples."""
    groups = [[episode(tokenizer, k) for k in (6, 7)], [episode(tokenizer, k) for k in (1, 2)]]
    with pytest.raises(ValueError, match=r"episodes\[0\]: expected an Episode"):
        torchforge_adapter.to_samples(groups)
    with pytest.raises(ValueError, match="episodes: expected an Episode"):
        torchforge_adapter.to_samples(None)
    flat = torchforge_adapter.to_samples([ep for group in groups for ep in group])
    assert [s.metadata["episode_id"] for s in flat] == ["ep-6", "ep-7", "ep-1", "ep-2"]


def test_multi_turn_prompt_with_tool_turns_and_tool_calls(tokenizer: Any) -> None:
    """Chat prompt messages (with tool turns) keep their roles; tool calls stay on the assistant turn."""
    ep = episode(tokenizer, 2)
    assert ep.completion is not None
    ep.completion.prompt = Prompt(
        messages=[
            Message("Use the calculator.", Role.SYSTEM),
            Message("What is 3 + 4?", Role.USER),
            Message('{"name": "add", "arguments": {"a": 3, "b": 4}}', Role.ASSISTANT),
            Message("7", Role.TOOL),
        ]
    )
    ep.completion.tool_calls = [ToolCall("call-1", FunctionCall("submit", '{"answer": 7}'))]
    ep.completion.content = "Submitting."
    (sample,) = torchforge_adapter.to_samples([ep])
    assert [m["role"] for m in sample.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert sample.messages[3]["content"] == "7"
    assert sample.messages[-1] == {
        "role": "assistant",
        "content": "Submitting.",
        "tool_calls": [
            {"type": "function", "function": {"name": "submit", "arguments": '{"answer": 7}'}, "id": "call-1"}
        ],
    }


def test_tokens_are_decoded_when_text_is_missing(tokenizer: Any) -> None:
    """Without request/response text, prompt_ids and token_ids are decoded in one call."""
    eps = [episode(tokenizer, k, request=None, response=None) for k in (3, 4)]
    for ep in eps:
        assert ep.completion is not None
        ep.completion.prompt = None
        ep.completion.text = None
    samples = torchforge_adapter.to_samples(eps, tokenizer=tokenizer)
    assert samples[1].messages == [
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "<answer>4</answer>"},
    ]
    with pytest.raises(ValueError, match="tokenizer"):
        torchforge_adapter.to_samples(eps)


def test_eval_episodes_with_missing_optional_fields(tokenizer: Any) -> None:
    """Eval episodes without advantage, breakdown or completion still make samples."""
    bare = Episode(episode_id="eval-0", pad_id=0, request_len=8, response_len=8, request="q", response="a")
    (sample,) = torchforge_adapter.to_samples([bare])
    assert sample.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert set(sample.metadata) == {"episode_id", "max_request_len", "max_response_len"}


@pytest.mark.anyio
async def test_end_to_end_into_trackio(tokenizer: Any, project: str) -> None:
    """Episodes land in Trackio with the reward breakdown still nested."""
    samples = torchforge_adapter.to_samples([episode(tokenizer, k) for k in range(4)])
    async with at.TraceSession(project, run="r", max_traces_per_step=2, sampler="top_bottom") as session:
        await session.log_samples(samples, step=0)
        await session.log_samples(samples[:1], step=0, split="eval")
    traces = read_traces(project, "r")
    assert sorted(t["key"] for t in traces) == ["eval/traces", "train/traces", "train/traces"]
    for trace in traces:
        assert trace["metadata"]["reward_breakdown"]["ThinkingReward"] == 0.2
