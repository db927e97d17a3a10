"""The log ids `TrackioSink` gives its entries where it commits them itself, and the record ids
they decode back to (docs/reliability.md, "Idempotency"; the chip they make:
docs/sinks/trackio.md, "What the dashboard shows")."""

from __future__ import annotations

import hashlib
import re

__all__ = ["decode_record_id", "log_id_for", "split_id"]

_COUNTED_ID = re.compile(r"^(.*)-(\d+)$")
# "{tag}-at-{first record id}"; "at-{first record id}" as written before the tag.
_LOG_ID = re.compile(r"^(?:[0-9a-f]{7}-)?at-(.+)$", re.DOTALL)
_TAG_SPACE = 16**7


def split_id(record_id: str) -> tuple[str, int] | None:
    """A record id `{prefix}-{n}` as (prefix, n); None for any other id."""
    m = _COUNTED_ID.match(record_id)
    return (m.group(1), int(m.group(2))) if m else None


def _digest(text: str) -> int:
    return int(hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:7], 16)


def _tag(record_id: str) -> str:
    """Seven hex digits that lead the log id of the entry starting at `record_id`.

    For `{prefix}-{n}`, the prefix's digest plus n: entries of one session start at distinct n, so
    their tags differ (for fewer than 16**7 records), and sessions appending to one run start at
    unrelated offsets. Other ids get their own digest.
    """
    parts = split_id(record_id)
    value = _digest(record_id) if parts is None else _digest(parts[0]) + parts[1]
    return f"{value % _TAG_SPACE:07x}"


def log_id_for(first_record_id: str) -> str:
    """The log id of the entry whose first trace is the record `first_record_id`."""
    return f"{_tag(first_record_id)}-at-{first_record_id}"


def decode_record_id(log_id: object, index: object) -> str | None:
    """The record id of the trace at `index` of the log entry `log_id`; None when not ours
    (read back from the database, either may be of any type SQLite stores)."""
    if type(index) is not int and index is not None:
        return None
    m = _LOG_ID.match(log_id) if isinstance(log_id, str) and log_id else None
    if m is None:
        return None
    first = m.group(1)
    if not index:
        return first
    parts = split_id(first)
    return None if parts is None else f"{parts[0]}-{parts[1] + index}"
