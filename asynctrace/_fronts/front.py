"""The front engine: what a rank's `DistributedTraceLogger` and a Ray actor's `TraceClient` do
with the samples they are given before handing them on, and where each one is counted.

A call's samples are checked and encoded in the caller, as a session's are; the watch list
passes its samples by (their places in the step's watch budget taken, and given back for any
that are not kept); the rest are offered to this process's part of the step (`selection.py`),
or taken as they are by a client that does not select. Each sample is counted here once, under
the front's one lock: submitted, then handed on (to the collector, the writing rank or the
rank's own session), held, or dropped with its reason. Nothing else adds to these counts;
`held` is derived (what the selection keeps and what is on its way out).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, NamedTuple

from .._engine.ledger import Ledger
from .._records.encode import as_list, encode_samples
from .._records.groups import GroupKey
from .._records.types import Sample, SampleLike
from .._select.base import Sampler
from .._stats import DropReason
from .selection import PLAIN, Encoded, Ended, Part, PartSelection

__all__ = ["Front", "Tally"]


class Tally(NamedTuple):
    """A front's counts at one moment: ``submitted == handed_on + held + sum(dropped)``."""

    submitted: int
    handed_on: int
    held: int
    dropped: dict[str, int]


# What a front refuses a call for now ("closed", "collector_gone"), None while it takes samples.
Refusal = Callable[[], DropReason | None]
# How many of a call's encoded samples fit a bound of the front's own (the rest are "queue_full").
Fit = Callable[[Sequence[Encoded]], int]
# Takes what goes on at once, under the lock, as `(parts, now)`: a streaming part's releases, or
# a plain client's samples as they are.
Release = Callable[[list[Part], float], None]


