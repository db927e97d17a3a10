"""TraceClient: fire-and-forget logging from Ray actors and tasks to a `TraceCollector`.

The caller's thread admits samples through the front engine (`_fronts/front.py`: checks,
encoding, this actor's part of each step's selection, counts) and appends what goes on to a
bounded buffer; a background thread ships batches, whose completions arrive as future
callbacks. The data path, its bounds and its drop reasons: docs/distributed.md.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Literal, NamedTuple

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
from .._fronts.front import Front
from .._fronts.selection import Encoded, Part, PartSelection, parts_of
from .._records.types import Sample, SampleLike
from .._runtime.exits import Phase, at_exit
from .._runtime.finishing import FinishOnce
from .._security import describe, logger
from .._stats import Counts, DropReason
from ._merge import ClientPlan
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

        plan = _ask_plan(collector) if select_locally else None
        selection = (
            PartSelection.streaming(
                plan.k,
                plan.sampler,
                plan.part,
                max_open_steps=max_open_steps,
                step_timeout=step_timeout,
                watch=plan.watch,
            )
            if plan is not None and plan.k is not None and plan.sampler is not None
            else None
        )
        # The front counts every sample; what the collector took is `handed_on` there. Its lock
        # guards every field below too; two conditions share it: `_work` wakes the shipping
        # thread, `_progress` wakes callers waiting in flush().
        self._front = Front(
            selection,
            sampler=selection.sampler if selection is not None else None,
            redact=redact,
            on_invalid=on_invalid,
            group_keys=plan.group_keys if plan is not None else (),
            owner="client",
            quiet=("closed", "capped"),
            max_bytes=max_batch_bytes,
            bound="max_batch_bytes",
        )
        self._lock = self._front.lock
        self._work = threading.Condition(self._lock)
        self._progress = threading.Condition(self._lock)
        self._out = Outbox(batch_size, max_batch_bytes, self.flush_interval, max_in_flight)
        self._n_calls = self._bytes_shipped = 0
        self._gone = self._closing = self._stopping = False
        self._last_error: str | None = None
        self._thread: threading.Thread | None = None
        self._finish: FinishOnce[ClientStats] = FinishOnce()
        _open_clients.add(self)
        _close_clients_at_exit()

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
        accepted = self._front.admit(
            samples,
            step=step,
            split=split,
            refused=self._refused,
            now=time.monotonic(),
            fit=self._fit,
            release=self._release,
        )
        if accepted and self._thread is None:
            with self._lock:
                self._start()
        return accepted

    def _refused(self) -> DropReason | None:
        """Why nothing more can be shipped, if so."""
        return "closed" if self._closing else "collector_gone" if self._gone else None

    def _fit(self, encoded: Sequence[Encoded]) -> int:
        """How many of a call's samples fit the bound on what this process holds: buffered, in
        flight (its memory until the collector answered) and held by the selection (lock held)."""
        selection = self._front.selection
        held, held_bytes = (selection.held, selection.held_bytes) if selection is not None else (0, 0)
        return self._out.fit(encoded, self.max_buffered - held, self.max_buffered_bytes - held_bytes)

    def _release(self, parts: list[Part], now: float) -> None:
        """Buffer what goes on (lock held)."""
        if self._out.append(parts, now):
            self._work.notify()
        if self._thread is None:
            self._start()

    def _start(self) -> None:
        """Start the shipping thread on first use (lock held)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="asynctrace-ray-client", daemon=True)
            self._thread.start()

    def end_step(self, step: int, split: str | None = None) -> None:
        """Ship the candidates of every step up to `step` (of `split`, or of every split) now; a
        sample logged later for one of them starts a new selection (docs/distributed.md). Never
        blocks; without local selection it does nothing."""
        check_int("step", step, minimum=0, maximum=MAX_STEP)
        if split is not None:
            check_step(step, split)
        with self._lock:
            selection = self._front.selection
            if selection is not None:
                self._wake(self._out.append(parts_of(selection.end(step, split)), time.monotonic()))

    def flush(self, timeout: float | None = None) -> bool:
        """Ship everything buffered now and wait until each sample logged before the call was
        delivered to the collector (counted there; ``collector.flush.remote()`` waits until they
        are written) or dropped. Returns False when `timeout` passed first."""
        timeout = check_timeout(timeout)
        with self._lock:
            selection = self._front.selection
            if selection is not None:
                # Every step held here is complete as far as this flush is concerned.
                self._wake(self._out.append(selection.close_all(), time.monotonic()))
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
        # Once (`_runtime/finishing.py`): a close() from another thread meanwhile waits for this
        # drain whole, a later one does not wait out a deadline already spent on calls stuck in
        # flight, and one re-entering on this thread (a signal handler) returns at once.
        self._finish.run(lambda: self._drain_and_stop(budget), self.stats)
        return self.stats()

    def _drain_and_stop(self, budget: float) -> ClientStats:
        """Ship what is buffered within `budget`, drop the rest, and tell the thread to stop."""
        flushed = self.flush(budget)
        with self._lock:
            if not flushed and self._out:
                n = self._clear_buffer()
                self._front.drop("close_timeout", n)
                logger.warning(
                    "asynctrace: TraceClient.close() reached its %.1fs deadline; "
                    "%d buffered samples were dropped",
                    budget,
                    n,
                )
            self._stopping = True
            self._work.notify()
        return self.stats()

    def _abandon(self) -> _Abandoned:
        """Stop without making any Ray call: count what is buffered as ``"not_closed"``."""
        with self._lock:
            self._closing = True
            self._stopping = True
            n = self._clear_buffer(discard=True)
            self._front.drop("not_closed", n)
            self._work.notify()
            return _Abandoned(n, self._out.in_flight)

    def stats(self) -> ClientStats:
        """A consistent snapshot of this client's accounting."""
        with self._lock:
            tally = self._front.tally()
            selection = self._front.selection
            out = self._out
            return ClientStats(
                submitted=tally.submitted,
                delivered=tally.handed_on,
                in_flight=out.in_flight,
                buffered=out.buffered,
                held=tally.held,
                dropped=tally.dropped,
                held_bytes=out.buffered_bytes
                + out.in_flight_bytes
                + (selection.held_bytes if selection is not None else 0),
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
        selection = self._front.selection
        n = self._out.clear() + (selection.discard() if discard and selection is not None else 0)
        self._progress.notify_all()
        return n

    def _due_in(self, now: float) -> float | None:
        """Seconds until the next batch should go; 0 when one should go now, None when idle."""
        selection = self._front.selection
        idle = selection.next_due(now) if selection is not None else None
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
                        selection = self._front.selection
                        if selection is not None:
                            if self._gone:
                                self._front.drop("collector_gone", selection.discard())
                            else:
                                self._out.append(selection.close_idle(now), now)
                        if self._gone and self._out:
                            self._front.drop("collector_gone", self._clear_buffer())
                        if self._stopping and not self._out:
                            return
                        due = self._due_in(now)
                        if due == 0.0:
                            call = self._out.take_batch()
                            break
                        self._work.wait(due)
                self._ship(call)
        except BaseException as exc:  # pragma: no cover - a bug; never let samples vanish silently
            logger.exception("asynctrace: TraceClient shipping thread failed")
            with self._lock:
                self._last_error = _describe(exc)
                self._gone = True
                self._front.drop("ship_error", self._clear_buffer(discard=True))

    def _ship(self, call: Call) -> None:
        try:
            ref: Any = self.collector.ingest_parts.remote(call.parts)
            future: Future[Any] = ref.future()
        except Exception as exc:  # Ray not connected in this process, or shutting down
            self._finish_call(call.id, _Outcome(exc, "ship_error"))
            return
        with self._lock:
            self._n_calls += 1
            self._bytes_shipped += call.nbytes
        # The callback runs on a Ray thread (or right here when already done).
        future.add_done_callback(lambda f: self._finish_call(call.id, _outcome(f)))

    def _finish_call(self, call_id: int, outcome: _Outcome) -> None:
        with self._lock:
            call = self._out.finish(call_id)
            if call is None:
                return
            if outcome.reason is None:
                self._front.handed_on(call.n)
            else:
                exc = outcome.error
                self._last_error = _describe(exc) if exc is not None else outcome.reason
                if outcome.reason == "collector_gone":
                    self._gone = True
                self._front.drop(outcome.reason, call.n)
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


class _Abandoned(NamedTuple):
    """What a client stopped without a Ray call left: samples dropped, and samples of calls still
    in flight, whose fate is unknown."""

    lost: int
    in_flight: int


class _Outcome(NamedTuple):
    """How a call ended: no reason when the collector ingested it, else the error and its reason."""

    error: BaseException | None
    reason: DropReason | None


def _outcome(future: Future[Any]) -> _Outcome:
    try:
        future.result()
    except ActorUnavailableError as exc:
        # Ray is restarting the collector (max_restarts): later calls may succeed.
        return _Outcome(exc, "collector_unavailable")
    except RayActorError as exc:
        # The collector is dead for good. Whether it ingested this batch before it died is
        # unknowable, and its own counts died with it: the batch is counted here.
        return _Outcome(exc, "collector_gone")
    except BaseException as exc:
        return _Outcome(exc, "collector_error")
    return _Outcome(None, None)


def _ask_plan(collector: ActorHandle[Any]) -> ClientPlan | None:
    """What the collector says a new client selects with (its cap, sampler, watch list, this
    client's part number, and the group keys its session reads); None when it cannot say: then
    every sample is shipped and selected there."""
    try:
        ref: Any = collector.selection.remote()
        plan: ClientPlan = ray.get(ref, timeout=SELECTION_TIMEOUT)
    except Exception as exc:
        logger.warning(
            "asynctrace: TraceClient could not ask the collector for its cap (%s); "
            "every sample will be shipped and selected there",
            _describe(exc),
        )
        return None
    return plan


# Clients still open at interpreter exit: shipped from a driver, counted as lost elsewhere.
_open_clients: weakref.WeakSet[TraceClient] = weakref.WeakSet()


def _can_ship_at_exit() -> bool:
    """False in a process Ray started (an actor or a task) and wherever Ray is not connected."""
    try:
        from ray._private.worker import global_worker

        return bool(ray.is_initialized()) and global_worker.mode != ray.WORKER_MODE
    except Exception:  # pragma: no cover - a Ray without these names: do not risk a call
        return False


@functools.cache  # once per process, after `import ray`: the registry then runs before Ray's own hook
def _close_clients_at_exit() -> None:
    at_exit(Phase.SHIP, _close_open_clients, "closing the open TraceClients")


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
