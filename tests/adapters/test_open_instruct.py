from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

import asynctrace as at
from asynctrace.adapters import open_instruct_adapter
from tests._util import read_traces
from tests.rollouts._helpers import encode

# Mirrors of open-instruct's types (open_instruct/model_utils.py, data_types.py), same field names.


@dataclass
class Batch:
    queries: list[list[int]]
    ground_truths: list[Any]
    datasets: list[str]
    raw_queries: list[str] | None = None
    decoded_responses: list[str] | None = None
    indices: list[int] | None = None
    scores: list[float] | None = None
    active_tools: list[list[str] | None] | None = None
    model_steps: list[int] = field(default_factory=list)


@dataclass
class RequestInfo:
    num_calls: list[int]
    timeouts: list[int]
    tool_errors: list[str]
    tool_outputs: list[str]
    tool_runtimes: list[float]
    tool_calleds: list[bool]


@dataclass
class GenerationResult:
    responses: list[list[int]]
    finish_reasons: list[str]
    masks: list[list[int]]
    request_info: RequestInfo
    logprobs: list[list[float]] | None = None
    reward_scores: list[float] | None = None
    model_step: int | None = None


QUESTIONS = ["What is 6 * 7?", "Spell 'cat' backwards."]
ANSWERS = [
    [("assistant", "42")],
    [("assistant", "6 * 7 is 42.")],
    [("assistant", "tac")],
    [("assistant", "t-a-c")],
]


