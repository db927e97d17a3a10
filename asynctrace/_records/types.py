"""What a caller logs (`Sample`), what sinks receive (`TraceRecord`) and the scalar metrics that
travel beside them (`MetricsItem`)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from .tokens import decode_token_fields

__all__ = ["MetricsItem", "Sample", "SampleLike", "TraceRecord", "finite_or_none", "records_for"]


@dataclass(slots=True)
class Sample:
    """One rollout sample: chat messages plus JSON-able metadata; the unit capped, queued and written.

    `tokens` optionally holds per-token arrays (``token_ids``, ``loss_mask``, ``logprobs``,
    ``advantages``: 1-D tensors, arrays or lists), kept compactly encoded in the payload.
    """

    messages: list[dict[str, Any]]
    metadata: dict[str, Any] = field(default_factory=dict)
    spans: list[dict[str, Any]] | None = None
    score: float | None = None
    tokens: dict[str, Any] | None = None

    def ranking_score(self) -> float | None:
        """The key samplers rank by: `score`, else `metadata["reward"]`; None when missing or not finite."""
        return finite_or_none(self.score if self.score is not None else self.metadata.get("reward"))


SampleLike = Sample | Mapping[str, Any]


class TraceRecord:
    """An accepted sample as sinks see it: a stable id, where it belongs, and its encoded form.

    The sample is kept only as the JSON encoded at submission (`payload`), so what the
    byte bound counts is what is held; `sample` decodes it on access. `replayed` is True for a
    record delivered again from a spool after a restart: a sink that can tell which records it
    already holds (as `TrackioSink` does) skips those.
    """

    __slots__ = (
        "id",
        "key",
        "payload",
        "replayed",
        "score",
        "sinks_done",
        "split",
        "spool_slot",
        "step",
        "timestamp",
        "watched",
    )

    def __init__(
        self,
        id: str,
        step: int,
        split: str,
        key: str,
        payload: bytes,
        timestamp: float,
        score: float | None = None,
        replayed: bool = False,
    ) -> None:
        self.id = id
        self.step = step
        self.split = split
        self.key = key
        self.payload = payload
        self.timestamp = timestamp
        self.score = score
        self.replayed = replayed
        # The spool's bookkeeping: where it holds this record, None when it does not (see
        # _durable/spool.py). `records_for` sets the same slots without this call; keep the two alike.
        self.spool_slot: int | None = None
        # On the watch list: past the session's cap and every `Selected` sink's selection.
        self.watched = False
        # A replayed record: the sinks (by session name) that had it before the kill, which it
        # is not sent to again; None when none had.
        self.sinks_done: frozenset[str] | None = None

    @property
    def sample(self) -> Sample:
        """The sample, decoded from its encoded form."""
        data = orjson.loads(self.payload)
        return Sample(
            messages=data["messages"],
            metadata=data.get("metadata", {}),
            spans=data.get("spans"),
            score=data.get("score"),
            tokens=decode_token_fields(data["tokens"]) if "tokens" in data else None,
        )

    @property
    def nbytes(self) -> int:
        """Encoded size of the sample: what the byte bound counts."""
        return len(self.payload)

    def to_json(self) -> bytes:
        """One JSON object holding the record's fields and its sample, without re-encoding the sample."""
        head = orjson.dumps(
            {
                "id": self.id,
                "step": self.step,
                "split": self.split,
                "key": self.key,
                "timestamp": self.timestamp,
            }
        )
        return head[:-1] + b',"sample":' + self.payload + b"}"

    def __repr__(self) -> str:
        return (
            f"TraceRecord(id={self.id!r}, step={self.step}, split={self.split!r}, "
            f"key={self.key!r}, nbytes={len(self.payload)})"
        )


def records_for(
    encoded: Sequence[tuple[bytes, float | None]],
    ids: Iterator[int],
    prefix: str,
    step: int,
    split: str,
    key: str,
    timestamp: float,
) -> list[TraceRecord]:
    """The records of one call's encoded samples, ids `{prefix}-{next(ids)}`.

    Equivalent to calling `TraceRecord(...)` for each, without a Python-level `__init__` call
    per record: on the caller's path, after a training step, that call is a measurable part of
    the cost (docs/performance.md).
    """
    new = object.__new__
    out = []
    for payload, score in encoded:
        r = new(TraceRecord)
        r.id = f"{prefix}-{next(ids)}"
        r.step = step
        r.split = split
        r.key = key
        r.payload = payload
        r.timestamp = timestamp
        r.score = score
        r.replayed = False
        r.spool_slot = None
        r.watched = False
        r.sinks_done = None
        out.append(r)
    return out


def finite_or_none(value: Any) -> float | None:
    """`value` as a finite float; None for None, a bool, or anything no finite float holds."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except Exception:
        # OverflowError (an int beyond a float, 10**400), or whatever a caller's __float__
        # raises (a tensor of several elements): no finite number to rank by.
        return None
    return number if math.isfinite(number) else None


@dataclass(slots=True)
class MetricsItem:
    """Scalar metrics of one step, queued in order with the records.

    `nbytes`: the buffer room it holds until every sink that takes it is done with it
    (`log_metrics`'s own metrics; 0 for the session's health and group metrics, which a timer
    or the steps pace); `lanes`: the sinks (by index) that take it, None for every sink;
    `lanes_left`: those still to handle it."""

    step: int
    metrics: Mapping[str, float]
    nbytes: int = 0
    lanes: frozenset[int] | None = None
    lanes_left: int = 0
