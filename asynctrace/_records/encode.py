"""How a sample is checked and encoded once: validation, coercion, the score samplers rank by."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import orjson

from .._security import describe, shown
from ..exceptions import RecordError
from .coerce import DUMPS_OPTIONS, coerce
from .groups import GroupKey, GroupKeyError, group_of
from .tokens import encode_token_fields
from .types import Sample, SampleLike, finite_or_none

__all__ = [
    "RESERVED_KEYS",
    "as_list",
    "encode_checked",
    "encode_samples",
    "preview_metadata",
    "preview_score",
    "sample_from",
]

_NO_LIMIT = float("inf")
_dumps = orjson.dumps
_isfinite = math.isfinite
_RESERVED_MAPPING_KEYS = frozenset({"messages", "prompt", "response", "spans", "score", "metadata"})
# The keys of a mapping sample that are not metadata.
RESERVED_KEYS = _RESERVED_MAPPING_KEYS


def _json_ok(value: Any) -> str | None:
    try:
        orjson.dumps(value, default=coerce, option=DUMPS_OPTIONS)
    except TypeError as exc:
        return str(exc)
    return None


def _find_bad_path(value: Any, path: str, depth: int = 0) -> tuple[str, str]:
    """Walk a value that failed to encode and name the first field that cannot be encoded."""
    if depth > 200:
        return path, "nested too deeply"
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                return path, f"key {shown(key)} is a {type(key).__name__}, keys must be str"
            sub = f"{path}.{key}" if path else key
            if _json_ok(item) is not None:
                return _find_bad_path(item, sub, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if _json_ok(item) is not None:
                return _find_bad_path(item, f"{path}[{i}]", depth + 1)
    reason = _json_ok(value) or "cannot be encoded"
    if not isinstance(value, (Mapping, list, tuple, str, int, float)):
        # orjson reports only the type; our coercion knows why (e.g. a tensor's shape).
        try:
            coerce(value)
        except TypeError as exc:
            reason = str(exc)
    return path, reason


def _messages_ok(messages: list[Any]) -> bool:
    # The common case in one tight loop of exact type checks; False sends anything unusual
    # (subclasses included) to the careful path, which accepts or names what is wrong.
    for message in messages:
        if type(message) is not dict or type(message.get("role")) is not str:
            return False
        content = message.get("content")
        if content is not None and type(content) is not str and type(content) is not list:
            return False
    return True


def _check_messages(messages: Any, index: int) -> None:
    if type(messages) is not list or not _messages_ok(messages):
        _check_messages_slowly(messages, index)


def _invalid(index: int, path: str, problem: str) -> RecordError:
    """The error for sample `index`, its message naming the field at `path` (if any) and the problem."""
    return RecordError(
        f"sample {index}: {path}: {problem}" if path else f"sample {index}: {problem}", index=index, path=path
    )


def _check_messages_slowly(messages: Any, index: int) -> None:
    if not isinstance(messages, list):
        raise _invalid(index, "messages", f"expected a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _invalid(index, f"messages[{i}]", f"expected a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str):
            raise _invalid(index, f"messages[{i}].role", f"expected a str, got {type(role).__name__}")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise _invalid(
                index,
                f"messages[{i}].content",
                f"expected a str or a list of parts, got {type(content).__name__}",
            )


def _from_mapping(obj: Mapping[str, Any], index: int) -> dict[str, Any]:
    """Normalise `{"messages": ...}` or `{"prompt": ..., "response": ...}` plus metadata keys."""
    if "messages" in obj:
        both = "prompt" if obj.get("prompt") is not None else "response"
        if obj.get(both) is not None:
            # Either would be dropped (both keys are reserved, so neither is metadata).
            raise _invalid(
                index,
                both,
                "given with 'messages'; give the conversation one way (put other fields in 'metadata')",
            )
        messages = obj["messages"]
    elif "prompt" in obj or "response" in obj:
        prompt = obj.get("prompt")
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list):
            messages = list(prompt)
        elif prompt is None:
            messages = []
        else:
            raise _invalid(
                index, "prompt", f"expected a str or a list of messages, got {type(prompt).__name__}"
            )
        response = obj.get("response")
        if response is not None:
            if not isinstance(response, str):
                raise _invalid(index, "response", f"expected a str, got {type(response).__name__}")
            messages.append({"role": "assistant", "content": response})
    else:
        raise _invalid(
            index,
            "",
            f"a mapping needs 'messages' or 'prompt'/'response' keys (got keys {sorted(map(str, obj))[:8]})",
        )
    metadata = {k: v for k, v in obj.items() if k not in _RESERVED_MAPPING_KEYS}
    extra = obj.get("metadata")
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise _invalid(index, "metadata", f"expected a mapping, got {type(extra).__name__}")
        metadata.update(extra)
    body: dict[str, Any] = {"messages": messages, "metadata": metadata}
    if obj.get("spans") is not None:
        body["spans"] = obj["spans"]
    if obj.get("score") is not None:
        body["score"] = obj["score"]
    return body


def _body(obj: Any, index: int) -> dict[str, Any]:
    if isinstance(obj, Sample):
        body: dict[str, Any] = {"messages": obj.messages, "metadata": obj.metadata}
        if obj.spans is not None:
            body["spans"] = obj.spans
        if obj.score is not None:
            body["score"] = obj.score
        if obj.tokens is not None:
            try:
                body["tokens"] = encode_token_fields(obj.tokens)
            except ValueError as exc:
                raise _invalid(index, "tokens", str(exc)) from None
        if not isinstance(obj.metadata, dict):
            raise _invalid(index, "metadata", f"expected a dict, got {type(obj.metadata).__name__}")
        return body
    if isinstance(obj, Mapping):
        return _from_mapping(obj, index)
    raise _invalid(index, "", f"expected an asynctrace.Sample or a mapping, got {type(obj).__name__}")


def _encode_body(body: dict[str, Any], index: int) -> bytes:
    """The body's JSON; a `RecordError` naming the first field that cannot be encoded."""
    try:
        # orjson's result keeps its growth buffer (16 KiB held for a 2.5 KB sample), and a
        # queued payload lives until written: an exact-size copy keeps the byte bound true to
        # memory.
        return bytes(memoryview(orjson.dumps(body, default=coerce, option=DUMPS_OPTIONS)))
    except TypeError as exc:
        path, reason = _find_bad_path(body, "")
        raise RecordError(f"sample {index}: {path or '<sample>'}: {reason}", index=index, path=path) from exc


