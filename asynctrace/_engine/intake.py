"""The way into a session's buffer: encode in the caller, admit, and wait for room under
``on_full="block"``, from the session's event loop or any other thread.

Every wait (for room, for a holding sampler's selection, for earlier submissions to be
queued) is one `Room` subscription: no polling.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import anyio
import anyio.lowlevel

from .._checks import check_step, checked_metrics
from .._records.types import MetricsItem, SampleLike, TraceRecord
from .._runtime.lifecycle import Lifecycle, State
from .._select.base import Entry
from .._select.watch import WatchCounter
from .._stats import DropReason
from ..exceptions import RecordError
from .buffer import Admission, Buffer, Marker
from .encoder import Encoder
from .group_metrics import GroupMetrics
from .reservations import Reservations
from .rollout_intake import log_rollouts, renumbered
from .waits import Waits

__all__ = ["Intake"]

_OPEN = State.OPEN
_REFUSED = Admission()  # never changed: what a submission the cap refused whole gets back


# A MetricsItem and its place in each sink's inbox, in bytes: what a metrics item costs beyond
# its dict.
_METRICS_ITEM_BYTES = 128
_FLOAT_BYTES = sys.getsizeof(1.0)


def metrics_nbytes(metrics: dict[str, float]) -> int:
    """The memory one `log_metrics` call's item holds, about: its dict, keys and values."""
    keys = sum(sys.getsizeof(k) for k in metrics)
    return _METRICS_ITEM_BYTES + sys.getsizeof(metrics) + keys + _FLOAT_BYTES * len(metrics)


