"""The ledger: every sample counted from submission until it is resolved, per sink too, and
the records `Selected` sinks hold back (see `_select/lane.py`) until every holder has decided them.

Only outcomes are counted; `accepted` and `pending` are derived from them, so that
`submitted == written + failed + pending + dropped` holds by construction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._records.types import TraceRecord
from .._security import logger
from .._stats import DropReason, SessionStats, SinkStats

if TYPE_CHECKING:
    from .._durable.journal import Journal
    from .._select.lane import Picked

__all__ = ["Batch", "Holds", "Ledger"]


class Batch:
    """Records dispatched together to every sink; resolved when every sink is done with them."""

    __slots__ = ("errors", "failed", "failed_ids", "lanes_left", "nbytes", "pinned", "records", "started")

    def __init__(self, records: list[TraceRecord], lanes: int) -> None:
        self.records = records
        self.nbytes = sum([len(r.payload) for r in records])
        self.lanes_left = lanes
        self.failed = False
        self.errors: list[tuple[str, str]] = []  # (sink, error) of the sinks that failed it
        # Records a selecting sink failed (it wrote only some): failed though the batch is not.
        self.failed_ids: set[int] | None = None
        # Until a sink starts on it, drop_oldest may still take records out of it.
        self.started = False
        # Counted in the queue's `pinned_*`: out of drop_oldest's reach (see Queue.take).
        self.pinned = False


@dataclass(slots=True)
class _SinkCounters:
    written: int = 0
    failed: int = 0
    retries: int = 0
    metrics_failed: int = 0
    last_error: str | None = None
    skipped: Counter[str] = field(default_factory=Counter)
    held: int = 0
    metrics_dropped: Counter[str] = field(default_factory=Counter)


class Ledger:
    """The counts, by outcome, and the spool told of every resolution. Not thread-safe: its
    owner's lock (a buffer's, a `TraceClient`'s or a `DistributedTraceLogger`'s) guards it.

    The first drop for each reason is logged once, pointing at `owner`'s stats; reasons in
    `quiet` are only counted (capping is the point of a cap, not a loss)."""

    def __init__(
        self,
        sink_names: Sequence[str],
        journal: Journal | None,
        *,
        owner: str = "session",
        quiet: Collection[str] = ("capped",),
    ) -> None:
        self.sink_names = list(sink_names)
        self.sinks = [_SinkCounters() for _ in sink_names]
        self.journal = journal
        self.submitted = 0
        self.written = 0
        self.failed = 0
        self.replayed = 0
        self.dropped: Counter[str] = Counter()
        # Dropped after they were accepted (drop_oldest evicting, a cap displacing a held
        # sample): `accepted` counts what entered the pipeline, whatever became of it.
        self.displaced = 0
        self.owner = owner
        self._warned = set(quiet)
        self.holds = Holds()

    def submit(self, n: int, *, invalid: int = 0) -> None:
        """`n` samples submitted, `invalid` of them left out as invalid: the one place the
        submitted count grows, so every way in counts alike."""
        self.submitted += n
        if invalid:
            self.drop("invalid", invalid)

    def drop(
        self, reason: DropReason, n: int, records: Sequence[TraceRecord] = (), *, displaced: bool = False
    ) -> None:
        if not n:
            return
        self.dropped[reason] += n
        if displaced:
            self.displaced += n
        if reason not in self._warned:
            # Under the owner's lock: only bookkeeping and this one line per reason.
            self._warned.add(reason)
            logger.warning(
                "asynctrace: dropping samples (%s); counts are in %s.stats().dropped", reason, self.owner
            )
        if records and self.journal is not None:
            self.journal.dropped(records)

    def resolve(
        self, batch: Batch, lane: int, ok: bool, retries: int, error: str | None, picked: Picked | None
    ) -> bool:
        """Count what one sink made of a batch; True once every sink is done with it."""
        sink = self.sinks[lane]
        sink.retries += retries
        if picked is None:
            failed = not ok
            batch.failed |= failed
            sink.written += 0 if failed else len(batch.records)
            sink.failed += len(batch.records) if failed else 0
        else:
            failed = bool(picked.failed)
            sink.written += len(picked.write) - len(picked.failed)
            sink.failed += len(picked.failed)
            sink.skipped.update(picked.skipped)
            sink.held += len(picked.held)
            self.holds.hold(picked.held)
            if failed:
                ids = batch.failed_ids if batch.failed_ids is not None else set()
                ids.update(id(r) for r in picked.failed)
                batch.failed_ids = ids
        if failed:
            sink.last_error = error
            batch.errors.append((self.sink_names[lane], error or "failed"))
        batch.lanes_left -= 1
        if self.journal is not None and (batch.lanes_left or self.holds.held):
            self._sink_done(batch, lane, failed, picked)
        if batch.lanes_left:
            return False
        self.resolved(*self.holds.settle(batch))
        return True

    def resolve_held(
        self, lane: int, records: Sequence[TraceRecord], outcome: str, error: str | None
    ) -> None:
        """A selecting sink decided records its selection held: `outcome` is "written",
        "failed" (with `error`) or the reason it left them out."""
        sink = self.sinks[lane]
        sink.held -= len(records)
        failure = None
        if outcome == "written":
            sink.written += len(records)
        elif outcome == "failed":
            sink.failed += len(records)
            sink.last_error = error
            failure = (self.sink_names[lane], error or "failed")
        else:
            sink.skipped[outcome] += len(records)
        ok, bad, errors = self.holds.decide(records, failure)
        if self.journal is not None and failure is None and len(ok) + len(bad) < len(records):
            # Decided by this sink, not yet by every holder: the spool notes this sink has them.
            settled = {id(r) for r in (*ok, *bad)}
            self.journal.sink_done([r for r in records if id(r) not in settled], self.sink_names[lane])
        self.resolved(ok, bad, errors)

    def _sink_done(self, batch: Batch, lane: int, failed: bool, picked: Picked | None) -> None:
        """Tell the spool which of a batch's records this sink dealt with (wrote, or its
        selection left out), while other sinks or holders are not done with them."""
        assert self.journal is not None
        if picked is None:
            if not failed:
                self.journal.sink_done(batch.records, self.sink_names[lane])
            return
        undecided = {id(r) for r in picked.held}
        undecided.update(id(r) for r in picked.failed)
        done = [r for r in batch.records if id(r) not in undecided] if undecided else batch.records
        self.journal.sink_done(done, self.sink_names[lane])

    def resolved(
        self, ok: Sequence[TraceRecord], bad: Sequence[TraceRecord], errors: list[tuple[str, str]]
    ) -> None:
        self.written += len(ok)
        self.failed += len(bad)
        if self.journal is not None:
            self.journal.resolved(ok, bad, errors)

    def snapshot(
        self,
        queue_depth: int,
        queue_bytes: int,
        metrics_dropped: int = 0,
        degraded: Sequence[str | None] = (),
    ) -> SessionStats:
        """The counts now; `degraded` says, per sink, why it runs in a fallback (None: it does not)."""
        dropped = dict(self.dropped)
        fallbacks = list(degraded) or [None] * len(self.sinks)
        resolved = self.written + self.failed + sum(dropped.values())
        return SessionStats(
            submitted=self.submitted,
            accepted=self.submitted - sum(dropped.values()) + self.displaced,
            written=self.written,
            dropped=dropped,
            failed=self.failed,
            retries=sum(s.retries for s in self.sinks),
            pending=self.submitted - resolved,
            queue_depth=queue_depth,
            queue_bytes=queue_bytes,
            replayed=self.replayed,
            metrics_dropped=metrics_dropped,
            sinks={
                name: SinkStats(
                    written=s.written,
                    failed=s.failed,
                    retries=s.retries,
                    metrics_failed=s.metrics_failed,
                    last_error=s.last_error,
                    skipped=dict(+s.skipped),
                    held=s.held,
                    metrics_dropped=dict(+s.metrics_dropped),
                    degraded=why,
                )
                for name, s, why in zip(self.sink_names, self.sinks, fallbacks, strict=True)
            },
        )


# What a settlement resolves: records written, records failed, and the failed ones' errors.
Settled = tuple[list[TraceRecord], list[TraceRecord], list[tuple[str, str]]]


class _Hold:
    __slots__ = ("batch_done", "errors", "failed", "holders", "record")

    def __init__(self, record: TraceRecord) -> None:
        self.record = record
        self.holders = 0
        self.batch_done = False
        self.failed = False
        self.errors: list[tuple[str, str]] = []


class Holds:
    """The held records, by id(record). Not thread-safe: the buffer's lock guards it."""

    def __init__(self) -> None:
        self.held: dict[int, _Hold] = {}

    def hold(self, records: Sequence[TraceRecord]) -> None:
        """One more sink holds each of `records`."""
        for r in records:
            hold = self.held.get(id(r))
            if hold is None:
                hold = self.held[id(r)] = _Hold(r)
            hold.holders += 1

    def settle(self, batch: Batch) -> Settled:
        """Every sink is done with a batch: what no sink holds is resolved now, held records once
        their holders decide them."""
        if not self.held and not batch.failed_ids:
            return ([], batch.records, batch.errors) if batch.failed else (batch.records, [], [])
        failed_ids = batch.failed_ids or set()
        ok: list[TraceRecord] = []
        bad: list[TraceRecord] = []
        errors = list(batch.errors)
        for r in batch.records:
            failed = batch.failed or id(r) in failed_ids
            hold = self.held.get(id(r))
            if hold is not None:
                hold.batch_done = True
                if failed:
                    hold.failed = True
                    hold.errors.extend(batch.errors)
                if hold.holders:
                    continue
                del self.held[id(r)]
                failed = hold.failed  # a holder may have failed it before the batch was done
                errors.extend(e for e in hold.errors if e not in errors)
            (bad if failed else ok).append(r)
        return ok, bad, errors

    def decide(self, records: Sequence[TraceRecord], error: tuple[str, str] | None) -> Settled:
        """A sink decided records it held (failed them when `error` is given): what is now
        decided by every holder, its batch done, is resolved."""
        ok: list[TraceRecord] = []
        bad: list[TraceRecord] = []
        errors: list[tuple[str, str]] = []
        for r in records:
            hold = self.held[id(r)]
            hold.holders -= 1
            if error is not None:
                hold.failed = True
                hold.errors.append(error)
            if hold.holders or not hold.batch_done:
                continue
            del self.held[id(r)]
            (bad if hold.failed else ok).append(r)
            if hold.failed:
                errors.extend(e for e in hold.errors if e not in errors)
        return ok, bad, errors