def _check_groups(metadata: Mapping[str, Any], group_keys: Sequence[GroupKey], index: int) -> None:
    """Every group key the session's selections read names a group, or none: else a `RecordError`."""
    for key in group_keys:
        try:
            group_of(metadata, key)
        except GroupKeyError as exc:
            raise _invalid(index, exc.path, str(exc)) from None


def _groups_ok(metadata: Mapping[str, Any], group_keys: Sequence[GroupKey]) -> bool:
    try:
        for key in group_keys:
            group_of(metadata, key)
    except GroupKeyError:
        return False
    return True


def _fast_score(value: Any) -> float | None:
    if type(value) is float:
        return value if math.isfinite(value) else None
    return finite_or_none(value)


def encode_sample(
    obj: Any,
    index: int,
    redact: Callable[[Sample], Sample] | None = None,
    group_keys: Sequence[GroupKey] = (),
) -> tuple[bytes, float | None]:
    """Validate and encode one sample once; returns its JSON and its ranking score. Each of
    `group_keys` (those the session's group samplers read) must name a group, or none."""
    if redact is None and type(obj) is dict:
        # The common shape, {"prompt": str, "response": str, **metadata}: the messages are
        # built here, so they need no checking, and the metadata is one C-level dict copy.
        prompt = obj.get("prompt")
        response = obj.get("response")
        if (
            type(prompt) is str
            and (response is None or type(response) is str)
            and "messages" not in obj
            and "metadata" not in obj
            and "spans" not in obj
            and "score" not in obj
        ):
            metadata = dict(obj)
            del metadata["prompt"]
            metadata.pop("response", None)
            messages = [{"role": "user", "content": prompt}]
            if response is not None:
                messages.append({"role": "assistant", "content": response})
            if group_keys:
                _check_groups(metadata, group_keys, index)
            body: dict[str, Any] = {"messages": messages, "metadata": metadata}
            return _encode_body(body, index), _fast_score(metadata.get("reward"))
    if redact is not None:
        sample = obj if isinstance(obj, Sample) else sample_from(obj, index)
        obj = redact(sample)
    body = _body(obj, index)
    _check_messages(body["messages"], index)
    spans = body.get("spans")
    if spans is not None and not (isinstance(spans, list) and all(isinstance(s, dict) for s in spans)):
        raise _invalid(index, "spans", "expected a list of dicts")
    if group_keys:
        _check_groups(body["metadata"], group_keys, index)
    payload = _encode_body(body, index)
    raw_score = body.get("score")
    if raw_score is None:
        raw_score = body["metadata"].get("reward")
    else:
        _check_score(raw_score, index)
    return payload, finite_or_none(raw_score)


