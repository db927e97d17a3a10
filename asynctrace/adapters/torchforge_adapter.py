"""torchforge: `Episode`s (with their `Completion`) to samples.

    samples = torchforge_adapter.to_samples(episodes, tokenizer=tokenizer)
    await session.log_samples(samples, step=policy_version)

`reward_breakdown` stays a nested mapping (never flattened into the metadata), and
`policy_version` comes from `completion.generator_version`. A single episode is accepted too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .._record import Sample
from ._common import Message, SampleBuilder, field, jsonable, role_name, token_list

__all__ = ["to_samples"]

_WHERE = "torchforge_adapter.to_samples"


def to_samples(episodes: Any | Iterable[Any], *, tokenizer: Any = None) -> list[Sample]:
    """One sample per episode: the prompt (chat messages when the completion has them), the response.

    Text is taken from `completion.prompt` messages, else `episode.request` / `completion.prompt`
    strings, else decoded from `completion.prompt_ids` (one tokenizer call for all episodes);
    the response from `episode.response`, else `completion.text`, else `completion.token_ids`.
    Tool calls of the completion are kept on the assistant message.
    """
    if _is_episode(episodes):
        items = [episodes]
    elif isinstance(episodes, Iterable) and not isinstance(episodes, (str, bytes, Mapping)):
        items = list(episodes)
    else:
        raise ValueError(f"episodes: expected an Episode or a list of them, got {type(episodes).__name__}")
    builder = SampleBuilder()
    for k, episode in enumerate(items):
        if not _is_episode(episode):
            # A GRPO group (a list of episodes) or any other object would read as an empty sample.
            raise ValueError(
                f"episodes[{k}]: expected an Episode (with episode_id, completion or request), "
                f"got {type(episode).__name__}"
            )
        completion = field(episode, "completion")
        messages = _prompt(episode, completion, builder)
        messages.append(_response(episode, completion, builder))
        builder.add(messages, _metadata(episode, completion))
    return builder.build(tokenizer, _WHERE)


def _is_episode(value: Any) -> bool:
    return any(field(value, name) is not None for name in ("episode_id", "completion", "request"))


def _prompt(episode: Any, completion: Any, builder: SampleBuilder) -> list[Message]:
    prompt = field(completion, "prompt")
    structured = field(prompt, "messages") if not isinstance(prompt, (str, list)) else prompt
    if isinstance(structured, (list, tuple)) and structured:
        out: list[Message] = []
        for message in structured:
            content = field(message, "content", field(message, "context"))
            out.append({"role": role_name(field(message, "role", "user")), "content": jsonable(content)})
        return out
    for text in (field(episode, "request"), prompt):
        if isinstance(text, str):
            return [{"role": "user", "content": text}]
    ids = field(completion, "prompt_ids")
    if ids is not None:
        return [("user", builder.texts.add(token_list(ids), shared=True))]
    return []


def _response(episode: Any, completion: Any, builder: SampleBuilder) -> Message:
    text = field(episode, "response")
    if not isinstance(text, str):
        text = field(completion, "text")
    tool_calls = field(completion, "tool_calls") or []
    if tool_calls:
        content = field(completion, "content")
        return {
            "role": "assistant",
            "content": content if isinstance(content, str) else text,
            "tool_calls": [_tool_call(call) for call in tool_calls],
        }
    if isinstance(text, str):
        return {"role": "assistant", "content": text}
    ids = field(completion, "token_ids")
    if ids is None:
        return {"role": "assistant", "content": ""}
    return ("assistant", builder.texts.add(token_list(ids)))


def _tool_call(call: Any) -> dict[str, Any]:
    """An OpenAI-style tool call from vLLM's `ToolCall` (or a dict of the same shape)."""
    function = field(call, "function")
    out: dict[str, Any] = {
        "type": str(field(call, "type", "function")),
        "function": {
            "name": str(field(function, "name", "")),
            "arguments": jsonable(field(function, "arguments", "")),
        },
    }
    call_id = field(call, "id")
    if call_id is not None:
        out["id"] = str(call_id)
    return out


def _metadata(episode: Any, completion: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for key in ("episode_id", "target"):
        value = field(episode, key)
        if value is not None:
            metadata[key] = jsonable(value)
    # torchforge's apps set Episode.request_len / response_len to the padding budgets
    # (max_req_tokens, max_res_tokens), not to this sample's lengths: kept under names that say
    # so, while prompt_len / response_len are the token counts, as the other adapters give them.
    for key, name in (("request_len", "max_request_len"), ("response_len", "max_response_len")):
        value = field(episode, key)
        if value is not None:
            metadata[name] = jsonable(value)
    for ids, name in (("prompt_ids", "prompt_len"), ("token_ids", "response_len")):
        tokens = field(completion, ids)
        if tokens is not None:
            metadata[name] = len(tokens)
    for key in ("reward", "advantage"):
        value = field(episode, key)
        if value is not None:
            metadata[key] = float(value)
    breakdown = field(episode, "reward_breakdown")
    if isinstance(breakdown, Mapping):
        # Kept nested: flattening would let a reward function named like a metadata key clobber it.
        metadata["reward_breakdown"] = {str(k): jsonable(v) for k, v in breakdown.items()}
    version = field(completion, "generator_version")
    if version is None:
        version = field(episode, "policy_version")
    if version is not None:
        metadata["policy_version"] = jsonable(version)
    stop = field(completion, "stop_reason")
    if stop is not None:
        metadata["stop_reason"] = str(stop)
    extra = field(completion, "metadata")
    if isinstance(extra, Mapping) and extra:
        metadata["completion_metadata"] = jsonable(dict(extra))
    return metadata
