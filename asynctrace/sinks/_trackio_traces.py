"""What a record becomes in Trackio: a trace whose metadata and spans carry what the Traces tab
shows (docs/sinks/trackio.md, "What the dashboard shows")."""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from typing import Any

import orjson

from ._trackio_spans import dashboard_spans

__all__ = ["dashboard_metadata", "iso_time", "trace_of"]

TRACE_TYPE = "trackio.trace"

# Stop reasons as frameworks and inference engines name them (vLLM, SGLang, OpenAI, Anthropic),
# and the status the Traces tab shows for each; any other reason is shown as it is.
_STATUS_OF_STOP_REASON = {
    "stop": "success",
    "eos": "success",
    "end_turn": "success",
    "stop_sequence": "success",
    "length": "truncated",
    "max_tokens": "truncated",
    "truncated": "truncated",
    "abort": "aborted",
    "aborted": "aborted",
    "cancelled": "aborted",
    "error": "error",
    "failed": "error",
}
_STOP_REASON_KEYS = ("stop_reason", "finish_reason")
# A generation time in seconds, or in milliseconds, as samples may carry it.
_SECONDS_KEYS = ("generation_time", "generation_time_s")
_MILLISECONDS_KEYS = ("generation_ms",)
_MAX_STATUS_CHARS = 40


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None


def dashboard_metadata(record_id: str, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """`metadata` with what Trackio's Traces tab reads added: the record id, a status from the
    stop reason, a duration from the generation time. A status or duration the sample sets itself
    is kept. `asynctrace_id` is always the record id (the sink finds its traces by it); a sample's
    own, other value is kept as `asynctrace_id_logged`."""
    out = dict(metadata)
    own = out.get("asynctrace_id", record_id)
    if own != record_id:
        out.setdefault("asynctrace_id_logged", own)
    out["asynctrace_id"] = record_id
    if "status" not in out:
        for key in _STOP_REASON_KEYS:
            reason = out.get(key)
            if isinstance(reason, str) and reason:
                status = _STATUS_OF_STOP_REASON.get(reason.lower(), reason)
                out["status"] = status[:_MAX_STATUS_CHARS]
                break
    if "duration_ms" not in out and "latency_ms" not in out:
        for keys, scale in ((_SECONDS_KEYS, 1000.0), (_MILLISECONDS_KEYS, 1.0)):
            found = next((n for n in (_number(out.get(k)) for k in keys) if n is not None), None)
            if found is not None:
                out["duration_ms"] = round(found * scale, 3)
                break
    return out


def iso_time(seconds: float) -> str:
    """A time as Trackio stores it: ISO 8601 in UTC."""
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat()


def trace_of(record_id: str, payload: bytes) -> dict[str, Any]:
    """The trace an encoded sample becomes, as Trackio stores it (`trackio.Trace`'s fields)."""
    sample = orjson.loads(payload)
    metadata = sample.get("metadata")
    metadata = metadata if isinstance(metadata, dict) else {}
    return {
        "_type": TRACE_TYPE,
        "messages": sample["messages"],
        "metadata": dashboard_metadata(record_id, metadata),
        "spans": dashboard_spans(sample, metadata),
    }
