"""The spans a trace gets in Trackio so that its Traces tab shows the token counts a sample has.

Trackio 0.41-0.43 reads token usage from spans only (`spanUsage` in its frontend's
`lib/traceUtils.js`: a span's `usage.input_tokens` / `prompt_tokens`, `usage.output_tokens` /
`completion_tokens`, `usage.total_tokens`), never from a trace's metadata; and once a trace has
spans it stops deriving tool operations from the messages' `tool_calls` (`traceSpans`). So a
sample without spans of its own gets one `generation` span carrying its counts, followed by the
tool spans Trackio would have derived, built as `messageToolSpans` builds them.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

__all__ = ["dashboard_spans"]

GENERATION_SPAN_ID = "asynctrace-generation"
_TOKEN_ID_BYTES = 4  # token ids are kept as int32 (asynctrace._records.tokens.TOKEN_FIELDS)


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _token_id_count(tokens: Any) -> int | None:
    """How many token ids a sample's encoded `tokens["token_ids"]` holds, if it has them."""
    field = tokens.get("token_ids") if isinstance(tokens, Mapping) else None
    b64 = field.get("b64") if isinstance(field, Mapping) else None
    if not isinstance(b64, str):
        return None
    try:
        return len(base64.b64decode(b64, validate=True)) // _TOKEN_ID_BYTES
    except (binascii.Error, ValueError):
        return None


def _usage(metadata: Mapping[str, Any], tokens: Any) -> dict[str, int] | None:
    """Token usage as Trackio reads it: the prompt and response lengths, else the token ids."""
    prompt, response = _count(metadata.get("prompt_len")), _count(metadata.get("response_len"))
    if prompt is not None or response is not None:
        usage = {"total_tokens": (prompt or 0) + (response or 0)}
        if prompt is not None:
            usage["input_tokens"] = prompt
        if response is not None:
            usage["output_tokens"] = response
        return usage
    total = _token_id_count(tokens)
    return None if total is None else {"total_tokens": total}


def _parsed(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        return value


def _result_status(result: Mapping[str, Any] | None) -> str | None:
    if result is None:
        return None
    status = str(result.get("status") or "").lower()
    if result.get("is_error") is True or result.get("isError") is True or result.get("error"):
        return "error"
    return "error" if status in ("error", "failed") else None


def _message_tool_spans(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The tool operations Trackio derives from `tool_calls` when a trace has no spans."""
    results: dict[str, Mapping[str, Any]] = {}
    for message in messages:
        if isinstance(message, Mapping) and str(message.get("role") or "").lower() == "tool":
            call_id = message.get("tool_call_id") or message.get("toolCallId")
            if call_id:
                results.setdefault(str(call_id), message)
    spans = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            continue
        calls = list(message.get("tool_calls") or message.get("toolCalls") or [])
        if message.get("function_call"):
            calls.append({"function": message["function_call"]})
        for j, call in enumerate(calls):
            call = call if isinstance(call, Mapping) else {}
            fn = call.get("function") or call
            fn = fn if isinstance(fn, Mapping) else {}
            span_id = str(call.get("id") or f"message-tool-{i}-{j}")
            result = results.get(span_id)
            arguments = fn.get("arguments", call.get("arguments"))
            spans.append(
                {
                    "id": span_id,
                    "parent_id": None,
                    "name": fn.get("name") or call.get("name") or "tool",
                    "kind": "tool",
                    "input": _parsed(arguments),
                    "output": _parsed(result.get("content") if result is not None else None),
                    "status": _result_status(result),
                    "derived_from_messages": True,
                }
            )
    return spans


def dashboard_spans(sample: Mapping[str, Any], metadata: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The spans a trace is logged with: the sample's own, else a generation span with its token
    counts (when it has any) and the tool spans Trackio would derive from its messages."""
    spans = sample.get("spans")
    if spans:
        return list(spans)
    usage = _usage(metadata, sample.get("tokens"))
    if usage is None:
        return []
    messages = sample.get("messages")
    tools = _message_tool_spans(messages) if isinstance(messages, list) else []
    return [{"id": GENERATION_SPAN_ID, "name": "generation", "kind": "generation", "usage": usage}, *tools]