class Intake:
    """Submissions of one session: `log` (its event loop), `log_blocking` (any other thread),
    `log_nowait` (any thread, never waits), and `reserve`/`fill` for `log_rollouts`."""

    def __init__(
        self,
        buffer: Buffer,
        encoder: Encoder,
        life: Lifecycle,
        *,
        batch_size: int,
        wake_writer: Callable[[], None],
        watch: WatchCounter | None = None,
        groups: GroupMetrics | None = None,
    ) -> None:
        self.buffer = buffer
        self.encoder = encoder
        self.life = life
        self.batch_size = batch_size
        self._wake_writer = wake_writer
        self.watch = watch
        self.groups = groups  # group metrics: they see every sample submitted, before the cap
        # log yields to the writer once this many records wait for it (see there).
        self._yield_at = 2 * batch_size
        self.waits = Waits(buffer, life, self.wake)
        self.reservations = Reservations(buffer)  # log_rollouts' places, taken before decoding
        self._since_turn = 0

    def wake(self) -> None:
        """Wake the writer, from any thread."""
        if self.life.on_loop_thread():
            self._wake_writer()
        else:
            self.life.call_soon(self._wake_writer)  # False once the loop is closing: no need then

    def push_items(self, items: Sequence[MetricsItem | Marker]) -> None:
        """Queue control items (group metrics of closed steps) for the writer."""
        for item in items:
            self.buffer.push_item(item)
        if items:
            self.wake()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Queue scalar metrics for `step`, in order with the records, from any thread."""
        self.life.check_open()
        check_step(step, "train")
        clean = checked_metrics(metrics)
        item = MetricsItem(step, clean, metrics_nbytes(clean))
        if self.buffer.admit_metrics(item):
            self.wake()

    def _after_admit(self, adm: Admission, blocking: bool = True) -> None:
        journal = self.buffer.journal
        if journal is not None:
            journal.caller_done(blocking=blocking)
        if adm.wake:
            self.wake()

    # -- submissions ------------------------------------------------------------------------

    async def log(
        self, samples: SampleLike | Iterable[SampleLike], step: int, split: str, timeout: float | None
    ) -> int:
        if threading.get_ident() != self.life.loop_thread:
            return await self._log_from_other_loop(samples, step, split, timeout)
        watched, adm, came = self._submit(samples, step, split, nowait=False)
        buf = self.buffer
        if adm.waiting is None:
            under_pressure = False
            if buf.pressed:
                self._since_turn += came
                under_pressure = self._since_turn >= min(self.batch_size, buf.depth // 2 + 1)
            if under_pressure or buf.undispatched >= self._yield_at:
                # The writer has fallen behind: two batches wait for it, or half the bound is
                # taken and a batch's worth (or half of what is held) came in since its last
                # turn. Give it a turn, so that a caller that never awaits anything else cannot
                # starve the sinks. Never a wait for room, and not on every call under pressure
                # (a turn of the loop costs tens of microseconds); a caller that awaits between
                # calls, as a trainer does, lets the writer run there, outside this call.
                self._since_turn = 0
                await anyio.lowlevel.checkpoint()
            return watched + adm.accepted
        return watched + adm.accepted - await self.waits.wait_for_room(adm.waiting, timeout)

    async def _log_from_other_loop(
        self, samples: SampleLike | Iterable[SampleLike], step: int, split: str, timeout: float | None
    ) -> int:
        """`await log_samples` on another thread's event loop: the blocking form in a worker
        thread, which a cancellation of the caller makes give up its wait for room."""
        cancelled = threading.Event()
        try:
            return await anyio.to_thread.run_sync(
                self.log_blocking, samples, step, split, timeout, cancelled, abandon_on_cancel=True
            )
        except BaseException:
            # What is still waiting for room is counted as "cancelled", as the same call on
            # the session's own loop does; the notify wakes the worker thread to see it now.
            cancelled.set()
            self.buffer.room.notify()
            raise

    def log_blocking(
        self,
        samples: SampleLike | Iterable[SampleLike],
        step: int,
        split: str,
        timeout: float | None,
        cancelled: threading.Event | None = None,
    ) -> int:
        """The blocking form, for threads other than the session's event loop."""
        self.life.check_open()
        buf = self.buffer
        # Under "block" this call may be left waiting for room: its ticket is taken before it
        # admits anything, so a flush() from another thread cannot slip in between.
        ticket = buf.take_ticket() if buf.on_full == "block" else None
        try:
            watched, adm, _ = self._submit(samples, step, split, nowait=False, ticket=ticket)
            if adm.waiting is None:
                return watched + adm.accepted
            return watched + adm.accepted - self.waits.wait_blocking(adm.waiting, timeout, cancelled)
        finally:
            if ticket is not None:
                buf.return_ticket(ticket)

    def log_nowait(self, samples: SampleLike | Iterable[SampleLike], step: int, split: str) -> int:
        state = self.life.state
        if state is not _OPEN and state is not State.CLOSED:
            self.life.check_usable()
        watched, adm, _ = self._submit(samples, step, split, nowait=True)
        return watched + adm.accepted

    def _submit(
        self,
        samples: SampleLike | Iterable[SampleLike],
        step: int,
        split: str,
        *,
        nowait: bool,
        ticket: int | None = None,
    ) -> tuple[int, Admission, int]:
        """Admit one call's samples, the one way every entry takes: validate and encode (the
        watched ones past the cap, the others as the cap would keep them), then count them for
        the group metrics, then admit. A call that raises has counted nothing anywhere.

        Returns how many watched ones were accepted, the admission of the others, and how many
        of those were encoded or found invalid."""
        items, key = self.encoder.prepare(samples, step, split)
        watched: list[TraceRecord] = []
        invalid_watched = 0
        if self.watch is not None:
            picked, others = self.watch.split(items, split, step)
            part, divided, held = picked, bool(picked), len(picked)
            try:
                while picked:
                    part = picked
                    got, bad = self.encoder.encode([items[i] for i in picked], step, split)
                    watched += got
                    invalid_watched += bad
                    if not bad:
                        break
                    # An invalid sample (skipped) takes no place: the next watched ones get it.
                    self.watch.give_back(split, step, bad)
                    held -= bad
                    more, rest = self.watch.split([items[i] for i in others], split, step)
                    picked, others = [others[j] for j in more], [others[j] for j in rest]
                    held += len(picked)
                part = others
                submitted = self.encoder.submit(
                    [items[i] for i in others] if divided else items, step, split, key
                )
            except BaseException as exc:
                self.watch.give_back(split, step, held)
                if (
                    isinstance(exc, RecordError)
                    and divided
                    and exc.index is not None
                    and exc.index < len(part)
                ):
                    # The encoder numbered the part it was encoding: name the caller's sample.
                    raise renumbered(exc, part[exc.index]) from None
                raise
        else:
            submitted = self.encoder.submit(items, step, split, key)
        if self.groups is not None:
            # Every sample the caller submitted, watched or not, before the cap (log_rollouts'
            # rows the cap refused are never decoded, so they are not seen).
            self.push_items(self.groups.observe(items, step, split, time.monotonic()))
        accepted_watched = (
            self._admit_watched(watched, invalid_watched, step, split) if watched or invalid_watched else 0
        )
        if submitted is None:  # the cap refused it whole, and the buffer counted it
            return accepted_watched, _REFUSED, 0
        adm = self.buffer.admit(
            submitted.records,
            split=split,
            step=step,
            nowait=nowait,
            invalid=submitted.invalid,
            refused=submitted.refused,
            ticket=ticket,
            gaps=submitted.gaps,
            groups=submitted.groups,
        )
        if self.buffer.journal is not None or adm.wake:
            self._after_admit(adm, blocking=not nowait)
        return accepted_watched, adm, len(submitted.records) + submitted.invalid

    def log_watched(self, samples: SampleLike | Iterable[SampleLike], step: int, split: str) -> int:
        """Queue samples another process's watch list passed by, within the step's watch cap
        there (a rank's, see asynctrace.distributed): validated, encoded and counted for the
        group metrics as any call, then marked watched and admitted past every selection, as
        `_submit` does for its own. Any thread, never waits."""
        state = self.life.state
        if state is not _OPEN and state is not State.CLOSED:
            self.life.check_usable()
        items, _ = self.encoder.prepare(samples, step, split)
        records, invalid = self.encoder.encode(items, step, split)
        if self.groups is not None:
            self.push_items(self.groups.observe(items, step, split, time.monotonic()))
        return self._admit_watched(records, invalid, step, split)

    def _admit_watched(self, records: list[TraceRecord], invalid: int, step: int, split: str) -> int:
        """Queue watched records past every selection (never waiting for room: under "block" a
        full queue drops them as "queue_full"); returns how many were accepted."""
        for r in records:
            r.watched = True
        adm = self.buffer.admit(records, split=split, step=step, nowait=True, invalid=invalid, gated=False)
        if adm.wake:
            self.wake()
        return adm.accepted

    async def replay(self, records: Sequence[TraceRecord]) -> None:
        """Records replayed from a spool, ahead of new ones; they wait for room, never dropped."""
        adm = self.buffer.admit_replayed(records)
        if adm.wake:
            self.wake()
        if adm.waiting is not None:
            await self.waits.wait_for_room(adm.waiting, None)

    # -- reservations (log_rollouts) --------------------------------------------------------

    async def reserve(
        self, scores: Sequence[float | None], rows: list[int], *, step: int, split: str, invalid: int = 0
    ) -> tuple[list[int], list[Entry]]:
        """Reserve places for `rows` (each with a score where a ranking sampler needs one) by
        their scores; returns the rows the cap keeps and their entries. `invalid` rows left
        out are counted with them."""
        wanted = [scores[i] for i in rows]
        got: list[tuple[list[Entry | None], bool]] = []

        def attempt() -> bool:
            # A holding sampler's selection takes rows only while the queue has room (block).
            reserved = self.reservations.reserve(wanted, split=split, step=step, invalid=invalid)
            if reserved is not None:
                got.append(reserved)
            return reserved is not None

        await self.waits.until_changed(attempt)
        entries, wake = got[0]
        if wake:
            self.wake()
        kept = [(i, e) for i, e in zip(rows, entries, strict=True) if e is not None]
        return [i for i, _ in kept], [e for _, e in kept]

    async def fill(self, entries: Sequence[Entry], records: Sequence[TraceRecord]) -> int:
        adm = self.reservations.fill(entries, records)
        self._after_admit(adm)
        if adm.waiting is not None:
            return adm.accepted - await self.waits.wait_for_room(adm.waiting, None)
        return adm.accepted

    async def log_rollouts(
        self, input_ids: Any, *, tokenizer: Any, step: int, split: str, rewards: Any, **decode_kwargs: Any
    ) -> int:
        """See `TraceSession.log_rollouts` and `rollout_intake.log_rollouts`."""
        return await log_rollouts(
            self, input_ids, tokenizer=tokenizer, step=step, split=split, rewards=rewards, **decode_kwargs
        )

    def cancel(self, entries: Sequence[Entry], reason: DropReason, *, step: int, split: str) -> None:
        self.reservations.cancel(entries, reason, split=split, step=step)
