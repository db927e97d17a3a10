"""open-instruct: a `Batch` and its `GenerationResult` to samples.

    samples = open_instruct_adapter.to_samples(batch, result, tokenizer=tokenizer, advantages=advantages)
    await session.log_samples(samples, step=training_step)

Raw text is preferred (`raw_queries`, `decoded_responses`); token ids are decoded otherwise,
all in one tokenizer call. When `masks` show tool output inside a response (0-runs) and a
tokenizer is given, the response is split into assistant and tool turns. Every optional
per-sample list may be shorter than `queries`: the field is left out where it falls short,
with one warning, and training never crashes over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._record import Sample
from ..rollouts._align import MISSING, Shortfall
from ..rollouts._mapping import prompt_indices
from ..rollouts._turns import mask_runs, split_turns
from ._common import Message, SampleBuilder, as_sequence, field, jsonable, token_list

__all__ = ["to_samples"]

_WHERE = "open_instruct_adapter.to_samples"

# Per-sample lists of `GenerationResult.request_info`, kept under their own names.
_REQUEST_INFO = ("num_calls", "timeouts", "tool_errors", "tool_outputs", "tool_runtimes", "tool_calleds")


def to_samples(
    batch: Any,
    result: Any,
    *,
    tokenizer: Any = None,
    advantages: Sequence[float] | None = None,
    env_role: str = "tool",
) -> list[Sample]:
    """One sample per response of `result`, with its prompt from `batch`.

    `batch.queries` may hold one entry per response (open-instruct repeats each prompt per
    sample) or one per prompt, with the responses in blocks. Metadata: reward
    (`reward_scores`, else `batch.scores`), advantage, stop_reason, dataset, dataset_index,
    prompt_index, sample_index, model_step, ground_truth, active_tools and the request-info
    tool fields.
    """
    queries = as_sequence(field(batch, "queries"), "batch.queries")
    responses = as_sequence(field(result, "responses"), "result.responses")
    n = len(responses)
    if n and (not queries or n % len(queries)):
        # Checked here: the generic mapping error would point at arguments this function lacks.
        raise ValueError(
            f"result.responses: {n} responses do not map onto {len(queries)} batch.queries "
            "(give one query per response, or the same number of responses for every query)"
        )
    prompt_of = prompt_indices(n_prompts=len(queries), n_samples=n) if n else []
    short = Shortfall(_WHERE, n)
    raw_queries = field(batch, "raw_queries")
    decoded = field(batch, "decoded_responses")
    masks = field(result, "masks")
    request_info = field(result, "request_info")
    reward_scores = field(result, "reward_scores")
    scores = field(batch, "scores")
    model_steps = field(batch, "model_steps")
    model_step = field(result, "model_step")

    builder = SampleBuilder()
    for i in range(n):
        p = prompt_of[i]
        # Batch lists are aligned with `queries`; result lists with the responses.
        messages: list[Message] = []
        prompt = short.pick(raw_queries, p, "raw_queries")
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages.append(("user", builder.texts.add(token_list(queries[p]), shared=True)))
        messages += _response_turns(
            short.pick(decoded, i, "decoded_responses"),
            responses[i],
            short.pick(masks, i, "masks"),
            tokenizer is not None,
            env_role,
            builder,
        )

        metadata: dict[str, Any] = {"sample_index": i, "prompt_index": p}
        reward = short.pick(reward_scores, i, "reward_scores")
        if reward is MISSING or reward is None:
            reward = short.pick(scores, i, "scores")
        if reward is not MISSING and reward is not None:
            metadata["reward"] = float(reward)
        step = short.pick(model_steps, i, "model_steps")
        if step is MISSING or step is None:
            step = model_step
        if step is not MISSING and step is not None:
            metadata["model_step"] = int(step)
        for key, name, column, index in (
            ("advantage", "advantages", advantages, i),
            ("stop_reason", "finish_reasons", field(result, "finish_reasons"), i),
            ("dataset", "datasets", field(batch, "datasets"), p),
            ("dataset_index", "indices", field(batch, "indices"), p),
            ("ground_truth", "ground_truths", field(batch, "ground_truths"), p),
            ("active_tools", "active_tools", field(batch, "active_tools"), p),
            *((name, name, field(request_info, name), i) for name in _REQUEST_INFO),
        ):
            value = short.pick(column, index, name)
            if value is not MISSING and value is not None:
                metadata[key] = jsonable(value)
        builder.add(messages, metadata)
    short.warn()
    return builder.build(tokenizer, _WHERE)


def _response_turns(
    text: Any, tokens: Any, mask: Any, can_decode: bool, env_role: str, builder: SampleBuilder
) -> list[Message]:
    """The response as one assistant message, or as assistant and tool turns when masks show tools."""
    ids = token_list(tokens)
    runs = mask_runs(mask) if mask is not MISSING and mask is not None else None
    if runs is not None and len(mask) != len(ids):
        raise ValueError(f"result.masks: a row has {len(mask)} values for {len(ids)} response tokens")
    has_tools = runs is not None and any(not generated for _, _, generated in runs)
    if isinstance(text, str) and not (has_tools and can_decode):
        return [{"role": "assistant", "content": text}]
    if not ids:
        # An empty response is still the policy's answer: it gets its (empty) turn, as with text.
        return [{"role": "assistant", "content": ""}]
    turns = split_turns(ids, runs if has_tools else None, 0, env_role, builder.texts)
    return list(turns.turns)
