"""TraceClient: fire-and-forget logging from Ray actors and tasks to a `TraceCollector`.

The caller's thread validates, encodes, selects (`_local.py`) and appends to a bounded buffer;
a background thread ships batches, whose completions arrive as future callbacks. The data path,
its bounds and its drop reasons: docs/distributed.md.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Literal

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

try:
    from ray.exceptions import ActorUnavailableError
except ImportError:  # older Ray: a restarting actor fails calls with RayActorError instead

    class ActorUnavailableError(RayActorError):  # type: ignore[no-redef]
        """Never raised: stands in for the class on Ray versions without it."""


from .._checks import (
    MAX_STEP,
    check_encoding,
    check_flags,
    check_int,
    check_ints,
    check_seconds,
    check_step,
    check_timeout,
    wait_arg,
)
from .._engine.ledger import Ledger
from .._records.encode import as_list, encode_samples
from .._records.groups import GroupKey
from .._records.types import Sample, SampleLike
from .._security import describe, logger
from .._select.base import Sampler
from .._select.watch import Watch
from .._stats import Counts, DropReason
from ._local import PLAIN, LocalSelection, Released
from ._outbox import Call, Outbox

__all__ = ["ClientStats", "TraceClient"]


@dataclass(frozen=True, slots=True)
class ClientStats(Counts):
    """A consistent snapshot of one client's accounting; at every moment
    ``submitted == delivered + in_flight + buffered + held + sum(dropped.values())``.
    How it adds up with the collector's: docs/distributed.md, *Accounting across processes*.
    """

    submitted: int = 0
    delivered: int = 0
    in_flight: int = 0
    buffered: int = 0
    held: int = 0
    dropped: Mapping[str, int] = field(default_factory=dict)
    held_bytes: int = 0
    calls: int = 0
    bytes_shipped: int = 0
    collector_gone: bool = False
    closed: bool = False
    last_error: str | None = None

    PARTS: ClassVar[tuple[str, ...]] = ("delivered", "in_flight", "buffered", "held")


# How long a new client waits for the collector to say which cap and sampler it applies.
SELECTION_TIMEOUT = 30.0


def _describe(exc: BaseException) -> str:
    # First line only (remote tracebacks are long), scrubbed of credentials like every message.
    return describe(exc).splitlines()[0]


class TraceClient:
    """Logs samples from inside a Ray actor or task to a `TraceCollector`, never blocking the caller.

    Its arguments (batching, bounds, local selection) and what they do: docs/distributed.md.
    Use it as a context manager in tasks so the tail is shipped before the task returns.
    """

    def __init__(
        self,
        collector: ActorHandle[Any],
        *,
        batch_size: int = 256,
        max_batch_bytes: int = 8 * 2**20,
        flush_interval: float = 0.5,
        max_in_flight: int = 2,
        max_buffered: int = 10_000,
        max_buffered_bytes: int = 64 * 2**20,
        close_timeout: float = 10.0,
        on_invalid: Literal["raise", "skip"] = "raise",
        redact: Callable[[Sample], Sample] | None = None,
        select_locally: bool = True,
        max_open_steps: int = 0,
        step_timeout: float | None = 5.0,
    ) -> None:
        _check_arguments(locals())

        self.collector = collector
        self.batch_size = batch_size
        self.max_batch_bytes = max_batch_bytes
        self.flush_interval = float(flush_interval)
        self.max_in_flight = max_in_flight
        self.max_buffered = max_buffered
        self.max_buffered_bytes = max_buffered_bytes
        self.close_timeout = float(close_timeout)
        self.on_invalid = on_invalid
        self.redact = redact

        # One lock guards every field below; two conditions share it: `_work` wakes the
        # shipping thread, `_progress` wakes callers waiting in flush().
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._progress = threading.Condition(self._lock)
        self._out = Outbox(batch_size, max_batch_bytes, self.flush_interval, max_in_flight)
        # The engine's ledger counts submitted and dropped samples, and warns once per reason;
        # what the collector took is `written` there, as this client's one sink.
        self._ledger = Ledger((), None, owner="client", quiet=("closed", "capped"))
        self._n_calls = self._bytes_shipped = 0
        self._gone = self._closing = self._stopping = False
        self._last_error: str | None = None
        self._thread: threading.Thread | None = None
        # Held by the close() that drains; a second close() waits on it for that one's outcome.
        self._close_lock = threading.Lock()
        self._closed = False  # a close() ran to its end: its deadline is spent, not to be repeated
        self._closer: int | None = None  # the thread running the close() under way
        self._local, group_keys = (
            _ask_selection(collector, max_open_steps, step_timeout) if select_locally else (None, ())
        )
        sampler = self._local.sampler if self._local is not None else None
        self._score_needed_by = type(sampler).__name__ if sampler and sampler.needs_score else None
        # The keys the collector session's group samplers read (its cap's, its tiers'): a sample
        # none of them can name a group of is invalid here, as in the session.
        self._group_keys: tuple[GroupKey, ...] = group_keys
        _open_clients.add(self)

    def __repr__(self) -> str:
        return f"TraceClient({self.stats().summary()})"

    def __reduce__(self) -> Any:
        # A client owns a thread and a buffer of this process; a copy elsewhere would be a
        # second, silent one. Say what to do instead of failing somewhere inside pickle.
        raise TypeError(
            "a TraceClient cannot be sent to another process; pass the collector handle and "
            "create the TraceClient inside the actor or task"
        )

    # -- caller side (any thread) -----------------------------------------------------------

    def log_samples_nowait(
        self,
        samples: SampleLike | Iterable[SampleLike],
        *,
        step: int,
        split: str = "train",
    ) -> int:
        """Validate, encode and buffer samples for shipping; never blocks. Returns how many were accepted.

        Raises `RecordError` for an invalid sample (nothing of the call is kept) unless
        ``on_invalid="skip"``. Samples that do not fit the local bound, or arrive after `close()`
        or after the collector died, are dropped and counted in `stats().dropped`; with local
        selection, the count is of the call's samples kept for now (a held candidate can still
        be displaced by a better one before its step closes).
        """
        check_step(step, split)
        items = as_list(samples)
        if self._closing or self._gone:
            # Nothing will be shipped: skip the encoding, only count.
            with self._lock:
                self._ledger.submitted += len(items)
                self._ledger.drop("closed" if self._closing else "collector_gone", len(items))
            return 0
        # Validated and encoded in the caller, as the session does.
        skipped: list[int] = []
        encoded, invalid = encode_samples(
            items,
            redact=self.redact,
            skip_invalid=self.on_invalid == "skip",
            max_bytes=self.max_batch_bytes,
            bound="max_batch_bytes",
            score_needed_by=self._score_needed_by,
            group_keys=self._group_keys,
            skipped=skipped,
        )
        watched = self._watched(items, skipped, split, step) if encoded else set()
        nbytes = sum(len(p) for p, _ in encoded)
        now = time.monotonic()
        with self._lock:
            ledger = self._ledger
            ledger.submitted += len(items)
            ledger.drop("invalid", invalid)
            if self._closing or self._gone:
                ledger.drop("closed" if self._closing else "collector_gone", len(encoded))
                return 0
            out = self._out
            held, held_bytes = self._held()
            keep, nbytes = out.fit(
                encoded, nbytes, self.max_buffered - held, self.max_buffered_bytes - held_bytes
            )
            ledger.drop("queue_full", len(encoded) - keep)
            encoded = encoded[:keep]
            if not encoded:
                return 0
            if self._local is None:
                accepted = len(encoded)
                ship: list[Released] = [(split, step, PLAIN, [p for p, _ in encoded], [])]
            else:
                marked = [e for i, e in enumerate(encoded) if i in watched] if watched else []
                if marked:
                    encoded = [e for i, e in enumerate(encoded) if i not in watched]
                accepted, capped, ship = self._local.offer(split, step, encoded, now, marked)
                ledger.drop("capped", capped)
            self._wake(out.append(ship, now))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="asynctrace-ray-client", daemon=True)
                self._thread.start()
            return accepted

    def _watched(self, items: Sequence[Any], skipped: list[int], split: str, step: int) -> set[int]:
        """The places, among the call's encoded samples, of those the collector session's watch
        list passes by, within this client's share of the step's watch budget (counted now)."""
        watch = self._local.watch if self._local is not None else None
        if watch is None:
            return set()
        if skipped:
            left_out = set(skipped)
            items = [obj for i, obj in enumerate(items) if i not in left_out]
        return set(watch.split(items, split, step)[0])

    def end_step(self, step: int, split: str | None = None) -> None:
        """Ship the candidates of every step up to `step` (of `split`, or of every split) now; a
        sample logged later for one of them starts a new selection (docs/distributed.md). Never
        blocks; without local selection it does nothing."""
        check_int("step", step, minimum=0, maximum=MAX_STEP)
        if split is not None:
            check_step(step, split)
        with self._lock:
            if self._local is not None:
                self._wake(self._out.append(self._local.end_step(step, split), time.monotonic()))

    def _held(self) -> tuple[int, int]:
        """Candidates held by the local selection, as (samples, bytes) (lock held)."""
        return (0, 0) if self._local is None else (self._local.held, self._local.held_bytes)

    def flush(self, timeout: float | None = None) -> bool:
        """Ship everything buffered now and wait until each sample logged before the call was
        delivered to the collector (counted there; ``collector.flush.remote()`` waits until they
        are written) or dropped. Returns False when `timeout` passed first."""
        timeout = check_timeout(timeout)
        with self._lock:
            if self._local is not None:
                # Every step held here is complete as far as this flush is concerned.
                self._wake(self._out.append(self._local.close_all(), time.monotonic()))
            target = self._out.next_seq
            if target > self._out.flush_target:
                self._out.flush_target = target
                self._work.notify()
            limit = None if timeout is None else wait_arg(timeout)
            return self._progress.wait_for(lambda: self._out.watermark() >= target, limit)

    def close(self, timeout: float | None = None) -> ClientStats:
        """Stop accepting samples, ship what is buffered within `timeout` (default `close_timeout`),
        and return the final stats. Idempotent (docs/distributed.md). What is still buffered at
        the deadline is dropped as ``"close_timeout"``; calls in flight stay `in_flight`."""
        timeout = check_timeout(timeout)
        budget = self.close_timeout if timeout is None else timeout
        with self._lock:
            self._closing = True
        _open_clients.discard(self)
        # Waiting for a close() under way keeps its drain whole (a shorter deadline here would
        # drop what it is still shipping); after one that ended, the calls still in flight are
        # waiting on an unresponsive collector, and waiting for them again would only repeat
        # a deadline already spent.
        me = threading.get_ident()
        if self._closer == me:
            # Re-entered on the thread already closing (a signal handler that closes the
            # client): that close() is draining, and waiting for it here would never end.
            return self.stats()
        with self._close_lock:
            if not self._closed:
                self._closer = me
                try:
                    self._drain_and_stop(budget)
                    self._closed = True
                finally:
                    self._closer = None
        return self.stats()

    def _drain_and_stop(self, budget: float) -> None:
        """Ship what is buffered within `budget`, drop the rest, and tell the thread to stop."""
        flushed = self.flush(budget)
        with self._lock:
            if not flushed and self._out:
                n = self._clear_buffer()
                self._ledger.drop("close_timeout", n)
                logger.warning(
                    "asynctrace: TraceClient.close() reached its %.1fs deadline; "
                    "%d buffered samples were dropped",
                    budget,
                    n,
                )
            self._stopping = True
            self._work.notify()

    def _abandon(self) -> tuple[int, int]:
        """Stop without making any Ray call: count what is buffered as ``"not_closed"``.

        Returns (samples dropped, calls' samples still in flight, whose fate is unknown).
        """
        with self._lock:
            self._closing = True
            self._stopping = True
            n = self._clear_buffer(discard=True)
            self._ledger.drop("not_closed", n)
            self._work.notify()
            return n, self._out.in_flight

    def stats(self) -> ClientStats:
        """A consistent snapshot of this client's accounting."""
        with self._lock:
            held, held_bytes = self._held()
            return ClientStats(
                submitted=self._ledger.submitted,
                delivered=self._ledger.written,
                in_flight=self._out.in_flight,
                buffered=self._out.buffered,
                held=held,
                dropped=dict(self._ledger.dropped),
                held_bytes=self._out.buffered_bytes + self._out.in_flight_bytes + held_bytes,
                calls=self._n_calls,
                bytes_shipped=self._bytes_shipped,
                collector_gone=self._gone,
                closed=self._closing,
                last_error=self._last_error,
            )

    def __enter__(self) -> TraceClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- bookkeeping (lock held) ------------------------------------------------------------

    def _wake(self, wake: bool) -> None:
        if wake:
            self._work.notify()

    def _clear_buffer(self, discard: bool = False) -> int:
        """Forget what is buffered (and with `discard` what the local selection holds); returns how many."""
        n = self._out.clear() + (self._local.discard() if discard and self._local is not None else 0)
        self._progress.notify_all()
        return n

    def _due_in(self, now: float) -> float | None:
        """Seconds until the next batch should go; 0 when one should go now, None when idle."""
        idle = self._local.next_due(now) if self._local is not None else None
        ship = self._out.ship_due(now, self._stopping)
        if idle is None or (ship is not None and ship <= idle):
            return ship
        # Waking for idle steps: the loop closes them, then asks again.
        return max(idle, 1e-3)

    # -- shipping thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while True:
                        now = time.monotonic()
                        if self._local is not None:
                            if self._gone:
                                self._ledger.drop("collector_gone", self._local.discard())
                            else:
                                self._out.append(self._local.close_idle(now), now)
                        if self._gone and self._out:
                            self._ledger.drop("collector_gone", self._clear_buffer())
                        if self._stopping and not self._out:
                            return
                        due = self._due_in(now)
                        if due == 0.0:
                            call_id, call, wire = self._out.take_batch()
                            break
                        self._work.wait(due)
                self._ship(call_id, call, wire)
        except BaseException as exc:  # pragma: no cover - a bug; never let samples vanish silently
            logger.exception("asynctrace: TraceClient shipping thread failed")
            with self._lock:
                self._last_error = _describe(exc)
                self._gone = True
                self._ledger.drop("ship_error", self._clear_buffer(discard=True))

    def _ship(self, call_id: int, call: Call, wire: list[Released]) -> None:
        try:
            ref: Any = self.collector.ingest_parts.remote(wire)
            future: Future[Any] = ref.future()
        except Exception as exc:  # Ray not connected in this process, or shutting down
            self._finish_call(call_id, exc, "ship_error")
            return
        with self._lock:
            self._n_calls += 1
            self._bytes_shipped += call.nbytes
        # The callback runs on a Ray thread (or right here when already done).
        future.add_done_callback(lambda f: self._finish_call(call_id, *_outcome(f)))

    def _finish_call(self, call_id: int, exc: BaseException | None, reason: DropReason | None) -> None:
        with self._lock:
            call = self._out.finish(call_id)
            if call is None:
                return
            if reason is None:
                self._ledger.written += call.n
            else:
                self._last_error = _describe(exc) if exc is not None else reason
                if reason == "collector_gone":
                    self._gone = True
                self._ledger.drop(reason, call.n)
            self._progress.notify_all()
            self._work.notify()


def _check_arguments(a: dict[str, Any]) -> None:
    """Check `TraceClient`'s arguments (its `locals()`), each with a clear error naming it."""
    if not isinstance(a["collector"], ActorHandle):
        raise ValueError(
            f"collector must be a TraceCollector actor handle, got {type(a['collector']).__name__}"
        )
    ints = ("batch_size", "max_batch_bytes", "max_in_flight", "max_buffered", "max_buffered_bytes")
    check_ints(**{n: a[n] for n in ints})
    check_seconds("flush_interval", a["flush_interval"])
    check_seconds("close_timeout", a["close_timeout"])
    check_int("max_open_steps", a["max_open_steps"], minimum=0)
    check_seconds("step_timeout", a["step_timeout"], allow_none=True)
    check_flags(select_locally=a["select_locally"])
    check_encoding(a["on_invalid"], a["redact"])
    if a["max_buffered"] < a["batch_size"]:
        raise ValueError(
            f"max_buffered ({a['max_buffered']}) must be at least batch_size ({a['batch_size']})"
        )


def _outcome(future: Future[Any]) -> tuple[BaseException | None, DropReason | None]:
    """How a call ended: (None, None) when the collector ingested it, else the error and its reason."""
    try:
        future.result()
    except ActorUnavailableError as exc:
        # Ray is restarting the collector (max_restarts): later calls may succeed.
        return exc, "collector_unavailable"
    except RayActorError as exc:
        # The collector is dead for good. Whether it ingested this batch before it died is
        # unknowable, and its own counts died with it: the batch is counted here.
        return exc, "collector_gone"
    except BaseException as exc:
        return exc, "collector_error"
    return None, None


def _ask_selection(
    collector: ActorHandle[Any], max_open_steps: int, step_timeout: float | None
) -> tuple[LocalSelection | None, tuple[GroupKey, ...]]:
    """The local selection matching the collector's cap, sampler and watch list, as a part of its
    own (None when the collector has no cap, or cannot say: then every sample is shipped and
    selected there), and the group keys its session's selections read."""
    try:
        ref: Any = collector.selection.remote()
        answer: tuple[int | None, Sampler | None, int, Watch | None, tuple[GroupKey, ...]]
        answer = ray.get(ref, timeout=SELECTION_TIMEOUT)
        k, sampler, part, watch, keys = answer
    except Exception as exc:
        logger.warning(
            "asynctrace: TraceClient could not ask the collector for its cap (%s); "
            "every sample will be shipped and selected there",
            _describe(exc),
        )
        return None, ()
    if k is None or sampler is None:
        return None, keys
    local = LocalSelection(
        k, sampler, part, max_open_steps=max_open_steps, step_timeout=step_timeout, watch=watch
    )
    return local, keys


# Clients still open at interpreter exit: shipped from a driver, counted as lost elsewhere.
_open_clients: weakref.WeakSet[TraceClient] = weakref.WeakSet()


def _can_ship_at_exit() -> bool:
    """False in a process Ray started (an actor or a task) and wherever Ray is not connected."""
    try:
        from ray._private.worker import global_worker

        return bool(ray.is_initialized()) and global_worker.mode != ray.WORKER_MODE
    except Exception:  # pragma: no cover - a Ray without these names: do not risk a call
        return False


@atexit.register
def _close_open_clients() -> None:
    # In a Ray worker, Ray disconnects the process before Python's exit hooks run, and a remote
    # call made then ends the process on the spot, losing the buffer without a word. So there
    # nothing is shipped: what is lost is counted and logged, and close() is the way to ship.
    ship = _can_ship_at_exit()
    for client in list(_open_clients):
        try:
            if ship:
                client.close(min(client.close_timeout, 5.0))
                continue
            lost, in_flight = client._abandon()
            if lost or in_flight:
                logger.error(
                    "asynctrace: a TraceClient was not closed before its process exited: %d buffered "
                    "samples were lost (%d more were in flight); call client.close() before the "
                    "actor or task ends",
                    lost,
                    in_flight,
                )
        except Exception as exc:  # pragma: no cover - best effort at exit
            logger.error("asynctrace: closing a TraceClient at exit failed: %s", exc)
