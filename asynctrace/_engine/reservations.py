"""Reservations for `log_rollouts`: places in a step's selection taken by score before the rows
are decoded, then filled with their records (or given back when a row cannot be decoded)."""

from __future__ import annotations

from collections.abc import Sequence

from .._records.types import TraceRecord
from .._select.base import EVICTED, HELD, RELEASED, Entry
from .._stats import DropReason
from .buffer import Admission, Buffer, Waiting

__all__ = ["Reservations"]


class Reservations:
    """A buffer's reservations, under its lock."""

    def __init__(self, buffer: Buffer) -> None:
        self.buffer = buffer

    def reserve(
        self, scores: Sequence[float | None], *, split: str, step: int, invalid: int = 0
    ) -> tuple[list[Entry | None], bool] | None:
        """Ask the gate which rows can be kept before they are decoded; counts the rest, and
        `invalid` rows that were left out (counted as submitted and dropped). Also returns
        whether the writer should be woken (this offer closed older steps, releasing them).
        None (nothing counted) when a holding sampler's selection has no room under "block":
        the caller waits for room and asks again."""
        buf = self.buffer
        with buf.lock:
            if buf.closed:
                # finish() ran while these rows were decoded: nothing would deliver them now.
                buf.ledger.submit(len(scores) + invalid, invalid=invalid)
                buf.ledger.drop("closed", len(scores))
                return [None] * len(scores), False
            if buf.gated is not None:
                return buf.gated.reserve(scores, split, step, invalid, buf.on_full)
            buf.ledger.submit(len(scores) + invalid, invalid=invalid)
            entries: list[Entry | None] = [Entry(s, 0) for s in scores]
            for e in entries:
                e.state = RELEASED  # type: ignore[union-attr]
            return entries, False

    def fill(self, entries: Sequence[Entry], records: Sequence[TraceRecord]) -> Admission:
        """Attach decoded records to reserved entries; released ones go to the queue now."""
        buf = self.buffer
        out = Admission()
        ready: list[TraceRecord] = []
        with buf.lock:
            if buf.closed:
                # finish() ran while these rows were decoded: nothing would deliver them now.
                live = [e for e in entries if e.state != EVICTED]
                for e in live:
                    e.state = EVICTED
                buf.ledger.drop("closed", len(live))
                return out
            staged: list[TraceRecord] = []
            for e, r in zip(entries, records, strict=True):
                if e.state == HELD:
                    e.record = r
                    staged.append(r)
                elif e.state == RELEASED:
                    ready.append(r)
                    staged.append(r)
                # EVICTED: already counted as capped.
            if buf.staging is not None:
                buf.staging.admitted(staged)
            # Held rows count as accepted, as they do in log_samples; drops below subtract.
            out.accepted = len(staged)
            stop = buf.enqueue(ready, out, buf.on_full)
            if stop < len(ready):
                buf.wait(out, Waiting(ready, stop))
        return out

    def cancel(self, entries: Sequence[Entry], reason: DropReason, *, split: str, step: int) -> None:
        """Resolve reserved entries that could not be filled (their decoding failed); they
        give their places in the step's selection back."""
        buf = self.buffer
        with buf.lock:
            live = [e for e in entries if e.state != EVICTED]
            if buf.gated is not None:
                buf.gated.gate.withdraw(split, step, live)
            for e in live:
                e.state = EVICTED
            buf.ledger.drop(reason, len(live), [e.record for e in live if e.record is not None])
