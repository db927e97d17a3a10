"""torchforge: `Episode`s (with their `Completion`) to samples, and `log_group`, the hook for a group.

The hook goes in `continuous_rollouts` of apps/grpo/main.py; what maps to what:
docs/frameworks/torchforge.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .._records.types import Sample
from ._common import Message, SampleBuilder, field, jsonable, role_name, token_list
from ._hooks import deliver, every_row
from ._requires import Framework, Need, gaps, refuse
from ._sessions import session_for

if TYPE_CHECKING:
    from .._session import TraceSession
    from .._sync import SyncTraceSession

__all__ = ["log_group", "to_samples"]

_WHERE = "torchforge_adapter.to_samples"
_FRAMEWORK = Framework("torchforge", "commit 6e77f0b37596")
# What `log_group` reads of the GRPO app's `Episode` in every version tested (the newer app's
# `completion`, or the earlier one's `request` and `response`, are read where present).
_EPISODE_NEEDS = (Need("episode_id"), Need("reward"), Need("advantage"))


def log_group(
    session: TraceSession | SyncTraceSession | str,
    episodes: Any,
    *,
    step: int | None = None,
    tokenizer: Any = None,
    split: str = "train",
) -> int:
    """Log the episodes of one GRPO group (one prompt); never raises. Returns the samples accepted.

    `step` defaults to the newest policy version that generated the group. Each sample gets
    `group_uid` (the first episode's id) and its `sample_index` within the group. A group that
    cannot be converted is counted in `session.stats().dropped["invalid"]`, with one warning.
    `session` is an open session, or a project name: the first call then opens the process's
    session for it (`TraceSession(project, on_full="drop_newest").start()`, finished at exit).
    """
    where = "torchforge_adapter.log_group"
    # The rollout loop is a coroutine on torchforge's event loop: a full buffer drops, never waits.
    target = session_for(session, on_full="drop_newest", where=where)
    if target is None:
        return 0
    try:
        items = _as_list(episodes, strict=False)
        version = _newest_version(items) if step is None else step
    except Exception:  # an unreadable argument: the conversion below reports and counts it
        items, version = [episodes], 0 if step is None else step

    first = items[0] if items else None
    if first is not None and not isinstance(first, (Mapping, str, bytes, list, tuple)):
        # A dict is read by its keys; anything else the conversion refuses with its own message.
        problems = gaps(first, _EPISODE_NEEDS, type(first).__name__)
        if problems:
            return refuse(_FRAMEWORK, where, problems, target, len(items))

    def convert() -> list[Sample]:
        samples = to_samples(items, tokenizer=tokenizer)
        group_uid = field(items[0], "episode_id") if items else None
        for k, sample in enumerate(samples):
            sample.metadata["sample_index"] = k
            if group_uid is not None:
                sample.metadata["group_uid"] = str(group_uid)
        return samples

    return deliver(target, every_row(convert), rows=len(items), step=version, split=split, where=where)


def to_samples(episodes: Any | Iterable[Any], *, tokenizer: Any = None) -> list[Sample]:
    """One sample per episode: the prompt messages and the response.

    The prompt is `completion.prompt.messages` (each `Message`'s `chunks` joined, its `Role` as
    the role); where that has no text, `episode.request` (the episode of older torchforge apps),
    else the decoded `completion.prompt_ids` (or `episode.request_tokens`), one tokenizer call
    for all episodes. The response is `completion.text`, else `episode.response`, else the
    decoded `completion.token_ids` (or `episode.response_tokens`).
    """
    items = _as_list(episodes, strict=True)
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


def _as_list(episodes: Any, *, strict: bool) -> list[Any]:
    if _is_episode(episodes):
        return [episodes]
    if isinstance(episodes, Iterable) and not isinstance(episodes, (str, bytes, Mapping)):
        return list(episodes)
    if strict:
        raise ValueError(f"episodes: expected an Episode or a list of them, got {type(episodes).__name__}")
    # The hook must not raise: the conversion reports it, counted as one invalid row.
    return [episodes]


def _is_episode(value: Any) -> bool:
    return any(field(value, name) is not None for name in ("episode_id", "completion", "request"))


def _newest_version(items: list[Any]) -> int:
    versions = []
    for episode in items:
        try:
            version = _either(field(episode, "completion"), "generator_version", episode, "policy_version")
            versions.append(int(version))
        except (TypeError, ValueError):
            continue
    return max(versions, default=0)


def _either(completion: Any, name: str, episode: Any, older: str) -> Any:
    """`completion.<name>`, else `episode.<older>`: where older torchforge apps kept it."""
    value = field(completion, name)
    return field(episode, older) if value is None else value


def _prompt(episode: Any, completion: Any, builder: SampleBuilder) -> list[Message]:
    prompt = field(completion, "prompt")
    structured = prompt if isinstance(prompt, (list, tuple)) else field(prompt, "messages")
    if isinstance(structured, (list, tuple)):
        out: list[Message] = [_message(message) for message in structured]
        if any(m["content"] for m in out if isinstance(m, dict)):
            return out
    for text in (field(episode, "request"), prompt):
        if isinstance(text, str):
            return [{"role": "user", "content": text}]
    ids = _either(completion, "prompt_ids", episode, "request_tokens")
    if ids is not None:
        return [("user", builder.texts.add(token_list(ids), shared=True))]
    return []


def _message(message: Any) -> dict[str, Any]:
    """A torchforge `Message(chunks, role)` (or a chat dict) as a chat message."""
    chunks = field(message, "chunks")
    if isinstance(chunks, str):
        content: Any = chunks
    elif chunks is not None:
        content = "".join(str(chunk) for chunk in chunks)
    else:
        content = field(message, "content")
    return {"role": role_name(field(message, "role", "user")), "content": jsonable(content)}


def _response(episode: Any, completion: Any, builder: SampleBuilder) -> Message:
    for text in (field(completion, "text"), field(episode, "response")):
        if isinstance(text, str):
            return {"role": "assistant", "content": text}
    ids = _either(completion, "token_ids", episode, "response_tokens")
    if ids is None:
        return {"role": "assistant", "content": ""}
    return ("assistant", builder.texts.add(token_list(ids)))


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
    for ids, fallback, name in (
        ("prompt_ids", "request_tokens", "prompt_len"),
        ("token_ids", "response_tokens", "response_len"),
    ):
        tokens = _either(completion, ids, episode, fallback)
        if tokens is not None:
            metadata[name] = len(tokens)
    for key in ("reward", "advantage"):
        value = field(episode, key)
        if value is not None:
            metadata[key] = float(value)
    version = _either(completion, "generator_version", episode, "policy_version")
    if version is not None:
        metadata["policy_version"] = jsonable(version)
    stop = field(completion, "stop_reason")
    if stop is not None:
        metadata["stop_reason"] = str(stop)
    extra = field(completion, "metadata")
    if isinstance(extra, Mapping) and extra:
        metadata["completion_metadata"] = jsonable(dict(extra))
    return metadata