def _check_score(value: Any, index: int) -> None:
    """`score` is a number (the contract's `float | None`), whatever the sampler."""
    kind = type(value)
    numpy_bool = kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")
    if not isinstance(value, (str, bytes, bool)) and not numpy_bool:
        try:
            float(value)
            return
        except Exception:  # OverflowError for 10**400, or a caller's __float__ failing
            pass
    raise _invalid(index, "score", f"expected a number a float can hold, or None, got {type(value).__name__}")


def encode_samples(
    items: Sequence[Any],
    *,
    redact: Callable[[Sample], Sample] | None = None,
    skip_invalid: bool = False,
    max_bytes: int | None = None,
    bound: str = "max_queue_bytes",
    score_needed_by: str | None = None,
    skipped: list[int] | None = None,
    group_keys: Sequence[GroupKey] = (),
) -> tuple[list[tuple[bytes, float | None]], int]:
    """Validate and encode a call's samples in the caller; returns (payload, score) pairs and
    how many were invalid.

    An invalid sample raises `RecordError` naming its index and field path, or with
    `skip_invalid` is left out and counted (and its index appended to `skipped`, if given).
    `max_bytes` refuses samples larger than the bound named `bound`; `score_needed_by` names the
    sampler that needs every sample to have a score; `group_keys` the keys the session's group
    samplers read, each of which must name a group (or none).
    """
    out: list[tuple[bytes, float | None]] = []
    invalid = 0
    limit = max_bytes if max_bytes is not None else _NO_LIMIT
    plain = redact is None
    for i, obj in enumerate(items):
        if plain and type(obj) is Sample:
            # The common shape, checked and encoded inline: after a training step this loop
            # runs cold, and every call it saves is time the caller spends (docs/performance.md).
            # The checks are `_messages_ok`'s and `_fast_score`'s, written out;
            # test_fast_paths_agree_with_the_careful_path holds them to the careful path.
            # Anything unusual, or any failure, takes the careful path below, which names it.
            messages = obj.messages
            metadata = obj.metadata
            if (
                type(messages) is list
                and type(metadata) is dict
                and obj.spans is None
                and obj.score is None
                and obj.tokens is None
            ):
                for message in messages:
                    if type(message) is not dict or type(message.get("role")) is not str:
                        break
                    content = message.get("content")
                    if content is not None and type(content) is not str and type(content) is not list:
                        break
                else:
                    try:
                        payload = bytes(
                            memoryview(
                                _dumps({"messages": messages, "metadata": metadata}, coerce, DUMPS_OPTIONS)
                            )
                        )
                    except TypeError:
                        payload = b""
                    score = metadata.get("reward")
                    score = score if type(score) is float and _isfinite(score) else finite_or_none(score)
                    if (
                        payload
                        and len(payload) <= limit
                        and (score is not None or score_needed_by is None)
                        and (not group_keys or _groups_ok(metadata, group_keys))
                    ):
                        out.append((payload, score))
                        continue
        try:
            out.append(encode_checked(obj, i, redact, max_bytes, bound, score_needed_by, group_keys))
        except RecordError:
            if not skip_invalid:
                raise
            invalid += 1
            if skipped is not None:
                skipped.append(i)
    return out, invalid


