"""The parts a session's samples go through, built from its settings: group metrics, the cap and
sampler, the spool, the bounded buffer, and the encoder in front of them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from .._durable.journal import Journal
from .._durable.spool import Spool
from .._select.base import Sampler
from .._select.gate import Gate
from .buffer import Buffer
from .encoder import Encoder
from .group_metrics import GroupMetrics

__all__ = ["build_engine"]


def build_engine(
    s: dict[str, Any], push: Callable[[Sequence[Any]], None]
) -> tuple[Buffer, Encoder, Spool | None, GroupMetrics | None]:
    """The session's buffer, encoder, spool (None without a spool_dir) and group metrics, from its
    checked `TraceSession` arguments `s` (`run` and `sampler` resolved, `sink_names` added)."""
    sampler: Sampler = s["sampler"]
    k, max_open_steps, step_timeout = s["max_traces_per_step"], s["max_open_steps"], s["step_timeout"]
    groups = (
        GroupMetrics(s["group_key"], max_open_steps=max_open_steps, step_timeout=step_timeout)
        if s["group_key"] is not None
        else None
    )
    gate = None
    if k is not None:
        gate = Gate(k, sampler, max_open_steps=max_open_steps, step_timeout=step_timeout)
    id_prefix = uuid.uuid4().hex[:12]
    spool = (
        Spool(
            s["spool_dir"], project=s["project"], run=s["run"], session=id_prefix, durability=s["durability"]
        )
        if s["spool_dir"] is not None
        else None
    )
    buffer = Buffer(
        queue_size=s["queue_size"],
        max_bytes=s["max_queue_bytes"],
        on_full=s["on_full"],
        batch_size=s["batch_size"],
        gate=gate,
        sink_names=s["sink_names"],
        clock=time.monotonic,
        journal=Journal(spool, on_admit=s["durability"] == "enqueue") if spool is not None else None,
    )
    encoder = Encoder(
        trace_key=s["trace_key"],
        redact=s["redact"],
        skip_invalid=s["on_invalid"] == "skip",
        max_bytes=s["max_queue_bytes"],
        score_needed_by=type(sampler).__name__ if gate is not None and sampler.needs_score else None,
        # With a cap, encode only what it would keep; a redact callable may change a
        # score, so then everything is encoded first.
        precheck=gate is not None and s["redact"] is None,
        keeps=buffer.keeps,
        id_prefix=id_prefix,
        groups=groups,
        group_key=getattr(sampler, "group_key", None),
        push=push,
    )
    return buffer, encoder, spool, groups
