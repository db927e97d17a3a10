"""One sink's lane at work: it opens the sink, then writes what reaches its inbox (batches, a
`Selected` sink's picks, metrics, markers) with retries, and resolves each batch in the ledger.
The writer (`writer.Writer`) runs one per sink beside its dispatcher."""

from __future__ import annotations

from collections.abc import Callable

from .._records.types import MetricsItem, TraceRecord
from .._security import describe, logger
from .._select.lane import Picked
from .buffer import Batch, Buffer, Marker
from .lane import Lane
from .retry import RetryPolicy, call_with_retry

__all__ = ["LaneWriting"]


class LaneWriting:
    """The lanes' work for one writer: every sink's lane runs `run`."""

    def __init__(self, buffer: Buffer, retry: RetryPolicy, on_room: Callable[[], None]) -> None:
        self.buffer = buffer
        self.retry = retry
        self.on_room = on_room

    def _retry_counter(self, lane: Lane) -> Callable[[BaseException | None], None]:
        def on_retry(exc: BaseException | None) -> None:
            self.buffer.note_retries(lane.index, 1)
            logger.debug(
                "asynctrace: retrying sink %r after %s", lane.sink.name, describe(exc) if exc else "?"
            )

        return on_retry

    async def run(self, lane: Lane) -> None:
        """Write what reaches `lane`'s inbox until the writer stops."""
        try:
            await self._lane_loop(lane)
        finally:
            lane.done = True

    async def _lane_loop(self, lane: Lane) -> None:
        on_retry = self._retry_counter(lane)
        try:
            await call_with_retry(self.retry, lane.sink.open, on_retry)
        except Exception as exc:
            lane.dead = describe(exc)
            logger.error(
                "asynctrace: sink %r could not be opened (%s); its records are counted as failed",
                lane.sink.name,
                lane.dead,
            )
        batch_size = self.buffer.batch_size
        while True:
            if not lane.inbox:
                lane.idle = True
                try:
                    await lane.signal.wait(lane.idle_check_in(self.buffer.clock))
                finally:
                    lane.idle = False
                await self._close_idle(lane, on_retry)
                continue
            item = lane.inbox.popleft()
            if isinstance(item, Marker):
                if lane.selection is not None and lane.dead is None:
                    # A flush closes the steps a sink's selection holds, as it closes the session's.
                    await self._write_picked(lane, [], [lane.selection.close_all()], on_retry)
                await lane.confirms.until_confirmed()
                item.arrive()
                continue
            if isinstance(item, MetricsItem):
                if item is lane.health:
                    lane.health = None
                if await lane.write_metrics(item, self.buffer, self.retry, on_retry):
                    self.on_room()
                continue
            # A sink that fell behind gets what piled up in fewer, larger writes, each of at
            # most batch_size records (the contract's bound on one sink write).
            batches: list[Batch] = [item]
            n = len(item.records)
            while lane.inbox:
                nxt = lane.inbox[0]
                if not isinstance(nxt, Batch) or n + len(nxt.records) > batch_size:
                    break
                lane.inbox.popleft()
                batches.append(nxt)
                n += len(nxt.records)
            await self._write_batches(lane, batches, on_retry)
            await self._close_idle(lane, on_retry)

    async def _close_idle(self, lane: Lane, on_retry: Callable[[BaseException | None], None]) -> None:
        selection = lane.selection
        if selection is None or not selection.holding or selection.step_timeout is None:
            return
        now = self.buffer.clock()
        if now < lane.next_idle_check:
            return
        lane.next_idle_check = now + min(selection.step_timeout, 1.0)
        picked = selection.close_idle(now)
        if picked.released:
            await self._write_picked(lane, [], [picked], on_retry)

    async def _write_batches(
        self, lane: Lane, batches: list[Batch], on_retry: Callable[[BaseException | None], None]
    ) -> None:
        self.buffer.start(batches)
        if lane.dead is None and any(r.sinks_done is not None for b in batches for r in b.records):
            # Replayed records this sink had dealt with before the kill are not sent again.
            await self._write_replayed(lane, batches, on_retry)
            return
        if lane.selection is not None and lane.dead is None:
            now = self.buffer.clock()
            picks = [lane.selection.offer(b.records, now) for b in batches]
            await self._write_picked(lane, batches, picks, on_retry)
            return
        error = lane.dead
        ok = error is None
        records: list[TraceRecord] = []
        if ok and any(b.records for b in batches):
            records = batches[0].records if len(batches) == 1 else [r for b in batches for r in b.records]
            try:
                await call_with_retry(self.retry, lambda: lane.sink.write(records), on_retry)
            except Exception as exc:
                ok = False
                error = describe(exc)
                self.warn_failed(lane, len(records), error)

        def settle(failed: set[int], late_error: str | None) -> None:
            good = ok and not failed
            freed = False
            for batch in batches:
                freed |= self.buffer.resolve(batch, lane.index, good, 0, error if not ok else late_error)
            self._resolved(freed)

        lane.confirms.settle(records if ok else [], settle)

    async def _write_replayed(
        self, lane: Lane, batches: list[Batch], on_retry: Callable[[BaseException | None], None]
    ) -> None:
        """Batches holding replayed records: the sink (or its selection) gets only those it had
        not dealt with; the others are counted `skipped["earlier"]` for it."""
        name = self.buffer.ledger.sink_names[lane.index]
        now = self.buffer.clock()
        picks = []
        for b in batches:
            fresh = [r for r in b.records if r.sinks_done is None or name not in r.sinks_done]
            earlier = len(b.records) - len(fresh)
            pick = lane.selection.offer(fresh, now) if lane.selection is not None else Picked(write=fresh)
            if earlier:
                pick.skipped["earlier"] += earlier
            picks.append(pick)
        await self._write_picked(lane, batches, picks, on_retry)

    def warn_failed(self, lane: Lane, n: int, error: str) -> None:
        logger.warning(
            "asynctrace: sink %r failed to write %d records for good: %s", lane.sink.name, n, error
        )

    def _resolved(self, freed: bool) -> None:
        """A lane resolved records: what the spool was told goes to disk (a sink's own
        acknowledgement too, so that a kill while another sink lags does not resend them)."""
        if freed:
            self.on_room()
        if self.buffer.journal is not None and (freed or self.buffer.journal.spool.has_staged):
            self.buffer.journal.acknowledge()

    async def _write_picked(
        self,
        lane: Lane,
        batches: list[Batch],
        picks: list[Picked],
        on_retry: Callable[[BaseException | None], None],
    ) -> None:
        """Write what a sink's selection picked: released records of closed steps and the
        batches' records it passes on, in slices of at most batch_size (the contract's bound on
        one write); then resolve the batches and what the selection had held."""
        released = [r for p in picks for r in p.released]
        records = [r for p in picks for r in (*p.released, *p.write)]
        failed: set[int] = set()
        error: str | None = None
        size = self.buffer.batch_size
        for i in range(0, len(records), size):
            chunk = records[i : i + size]
            try:
                await call_with_retry(self.retry, lambda c=chunk: lane.sink.write(c), on_retry)  # type: ignore[misc]
            except Exception as exc:
                error = describe(exc)
                failed.update(id(r) for r in chunk)
                self.warn_failed(lane, len(chunk), error)

        def settle(lost: set[int], late_error: str | None) -> None:
            failed.update(lost)
            why = error or late_error
            lane.note_tier(self.buffer.journal, self.buffer.ledger.sink_names[lane.index], records, failed)
            freed = False
            for batch, pick in zip(batches, picks, strict=False):
                pick.failed = [r for r in pick.write if id(r) in failed] if failed else []
                freed |= self.buffer.resolve(batch, lane.index, True, 0, why, pick)
            # After the batches: a record held by one of them and released by a later one is
            # registered as held before it is resolved.
            buffer = self.buffer
            if failed:
                buffer.resolve_held(lane.index, [r for r in released if id(r) in failed], "failed", why)
                buffer.resolve_held(lane.index, [r for r in released if id(r) not in failed], "written", None)
            else:
                buffer.resolve_held(lane.index, released, "written", None)
            buffer.resolve_held(lane.index, [r for p in picks for r in p.evicted], "capped", None)
            self._resolved(freed)

        lane.confirms.settle([r for r in records if id(r) not in failed], settle)