def make(
    tokenizer: Any, *, with_text: bool = True, answers: list[Any] | None = None
) -> tuple[Batch, GenerationResult]:
    """Two prompts, two responses each, repeated per sample as open-instruct does."""
    answers = answers or ANSWERS
    encoded = [encode(tokenizer, turns) for turns in answers]
    questions = [QUESTIONS[i // 2] for i in range(4)]
    batch = Batch(
        queries=[encode(tokenizer, [("user", q)])[0] for q in questions],
        ground_truths=["42", "42", "tac", "tac"],
        datasets=["math", "math", "words", "words"],
        raw_queries=questions if with_text else None,
        decoded_responses=["".join(t for _, t in turns) for turns in answers] if with_text else None,
        indices=[10, 10, 11, 11],
        scores=[1.0, 1.0, 1.0, 0.0],
        active_tools=[["python"], ["python"], None, None],
        model_steps=[5, 5, 5, 5],
    )
    result = GenerationResult(
        responses=[ids for ids, _ in encoded],
        finish_reasons=["stop"] * 4,
        masks=[mask for _, mask in encoded],
        request_info=RequestInfo(
            num_calls=[0] * 4,
            timeouts=[0] * 4,
            tool_errors=[""] * 4,
            tool_outputs=[""] * 4,
            tool_runtimes=[0.0] * 4,
            tool_calleds=[False] * 4,
        ),
        reward_scores=[1.0, 0.5, 1.0, 0.0],
    )
    return batch, result


def test_raw_text_is_used_when_present(tokenizer: Any) -> None:
    """With raw_queries and decoded_responses, no tokenizer is needed."""
    batch, result = make(tokenizer)
    samples = open_instruct_adapter.to_samples(batch, result, advantages=[0.5, -0.5, 1.0, -1.0])
    assert samples[1].messages == [
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": "6 * 7 is 42."},
    ]
    meta = samples[3].metadata
    assert meta["reward"] == 0.0 and meta["advantage"] == -1.0
    assert meta["dataset"] == "words" and meta["dataset_index"] == 11 and meta["ground_truth"] == "tac"
    assert meta["model_step"] == 5 and meta["stop_reason"] == "stop"
    assert meta["num_calls"] == 0 and meta["tool_calleds"] is False
    assert [s.metadata["prompt_index"] for s in samples] == [0, 1, 2, 3]


def test_tokens_are_decoded_when_there_is_no_text(tokenizer: Any) -> None:
    """Without raw text, queries and responses are decoded, reproducing the original text."""
    batch, result = make(tokenizer, with_text=False)
    samples = open_instruct_adapter.to_samples(batch, result, tokenizer=tokenizer)
    assert samples[2].messages == [
        {"role": "user", "content": QUESTIONS[1]},
        {"role": "assistant", "content": "tac"},
    ]
    with pytest.raises(ValueError, match="tokenizer"):
        open_instruct_adapter.to_samples(batch, result)


def test_tool_turns_are_split_from_the_masks(tokenizer: Any) -> None:
    """Masks with tool output (0-runs) split the response into assistant and tool turns."""
    turns = [
        ("assistant", "<code>print(6*7)</code>"),
        ("tool", "<output>42</output>"),
        ("assistant", "So 42."),
    ]
    batch, result = make(tokenizer, answers=[turns] * 4)
    result.request_info.num_calls = [1] * 4
    result.request_info.tool_outputs = ["42"] * 4
    result.request_info.tool_calleds = [True] * 4
    samples = open_instruct_adapter.to_samples(batch, result, tokenizer=tokenizer)
    assert samples[0].messages == [
        {"role": "user", "content": QUESTIONS[0]},
        *({"role": r, "content": t} for r, t in turns),
    ]
    assert samples[0].metadata["tool_outputs"] == "42" and samples[0].metadata["num_calls"] == 1
    # Without a tokenizer the decoded text stands as one assistant message.
    plain = open_instruct_adapter.to_samples(batch, result)
    assert plain[0].messages[-1] == {"role": "assistant", "content": "".join(t for _, t in turns)}


def test_queries_per_prompt_map_responses_in_blocks(tokenizer: Any) -> None:
    """With one query per prompt, responses map to prompts in blocks."""
    batch, result = make(tokenizer)
    batch.queries = batch.queries[::2]
    batch.raw_queries = QUESTIONS
    batch.datasets = ["math", "words"]
    batch.indices = [10, 11]
    batch.ground_truths = ["42", "tac"]
    batch.active_tools = None
    samples = open_instruct_adapter.to_samples(batch, result)
    assert [s.metadata["prompt_index"] for s in samples] == [0, 0, 1, 1]
    assert [s.metadata["dataset"] for s in samples] == ["math", "math", "words", "words"]
    assert samples[3].messages[0]["content"] == QUESTIONS[1]


def test_empty_response_keeps_its_assistant_turn(tokenizer: Any) -> None:
    """An empty response decoded from tokens is an empty assistant turn, as it is with text."""
    batch, result = make(tokenizer, with_text=False)
    result.responses[1], result.masks[1] = [], []
    result.finish_reasons[1] = "length"
    samples = open_instruct_adapter.to_samples(batch, result, tokenizer=tokenizer)
    assert samples[1].messages == [
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": ""},
    ]
    assert samples[1].metadata["stop_reason"] == "length"


def test_responses_that_do_not_map_onto_queries_name_the_fields(tokenizer: Any) -> None:
    """Responses that are not whole blocks per query are refused naming responses and queries."""
    batch, result = make(tokenizer)
    result.responses = result.responses[:3]
    with pytest.raises(ValueError, match=r"result\.responses: 3 responses do not map onto 4 batch\.queries"):
        open_instruct_adapter.to_samples(batch, result)
    batch.queries = []
    with pytest.raises(ValueError, match=r"onto 0 batch\.queries"):
        open_instruct_adapter.to_samples(batch, result)


def test_short_optional_lists_never_raise(tokenizer: Any) -> None:
    """Optional lists shorter than queries are left out where they fall short; one warning."""
    batch, result = make(tokenizer)
    batch.indices = [10]
    batch.model_steps = [5, 5]
    batch.raw_queries = QUESTIONS[:1]
    result.reward_scores = [1.0]
    result.request_info.tool_outputs = []
    with pytest.warns(UserWarning) as record:
        samples = open_instruct_adapter.to_samples(batch, result, tokenizer=tokenizer, advantages=[0.1])
    assert len(record) == 1
    assert [s.metadata.get("dataset_index") for s in samples] == [10, None, None, None]
    assert [s.metadata.get("model_step") for s in samples] == [5, 5, None, None]
    # A missing reward score falls back to batch.scores.
    assert [s.metadata["reward"] for s in samples] == [1.0, 1.0, 1.0, 0.0]
    assert [s.metadata.get("advantage") for s in samples] == [0.1, None, None, None]
    assert all("tool_outputs" not in s.metadata for s in samples)
    # A missing raw query is decoded from its tokens instead.
    assert samples[3].messages[0] == {"role": "user", "content": QUESTIONS[1]}


def test_eval_batches_without_training_fields(tokenizer: Any) -> None:
    """Eval batches (no scores, indices, model steps or advantages) still give complete traces."""
    batch, result = make(tokenizer)
    batch.scores = None
    batch.indices = None
    batch.model_steps = []
    result.reward_scores = None
    result.model_step = 12
    samples = open_instruct_adapter.to_samples(batch, result)
    assert all("reward" not in s.metadata and "dataset_index" not in s.metadata for s in samples)
    assert {s.metadata["model_step"] for s in samples} == {12}


@pytest.mark.anyio
async def test_end_to_end_into_trackio(tokenizer: Any, project: str) -> None:
    """Samples from a Batch and GenerationResult land in Trackio, train and eval apart."""
    batch, result = make(tokenizer, with_text=False)
    samples = open_instruct_adapter.to_samples(batch, result, tokenizer=tokenizer)
    async with at.TraceSession(project, run="r", max_traces_per_step=2, sampler="first") as session:
        await session.log_samples(samples, step=1, split="train")
        await session.log_samples(samples[:1], step=1, split="eval")
    traces = read_traces(project, "r")
    assert sorted(t["key"] for t in traces) == ["eval/traces", "train/traces", "train/traces"]
    first = next(t for t in traces if t["key"] == "train/traces")
    assert first["messages"] == [
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": "42"},
    ]
    assert first["metadata"]["dataset"] == "math" and first["metadata"]["reward"] == 1.0