class Front:
    """One rank's or actor's way in and its counts; its `selection` is None for a client that
    ships every sample. `lock` guards the counts and the selection; the owner holds it for what
    it adds (a client's buffer)."""

    def __init__(
        self,
        selection: PartSelection | None,
        *,
        sampler: Sampler | None,
        redact: Callable[[Sample], Sample] | None,
        on_invalid: str,
        group_keys: Iterable[GroupKey],
        owner: str,
        quiet: Collection[str],
        max_bytes: int | None = None,
        bound: str = "max_queue_bytes",
    ) -> None:
        self.lock = threading.Lock()
        self.selection = selection
        # The engine's ledger: the counts, and a warning once per drop reason.
        self._ledger = Ledger((), None, owner=owner, quiet=quiet)
        self._in_transit = 0  # taken out of the selection, not handed on or dropped yet
        self._encode: Callable[..., tuple[list[Encoded], int]] = functools.partial(
            encode_samples,
            redact=redact,
            skip_invalid=on_invalid == "skip",
            max_bytes=max_bytes,
            bound=bound,
            score_needed_by=type(sampler).__name__ if sampler is not None and sampler.needs_score else None,
            # The keys every group sampler of the writing session reads: a sample none of them
            # can name a group of is invalid here, as in the session.
            group_keys=tuple(group_keys),
        )

    # -- the way in (any thread) --------------------------------------------------------------

    def admit(
        self,
        samples: SampleLike | Iterable[SampleLike],
        *,
        step: int,
        split: str,
        refused: Refusal,
        now: float = 0.0,
        fit: Fit | None = None,
        release: Release | None = None,
    ) -> int:
        """Check, encode and offer one call's samples (the step and split are checked already);
        returns how many are kept for now.

        Raises `RecordError` for an invalid sample (nothing of the call is kept) unless
        ``on_invalid="skip"``. A call `refused` is counted without being checked; samples of a
        step that ended here are ``"late"``, those past `fit` ``"queue_full"``. What goes on at
        once goes to `release`, under the lock that counted it.
        """
        items = as_list(samples)  # once: `samples` may be a generator
        reason = refused()
        if reason is not None:
            self._refuse(len(items), reason)
            return 0
        skipped: list[int] = []
        encoded, invalid = self._encode(items, skipped=skipped)
        watched = self._watched(items, skipped, split, step) if encoded else []
        selection = self.selection
        with self.lock:
            ledger = self._ledger
            ledger.submit(len(items), invalid=invalid)
            reason = refused()
            if reason is None and selection is not None and selection.is_late(split, step):
                reason = "late"
            if reason is not None:
                ledger.drop(reason, len(encoded))
                kept = accepted = 0
            else:
                kept = len(encoded) if fit is None else fit(encoded)
                ledger.drop("queue_full", len(encoded) - kept)
                accepted, released = self._offer(
                    encoded[:kept], [i for i in watched if i < kept], split, step, now
                )
                if released:
                    assert release is not None, "a front that releases at once takes them"
                    release(released, now)
        if watched and selection is not None and selection.watch is not None:
            # The places taken for watched samples that were not kept go back.
            selection.watch.give_back(split, step, sum(1 for i in watched if i >= kept))
        return accepted

    def _watched(self, items: Sequence[Any], skipped: list[int], split: str, step: int) -> list[int]:
        """The places, among the call's encoded samples, of those the watch list passes by,
        within this part's share of the step's watch budget (taken now)."""
        watch = self.selection.watch if self.selection is not None else None
        if watch is None:
            return []
        if skipped:
            # Validated first, then the watch list: an invalid sample takes no watched place.
            left_out = set(skipped)
            items = [obj for i, obj in enumerate(items) if i not in left_out]
        return watch.split(items, split, step)[0]

    def _offer(
        self, encoded: list[Encoded], watched: list[int], split: str, step: int, now: float
    ) -> tuple[int, list[Part]]:
        """Offer the samples that fit to the selection (lock held): how many it kept, and what
        goes on at once."""
        if not encoded:
            return 0, []
        if self.selection is None:
            return len(encoded), [Part(split, step, PLAIN, [p for p, _ in encoded], [])]
        offered = self.selection.offer(split, step, encoded, now, set(watched))
        self._ledger.drop("capped", offered.capped)
        return offered.kept, offered.released

    def _refuse(self, n: int, reason: DropReason) -> None:
        with self.lock:
            self._ledger.submit(n)
            self._ledger.drop(reason, n)

    # -- handing on ---------------------------------------------------------------------------

    def take_ended(self, step: int | None, split: str | None) -> Ended:
        """Take the open steps up to `step` (every one when None) of `split` (or of every split)
        out of the selection, on their way out: held until `settle` says what became of them."""
        if self.selection is None:
            return []
        with self.lock:
            ended = self.selection.end(step, split)
            self._in_transit += sum(opened.held for _, opened in ended)
        return ended

    def settle(self, n: int, handed_on: int, reason: DropReason = "capped") -> None:
        """Of `n` samples taken out with `take_ended`, `handed_on` went on; the rest are `reason`."""
        with self.lock:
            self._in_transit -= n
            self._ledger.written += handed_on
            self._ledger.drop(reason, n - handed_on)

    def streamed(self, n: int) -> None:
        """`n` samples went on as they came, past any selection here (a rank streaming into its
        own session, which counts what becomes of them)."""
        with self.lock:
            self._ledger.submit(n)
            self._ledger.written += n

    # The owner's own stages (a client's buffer and calls), under `lock`, held by the caller.

    def handed_on(self, n: int) -> None:
        """`n` samples released earlier reached where they go (a client's call answered)."""
        self._ledger.written += n

    def drop(self, reason: DropReason, n: int) -> None:
        """`n` samples released earlier were lost on the way, for `reason`."""
        self._ledger.drop(reason, n)

    def tally(self) -> Tally:
        """The counts now."""
        held = self._in_transit + (self.selection.held if self.selection is not None else 0)
        ledger = self._ledger
        return Tally(ledger.submitted, ledger.written, held, dict(ledger.dropped))
