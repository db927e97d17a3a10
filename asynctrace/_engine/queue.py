"""The bounded queue: records and encoded bytes held from admission until every sink is done
with them, and the on_full policies that keep it within its bound."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import anyio

from .._records.types import MetricsItem, TraceRecord
from .._stats import MetricsDropReason
from .ledger import Batch, Ledger

if TYPE_CHECKING:
    from .._select.lane import Picked

__all__ = ["Admission", "Marker", "OnFull", "Queue", "Room", "Waiting"]

OnFull = Literal["block", "drop_newest", "drop_oldest"]


class Room:
    """Wakes whoever waits for the buffer to change (room freed, a submission queued or given
    up, the buffer closed): the one way every caller, on any thread, waits for it.

    A waiter subscribes first, then tries, then waits for its wake-up: a change between the
    try and the wait is never missed. Each subscription is woken once.
    """

    __slots__ = ("_lock", "_waiters")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: list[Callable[[], object]] = []

    def subscribe(self, wake: Callable[[], object]) -> None:
        with self._lock:
            self._waiters.append(wake)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def notify(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for wake in waiters:
            wake()


class Marker:
    """A flush marker: set once every sink has handled everything queued before it."""

    __slots__ = ("done", "lanes_left")

    def __init__(self, lanes: int) -> None:
        self.lanes_left = lanes
        self.done = anyio.Event()

    def arrive(self) -> None:
        self.lanes_left -= 1
        if self.lanes_left <= 0:
            self.done.set()


QueueItem = TraceRecord | Marker | MetricsItem


@dataclass(slots=True, eq=False)
class Waiting:
    """The records of one submission still waiting for room (block policy).

    Consumed from `start` on, in place: a huge submission that waits through many passes is
    never copied again. `gated`: not offered to a holding sampler yet (entering a held
    selection asks for room too). `lost` counts those that will not be queued after all
    (refused by the cap when offered, or given up): the caller's count leaves them out.
    """

    records: Sequence[TraceRecord]
    start: int
    gated: bool = False
    split: str = ""
    step: int = 0
    gaps: Sequence[int] | None = None
    groups: Sequence[Hashable | None] | None = None
    lost: int = 0
    ticket: int | None = None

    def __len__(self) -> int:
        return len(self.records) - self.start

    def rest(self) -> Sequence[TraceRecord]:
        return self.records[self.start :] if self.start else self.records


@dataclass(slots=True)
class Admission:
    """What happened to one submission."""

    accepted: int = 0
    waiting: Waiting | None = None  # block policy: no room yet
    wake: bool = False
    refused: int = 0  # waiting records the cap refused when they were offered at last


class Queue:
    """Bounded by records and encoded bytes; the writer's side of the buffer. One lock guards
    the queue and everything the buffer built on it keeps (the gate, the ledger)."""

    def __init__(
        self,
        size: int,
        max_bytes: int,
        on_full: OnFull,
        batch_size: int,
        clock: Callable[[], float],
        ledger: Ledger,
    ) -> None:
        self.queue_size = size
        self.max_bytes = max_bytes
        self.on_full = on_full
        self.batch_size = batch_size
        self.clock = clock
        self.ledger = ledger
        self.lock = threading.Lock()
        # Unresolved records that hold room: queued or dispatched, not yet resolved.
        self.depth = 0
        self.nbytes = 0
        self.items: deque[QueueItem] = deque()
        self.undispatched = 0
        self.first_undispatched_at: float | None = None
        self.control_items = 0
        # `log_metrics` items: the bytes they hold (part of nbytes), the calls no sink took, and
        # the bytes each sink's backlog holds, each within its share of the byte bound.
        self.metrics_bytes = 0
        self.metrics_dropped = 0
        lanes = len(ledger.sinks)
        self.metrics_held = [0] * lanes
        self.metrics_share = max_bytes // max(1, lanes)
        self.unstarted: deque[Batch] = deque()
        # Records and bytes held by batches drop_oldest cannot evict from: taken and not yet
        # offered for eviction, or started by a sink. What it could free is the rest.
        self.pinned_records = 0
        self.pinned_bytes = 0

    def fits(self, nbytes: int, n: int = 1) -> bool:
        """Room for `n` more records of `nbytes` bytes in all."""
        return self.depth + n <= self.queue_size and self.nbytes + nbytes <= self.max_bytes

    @property
    def pressed(self) -> bool:
        """Half the bound is taken: queued records should go out now, not at batch_size or
        flush_interval (a bound smaller than a batch would otherwise only drain on the timer)."""
        return self.depth * 2 >= self.queue_size or self.nbytes * 2 >= self.max_bytes

    def push(self, record: TraceRecord) -> bool:
        """Append one record, even past the bound; True when the writer should be woken."""
        self.items.append(record)
        self.depth += 1
        self.nbytes += record.nbytes
        self.undispatched += 1
        if self.undispatched == 1:
            self.first_undispatched_at = self.clock()
            return True
        return self.undispatched == self.batch_size or self.pressed

    def _evict_one_dispatched(self) -> bool:
        """Take the oldest record out of a batch no sink has started on yet."""
        self._forget_started()
        if not self.unstarted:
            return False
        batch = self.unstarted[0]
        record = batch.records.pop(0)
        batch.nbytes -= record.nbytes
        self.depth -= 1
        self.nbytes -= record.nbytes
        self.ledger.drop("queue_full", 1, (record,), displaced=True)
        return True

    def evict_for(self, nbytes: int, n: int = 1) -> bool:
        """drop_oldest: remove the oldest records no sink has started on until `n` records of
        `nbytes` bytes in all fit.

        Batches already handed to a slow sink's inbox are older than anything still queued, so
        they are evicted first; without that, a slow sink would hold most of the bound out of
        reach and drop_oldest would mostly drop the newest. When even evicting everything it can
        reach would not make room, it evicts nothing: only the new record is lost.
        """
        if (
            self.pinned_records + n > self.queue_size
            or self.pinned_bytes + self.metrics_bytes + nbytes > self.max_bytes
        ):
            return False
        while not self.fits(nbytes, n):
            if self._evict_one_dispatched():
                continue
            for i, item in enumerate(self.items):
                if isinstance(item, TraceRecord):
                    del self.items[i]
                    self.depth -= 1
                    self.nbytes -= item.nbytes
                    self.undispatched -= 1
                    self.ledger.drop("queue_full", 1, (item,), displaced=True)
                    break
            else:
                return False
        return True

    def enqueue(self, records: Sequence[TraceRecord], out: Admission, on_full: OnFull, start: int = 0) -> int:
        """Admit records from `start` on, in order, under the bound and the on_full policy.
        Returns where "block" stopped for want of room (len(records) when nothing waits)."""
        n = len(records) - start
        if n and self.depth + n <= self.queue_size:
            # The usual case, everything fits: one extend and one update of each counter.
            rest = records[start:] if start else records
            total = sum([len(r.payload) for r in rest])
            if self.nbytes + total <= self.max_bytes:
                self.items.extend(rest)
                self.depth += n
                self.nbytes += total
                before = self.undispatched
                self.undispatched = before + n
                if before == 0:
                    self.first_undispatched_at = self.clock()
                    out.wake = True
                elif before < self.batch_size <= before + n or self.pressed:
                    out.wake = True
                return len(records)
        for i in range(start, len(records)):
            record = records[i]
            if not self.fits(record.nbytes):
                if on_full == "block":
                    return i
                if on_full != "drop_oldest" or not self.evict_for(record.nbytes):
                    self.ledger.drop("queue_full", 1, (record,))
                    out.accepted -= 1
                    continue
            out.wake |= self.push(record)
        return len(records)

    # -- writer side (event-loop thread) -------------------------------------------------

    def push_item(self, item: Marker | MetricsItem) -> None:
        with self.lock:
            self.items.append(item)
            self.control_items += 1

    def admit_metrics(self, item: MetricsItem) -> bool:
        """Queue a `log_metrics` item for every sink whose backlog has room for it; False when
        no sink takes it (counted in `metrics_dropped`).

        It never waits and never evicts: metrics are the caller's own numbers, small and rarely
        worth a sample. Each sink's backlog (items it has not written yet) holds at most its
        share of the byte bound, `max_bytes / sinks`: a sink that hangs fills its own share and
        misses the calls after that (counted for it, "backlog_full"), while the others keep
        getting every call. The items all sinks hold together stay within the byte bound,
        records included.
        """
        nbytes = item.nbytes
        with self.lock:
            takers = frozenset(
                lane for lane, held in enumerate(self.metrics_held) if held + nbytes <= self.metrics_share
            )
            if not takers or self.nbytes + nbytes > self.max_bytes:
                self.metrics_dropped += 1
                return False
            for lane, counters in enumerate(self.ledger.sinks):
                if lane in takers:
                    self.metrics_held[lane] += nbytes
                else:
                    counters.metrics_dropped["backlog_full"] += 1
            item.lanes = takers
            item.lanes_left = len(takers)
            self.nbytes += nbytes
            self.metrics_bytes += nbytes
            self.items.append(item)
            self.control_items += 1
            return True

    def metrics_done(self, lane: int, item: MetricsItem, unsent: MetricsDropReason | None = None) -> bool:
        """Sink `lane` is done with a `log_metrics` item (`unsent`: it never got it, and why);
        True when the item's room was freed."""
        if not item.nbytes:
            return False
        with self.lock:
            if unsent is not None:
                self.ledger.sinks[lane].metrics_dropped[unsent] += 1
            self.metrics_held[lane] -= item.nbytes
            item.lanes_left -= 1
            if item.lanes_left:
                return False
            self.nbytes -= item.nbytes
            self.metrics_bytes -= item.nbytes
            return True

    def take(self) -> Batch | Marker | MetricsItem | None:
        """Pop the next batch (up to batch_size records) or control item."""
        with self.lock:
            items = self.items
            if not items:
                return None
            head = items[0]
            if not isinstance(head, TraceRecord):
                items.popleft()
                self.control_items -= 1
                return head
            records: list[TraceRecord]
            if not self.control_items:
                # Only records are queued: take them in bulk, without a check per record.
                if len(items) <= self.batch_size:
                    records = list(items)  # type: ignore[arg-type]
                    items.clear()
                else:
                    pop = items.popleft
                    records = [pop() for _ in range(self.batch_size)]  # type: ignore[misc]
            else:
                records = []
                while items and len(records) < self.batch_size and isinstance(items[0], TraceRecord):
                    records.append(items.popleft())  # type: ignore[arg-type]
            self.undispatched -= len(records)
            self.first_undispatched_at = self.clock() if self.undispatched else None
            batch = Batch(records, len(self.ledger.sinks))
            self._pin(batch)
            return batch

    def _pin(self, batch: Batch) -> None:
        batch.pinned = True
        self.pinned_records += len(batch.records)
        self.pinned_bytes += batch.nbytes

    def dispatched(self, batch: Batch) -> None:
        """The batch is in the sinks' inboxes (and spooled): drop_oldest may now evict from it."""
        if self.on_full == "drop_oldest":
            with self.lock:
                self.unstarted.append(batch)
                batch.pinned = False
                self.pinned_records -= len(batch.records)
                self.pinned_bytes -= batch.nbytes

    def start(self, batches: Sequence[Batch]) -> None:
        """A sink is about to write these batches: from now on they are out of eviction's reach."""
        with self.lock:
            for batch in batches:
                batch.started = True
                if not batch.pinned:
                    self._pin(batch)
            self._forget_started()

    def _forget_started(self) -> None:
        # Lanes start batches in order, so the started ones are at the front: forget them
        # here, or every batch ever written would stay referenced (with its payloads).
        unstarted = self.unstarted
        while unstarted and (unstarted[0].started or not unstarted[0].records):
            unstarted.popleft()

    def resolve(
        self, batch: Batch, lane: int, ok: bool, retries: int, error: str | None, picked: Picked | None = None
    ) -> bool:
        """One sink is done with a batch; True when room was freed. `picked`: what a selecting
        sink's selection made of the batch (see `Ledger.resolve`)."""
        with self.lock:
            if not self.ledger.resolve(batch, lane, ok, retries, error, picked):
                return False
            self.depth -= len(batch.records)
            self.nbytes -= batch.nbytes
            if batch.pinned:
                self.pinned_records -= len(batch.records)
                self.pinned_bytes -= batch.nbytes
            return True

    def undispatched_records(self) -> list[TraceRecord]:
        """Records still queued (not handed to any sink); spilled to the spool at finish."""
        with self.lock:
            return [item for item in self.items if isinstance(item, TraceRecord)]