def encode_checked(
    obj: Any,
    index: int,
    redact: Callable[[Sample], Sample] | None,
    max_bytes: int | None,
    bound: str = "max_queue_bytes",
    score_needed_by: str | None = None,
    group_keys: Sequence[GroupKey] = (),
) -> tuple[bytes, float | None]:
    """`encode_sample` plus the session's checks (size bound, score, groups); every failure is a
    `RecordError`."""
    try:
        payload, score = encode_sample(obj, index, redact, group_keys)
    except RecordError:
        raise
    except Exception as exc:  # a redact callable or an odd mapping failed
        raise _invalid(index, "", describe(exc)) from exc
    if max_bytes is not None and len(payload) > max_bytes:
        raise _invalid(index, "", f"encodes to {len(payload)} bytes, more than {bound}={max_bytes}")
    if score is None and score_needed_by is not None:
        raise missing_score(index, score_needed_by)
    return payload, score


def missing_score(index: int, sampler: str) -> RecordError:
    return _invalid(
        index, "score", f"the {sampler} ranks by score; give a finite `score` or metadata['reward']"
    )


class _Unknown:
    pass


UNKNOWN: Any = _Unknown()


def preview_score(obj: Any) -> Any:
    """The ranking score `encode_sample` will find, read without encoding anything; `UNKNOWN`
    for a shape whose score only the full path can tell."""
    if type(obj) is Sample:
        raw = obj.score
        if raw is None:
            metadata = obj.metadata
            if type(metadata) is not dict:
                return UNKNOWN
            raw = metadata.get("reward")
        return _fast_score(raw)
    if type(obj) is dict:
        raw = obj.get("score")
        if raw is None:
            extra = obj.get("metadata")
            if extra is None:
                raw = obj.get("reward")
            elif type(extra) is dict:
                raw = extra["reward"] if "reward" in extra else obj.get("reward")
            else:
                return UNKNOWN
        return _fast_score(raw)
    return UNKNOWN


def preview_metadata(obj: Any) -> Mapping[str, Any] | None:
    """A sample's metadata as encoding will find it, without encoding anything (None for a
    sample encoding will refuse); the group of a sample is read from it before encoding."""
    if type(obj) is Sample:
        return obj.metadata
    if type(obj) is dict:
        extra = obj.get("metadata")
        meta = {k: v for k, v in obj.items() if k not in _RESERVED_MAPPING_KEYS}
        if isinstance(extra, Mapping):
            meta.update(extra)
        return meta
    try:
        return sample_from(obj).metadata
    except Exception:  # an invalid sample: encoding reports it
        return None


def sample_from(obj: SampleLike, index: int = 0) -> Sample:
    """Normalise a mapping to a `Sample` (a `Sample` is returned as is)."""
    if isinstance(obj, Sample):
        return obj
    body = _body(obj, index)
    return Sample(
        messages=body["messages"],
        metadata=body["metadata"],
        spans=body.get("spans"),
        score=body.get("score"),
        tokens=body.get("tokens"),
    )


def as_list(samples: SampleLike | Iterable[SampleLike]) -> Sequence[Any]:
    """Accept one sample or many; normalised to a list once, at the boundary."""
    if isinstance(samples, (Sample, Mapping)):
        return [samples]
    if isinstance(samples, (list, tuple)):
        return samples
    if not isinstance(samples, (str, bytes)):
        try:
            items = iter(samples)
        except TypeError:
            pass
        else:
            # Outside the try: an error raised by the caller's own generator is theirs, unchanged.
            return list(items)
    raise RecordError(
        f"samples: expected a Sample, a mapping or a list of them, got {type(samples).__name__}",
        index=None,
        path="",
    )
