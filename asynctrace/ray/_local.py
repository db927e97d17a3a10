"""Selection inside a `TraceClient`: keep a step's `O(k)` candidates, ship only those.

The collector applies the cap and sampler again over every client's candidates. For samplers
that keep the `k` best samples by an order (``first``: arrival; ``top_bottom``: score), a
sample one client refuses has `k` better ones from that client alone, so it could never be
kept over the whole step: shipping each client's candidates gives the collector exactly the
selection it would make from every sample. A step that a client closed and then sees again
starts a new round whose candidates compose the same way, so closing early costs bytes, never
exactness. Not thread-safe: the client holds its lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._record import TraceRecord
from .._sampling import Entry, FirstSampler, Sampler, StepSelection, TopBottomSampler

__all__ = ["LocalSelection", "Released", "composes_by_union"]

# (split, step, encoded candidates in arrival order): what one closed local step ships.
Released = tuple[str, int, list[bytes]]


def composes_by_union(sampler: Any) -> bool:
    """True when the union of per-client selections, selected again, equals one selection over all.

    A custom `Sampler` opts in with a class attribute ``composes_by_union = True``.
    """
    if type(sampler) in (FirstSampler, TopBottomSampler):
        return True
    return isinstance(sampler, Sampler) and getattr(sampler, "composes_by_union", False) is True


class _OpenStep:
    __slots__ = ("kept", "last_seen", "selection")

    def __init__(self, selection: StepSelection, now: float) -> None:
        self.selection = selection
        self.kept: dict[int, bytes] = {}  # sequence number -> payload, for holding samplers
        self.last_seen = now


class LocalSelection:
    """Per-(split, step) selections of one client, closed by step, idle time, or on demand.

    A step closes when the client offers a sample of a step more than `max_open_steps` newer
    (of the same split), after `step_timeout` seconds without samples for it, by `end_step`,
    and by `close_all` (flush and close).
    """

    def __init__(self, k: int, sampler: Sampler, *, max_open_steps: int, step_timeout: float | None) -> None:
        self.k = k
        self.sampler = sampler
        self.holds = sampler.holds
        self.max_open_steps = max_open_steps
        self.step_timeout = step_timeout
        self._open: dict[tuple[str, int], _OpenStep] = {}
        self._seq = 0
        self.held = 0
        self.held_bytes = 0

    def offer(
        self, split: str, step: int, encoded: Sequence[tuple[bytes, float | None]], now: float
    ) -> tuple[list[bytes], int, int, list[Released]]:
        """Offer one call's candidates in order.

        Returns (payloads to ship now, how many this call refused or evicted, how many of this
        call's are kept for now, steps this offer closed).
        """
        released = self._close_older(split, step)
        key = (split, step)
        opened = self._open.get(key)
        if opened is None:
            opened = self._open[key] = _OpenStep(self.sampler.new_step(split, step, self.k), now)
        opened.last_seen = now
        passed: list[bytes] = []
        capped = 0
        first = self._seq + 1
        offer = opened.selection.offer
        kept = opened.kept
        for payload, score in encoded:
            self._seq += 1
            # The record lets a selection read the sample itself (a group sampler reads its
            # group from the metadata), as it can inside a session.
            record = TraceRecord("", step, split, "", payload, now, score)
            took, evicted = offer(Entry(score, self._seq, record))
            if evicted is not None:
                out = kept.pop(evicted.seq, None)
                if out is not None:
                    capped += 1
                    self.held -= 1
                    self.held_bytes -= len(out)
            if not took:
                capped += 1
            elif self.holds:
                kept[self._seq] = payload
                self.held += 1
                self.held_bytes += len(payload)
            else:
                passed.append(payload)
        mine = len(passed) if not self.holds else sum(1 for seq in kept if seq >= first)
        return passed, capped, mine, released

    def _close_older(self, split: str, step: int) -> list[Released]:
        upto = step - self.max_open_steps - 1
        if upto < 0:
            return []
        return self._close([key for key in self._open if key[0] == split and key[1] <= upto])

    def end_step(self, step: int, split: str | None) -> list[Released]:
        """Close every open step up to `step` (of `split`, or of every split)."""
        return self._close([k for k in self._open if k[1] <= step and (split is None or k[0] == split)])

    def close_idle(self, now: float) -> list[Released]:
        """Close steps that saw no sample for `step_timeout` seconds."""
        if self.step_timeout is None:
            return []
        limit = self.step_timeout
        return self._close([k for k, o in self._open.items() if now - o.last_seen >= limit])

    def close_all(self) -> list[Released]:
        """Close every open step (flush, close)."""
        return self._close(list(self._open))

    def next_due(self, now: float) -> float | None:
        """Seconds until `close_idle` has a step to close; None when no step is open."""
        if self.step_timeout is None or not self._open:
            return None
        oldest = min(o.last_seen for o in self._open.values())
        return max(0.0, oldest + self.step_timeout - now)

    def discard(self) -> int:
        """Forget every open step; returns how many held candidates that drops."""
        n = self.held
        self._open.clear()
        self.held = 0
        self.held_bytes = 0
        return n

    def _close(self, keys: list[tuple[str, int]]) -> list[Released]:
        out: list[Released] = []
        for key in sorted(keys):
            opened = self._open.pop(key)
            if opened.kept:
                payloads = [opened.kept[seq] for seq in sorted(opened.kept)]
                self.held -= len(payloads)
                self.held_bytes -= sum(len(p) for p in payloads)
                out.append((key[0], key[1], payloads))
        return out
