"""TraceCollector: the Ray actor that owns the job's one `TraceSession`.

Caps and samplers run here, over the whole step of the whole job: clients' parts of each step
are merged (`_merge.py`) before the session sees them. Two concurrency groups (``ingest`` and
``control``) keep a stalled sink from making it deaf to shutdown; see docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import Any, TypeVar, cast

import ray
from ray.actor import ActorHandle

from .._checks import check_seconds, check_timeout, wait_arg
from .._engine.engine import selection_group_keys
from .._fronts.selection import PLAIN, Part
from .._runtime.exits import Phase, at_exit
from .._runtime.shutdown import hand_on, hook_bound
from .._security import generated_run_name, logger
from .._session import TraceSession, hurry_finish
from .._stats import SessionStats
from .._sync import SyncTraceSession, log_payloads, log_within
from ..exceptions import SessionClosedError
from ._merge import ClientPlan, Merged, StepMerge
from ._sinkspec import build_sinks, check_sendable

__all__ = ["RemoteTraceCollector", "TraceCollector", "start_collector"]


_F = TypeVar("_F", bound=Callable[..., Any])


def _group(name: str) -> Callable[[_F], _F]:
    """`ray.method(concurrency_group=name)`, typed so the method keeps its own signature (Ray's
    stubs expect positional-only methods)."""
    return cast("Callable[[_F], _F]", ray.method(concurrency_group=name))


# Ray's stubs for `ray.remote` do not know `concurrency_groups`.
_remote: Any = ray.remote

# Threads serving the data path. Ingest work is mostly GIL-bound, so more threads do not add
# throughput; they exist so that a few calls waiting for room (block policy) do not stop others.
INGEST_CONCURRENCY = 4
# `flush`/`stats`/`finish` have threads of their own, so shutdown is never queued behind ingests.
CONTROL_CONCURRENCY = 2


_SKIP_ONLY = (
    "TraceCollector validates in the clients; its session counts what it still rejects as "
    "dropped, so the session's on_invalid must be 'skip'"
)


class TraceCollector:
    """Owns one `TraceSession` (sinks, caps, samplers, buffer) for every client of a job.

    Construct with ``TraceCollector.remote(project, run=None, **session_kwargs)`` (any
    `TraceSession` keyword; a sink that cannot be pickled is given as a `SinkSpec`, built here)
    or ``session_factory=`` (a picklable callable returning an unopened `TraceSession` with
    ``on_invalid="skip"``). Arguments, backpressure (`ingest_timeout`) and
    exits (`sigterm_timeout`): docs/distributed.md.
    """

    def __init__(
        self,
        project: str | None = None,
        run: str | None = None,
        *,
        session_factory: Callable[[], TraceSession] | None = None,
        ingest_timeout: float = 10.0,
        sigterm_timeout: float = 2.0,
        **session_kwargs: Any,
    ) -> None:
        check_seconds("ingest_timeout", ingest_timeout)
        check_seconds("sigterm_timeout", sigterm_timeout)
        if session_factory is not None:
            if project is not None or run is not None or session_kwargs:
                raise ValueError("give either session_factory or project/run/session keywords, not both")
            session = session_factory()
            if not isinstance(session, TraceSession):
                raise ValueError(f"session_factory must return a TraceSession, got {type(session).__name__}")
            if session.on_invalid != "skip":
                raise ValueError(_SKIP_ONLY + " (build it with on_invalid='skip')")
        else:
            if project is None:
                raise ValueError("TraceCollector needs a project (or a session_factory)")
            if session_kwargs.get("on_invalid", "skip") != "skip":
                raise ValueError(_SKIP_ONLY + " (set on_invalid on TraceClient)")
            session_kwargs["on_invalid"] = "skip"
            if "sinks" in session_kwargs:
                session_kwargs["sinks"] = build_sinks(session_kwargs["sinks"])
            session = TraceSession(project, run, **session_kwargs)
        self.ingest_timeout = float(ingest_timeout)
        self.sigterm_timeout = float(sigterm_timeout)
        self._blocking = session.on_full == "block"
        # The synchronous form runs the session's writer on its own event-loop thread, so it
        # keeps writing whatever Ray's threads are doing, and the core's exit hook covers it too.
        self._sync: SyncTraceSession = session.start()
        self._session = session
        # Parts of open steps from clients that select locally; `_merge_lock` guards them and is
        # held while a merged step is handed to the session, so `stats` never counts it twice.
        self._merge_lock = threading.Condition()
        self._merge: StepMerge | None = None
        # For the merge thread and the exit hook: no reference to the collector, so it can go.
        self._merging: _Merging | None = None
        self._merge_thread: threading.Thread | None = None
        self._parts = itertools.count(1)  # part 0 is a single process's own stream
        k = session.max_traces_per_step
        if k is not None:
            max_open_steps, step_timeout = session.step_rules
            self._merge = StepMerge(
                k,
                session.sampler,
                max_open_steps=max_open_steps,
                step_timeout=step_timeout,
                watch=session.watch,
            )
            # Ray may drop the actor's instance before the exit hooks run (`__ray_terminate__`):
            # the steps still merging then go to the session when the instance goes, so the
            # session's own exit drain writes them.
            self._merging = _Merging(self._merge, self._merge_lock, self._sync, ingest_timeout)
            weakref.finalize(self, self._merging.close_open, final=True)
        _collectors.add(self)
        _install_exit_hooks()

    # -- data path ----------------------------------------------------------------------------

    @_group("ingest")
    def ingest_encoded(self, groups: Iterable[Merged]) -> int:
        """Log samples encoded as `TraceClient` does, grouped by (split, step), as they are (no
        merge). Returns how many the session accepted (the rest are in its `dropped` counts)."""
        return self._plain(groups, time.monotonic() + self.ingest_timeout)

    @_group("ingest")
    def ingest_parts(self, groups: Iterable[Part]) -> int:
        """The wire method `TraceClient` calls: one client's parts of (split, step)s, with a row per
        sample for the merge (part -1: a client that does not select, taken as they are). Returns
        how many samples the session accepted, of those and of the steps this call closed.
        Watched samples (part -2) within the step's watch budget go to the session at once, in
        order with the merged steps, so its own watch list passes them (docs/distributed.md)."""
        deadline = time.monotonic() + self.ingest_timeout
        groups = list(groups)
        # Unpacked by place: a caller of this wire method may send plain tuples.
        if self._merge is None or all(part == PLAIN for _, _, part, _, _ in groups):
            # Nothing to merge: no lock, so calls waiting for room (block policy) wait side by side.
            return self._plain([Merged(split, step, p) for split, step, _, p, _ in groups], deadline)
        merge = self._merge
        with self._merge_lock:
            now = time.monotonic()
            merged: list[Merged] = []
            for split, step, part, payloads, rows in groups:
                if part == PLAIN or merge.closed:
                    # Not selected, or finishing: the session takes them as they are.
                    merged.append(Merged(split, step, payloads))
                else:
                    merged.extend(merge.add(split, step, part, payloads, rows, now))
            if merge.step_timeout is not None and not merge.closed:
                self._start_merge_thread()
                self._merge_lock.notify()
            return self._plain(merged, deadline)

    def _plain(self, groups: Iterable[Merged], deadline: float) -> int:
        # One deadline per call, shared by its groups: a call waits `ingest_timeout` at most.
        return _log_groups(self._sync, groups, deadline, self._blocking and self._sync.is_open)

    def _start_merge_thread(self) -> None:
        if self._merge_thread is None and self._merging is not None:
            self._merge_thread = threading.Thread(
                target=self._merging.close_idle, name="asynctrace-ray-merge", daemon=True
            )
            self._merge_thread.start()

    def _close_merge(self, *, final: bool) -> None:
        if self._merging is not None:
            self._merging.close_open(final=final, blocking=self._blocking and self._sync.is_open)

    def _with_merge(self, stats: SessionStats) -> SessionStats:
        """The session's stats with the merge's own counts (merge lock held): samples waiting for
        their step to close are pending, merged away ones dropped as capped, parts too late late."""
        merge = self._merge
        if merge is None:
            return stats
        dropped = dict(stats.dropped)
        for reason, n in (("capped", merge.capped), ("late", merge.late)):
            if n:
                dropped[reason] = dropped.get(reason, 0) + n
        return dataclasses.replace(
            stats,
            submitted=stats.submitted + merge.held + merge.capped + merge.late,
            pending=stats.pending + merge.held,
            dropped=dropped,
        )

    @_group("ingest")
    def ingest(self, samples: Any, *, step: int, split: str = "train") -> int:
        """Log samples sent as plain objects (one remote call per call). `TraceClient` is cheaper for
        the caller: it batches and ships encoded bytes."""
        items = list(samples) if isinstance(samples, (list, tuple)) else [samples]
        blocking = self._blocking and self._sync.is_open
        return log_within(
            self._sync, items, step=step, split=split, blocking=blocking, timeout=self.ingest_timeout
        )

    @_group("ingest")
    def log_metrics(self, metrics: Mapping[str, float], *, step: int) -> None:
        """Queue scalar metrics for `step` on the session."""
        self._sync.log_metrics(metrics, step=step)

    # -- control ------------------------------------------------------------------------------

    @_group("control")
    def ready(self) -> dict[str, Any]:
        """Where the collector writes: project, run, process id and node (also proves it started)."""
        return {
            "project": self._session.project,
            "run": self._session.run,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    @_group("control")
    def selection(self) -> ClientPlan:
        """What a new client selects its part of each step with: the cap, the sampler, the watch
        list and its part number, and the keys every group sampler of the session reads (its
        cap's, its tiers'; the client validates for them). No cap for the client (it ships
        everything, and the session applies its watch list itself) where the session has none,
        or has group metrics (`group_key=`), which count every sample of a step before the cap:
        a client that selected would ship only its candidates."""
        session = self._session
        k = session.max_traces_per_step
        keys = tuple(selection_group_keys(session.sampler if k is not None else None, session.sinks))
        if k is None or session.group_key is not None:
            return ClientPlan(None, None, 0, None, keys)
        with self._merge_lock:
            return ClientPlan(k, session.sampler, next(self._parts), session.watch, keys)

    @_group("control")
    def flush(self, timeout: float | None = None) -> bool:
        """Close open sampler steps and wait until everything ingested so far is written; False on timeout
        (or when a `finish` running meanwhile left samples unwritten)."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._close_merge(final=False)
            return self._sync.flush(timeout)
        except SessionClosedError:
            pass  # finish() has begun: its outcome is the answer, within this call's deadline
        final = self._sync.wait_finished(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return final is not None and final.pending == 0

    @_group("control")
    def stats(self) -> SessionStats:
        """The session's accounting: `submitted` counts every sample clients delivered (parts of
        steps not merged yet are `pending`, and what the merge leaves out is dropped ``"capped"``)."""
        with self._merge_lock:
            return self._with_merge(self._sync.stats())

    @_group("control")
    def finish(self, timeout: float | None = None) -> SessionStats:
        """Drain within `timeout` (default: the session's `finish_timeout`), close every sink, and
        return the final stats. Idempotent; later ingests are counted as dropped (``"closed"``)."""
        return self._finish(check_timeout(timeout))

    @_group("control")
    def close(self, timeout: float | None = None) -> SessionStats:
        """Same as `finish`."""
        return self._finish(check_timeout(timeout))

    def _finish(self, timeout: float | None, *, wait: float | None = None) -> SessionStats:
        """Finish within `timeout`. With `wait` (exit hooks), a finish already under way on another
        thread, maybe with a longer deadline, is cut short to this one's and waited for at most
        `wait` seconds; after that the stats are returned as they are."""
        if wait is not None and not self._sync.is_open:
            hurry_finish(self._session, self._session.finish_timeout if timeout is None else timeout)
            if self._sync.wait_finished(wait) is None:
                logger.error(
                    "asynctrace: the collector's session is still finishing after %.1fs; going on without it",
                    wait,
                )
                return self.stats()
        # Once only (later calls find the merge closed), and before the session drains.
        self._close_merge(final=True)
        finished = self._sync.finish(timeout)
        with self._merge_lock:
            return self._with_merge(finished)


# Graceful exits of the actor process run atexit hooks; ``ray.kill`` and ``ray.shutdown()`` run
# no code in it (docs/distributed.md, *Failures*). The SIGTERM handler is for a SIGTERM from
# outside Ray (a container stopping): it drains within `sigterm_timeout`, then hands over to
# Ray's own handler, which exits the process.
_collectors: weakref.WeakSet[TraceCollector] = weakref.WeakSet()
_sigterm_handled = False


@functools.cache  # once per process, however many collectors it hosts
def _install_exit_hooks() -> None:
    at_exit(Phase.OWNED, functools.partial(_finish_all, "exit"), "finishing the collector's session")
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        _finish_all("sigterm")
        # This hook runs once: a second SIGTERM goes straight to the handler that was there before.
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        hand_on(signum, frame, previous)

    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGTERM, on_sigterm)


def _finish_all(why: str) -> None:
    # At exit the session's own finish_timeout applies; whoever sends SIGTERM (a container
    # runtime, say) sends SIGKILL after a grace period, so the drain is cut to `sigterm_timeout`.
    global _sigterm_handled
    for collector in list(_collectors):
        # A finish() already under way (ray.get(collector.finish.remote(60))) is waited for only
        # as long as this one may take: the signal is handed on in time all the same. The exit
        # that follows a SIGTERM (Ray's handler exits the process) must not wait for that
        # finish again; a plain exit waits as long as a finish of its own would.
        timeout = collector.sigterm_timeout if why == "sigterm" else None
        budget = collector._session.finish_timeout if timeout is None else timeout
        wait = 0.0 if why == "exit" and _sigterm_handled else hook_bound(budget, final=True)
        try:
            collector._finish(timeout, wait=wait)
        except Exception as exc:  # pragma: no cover - best effort on the way out
            logger.error("asynctrace: finishing the collector's session failed: %s", exc)
    if why == "sigterm":
        _sigterm_handled = True


def _log_groups(
    sync: SyncTraceSession, groups: Iterable[Merged], deadline: float, blocking: bool = False
) -> int:
    """Log each group within one deadline shared by them all; returns how many the session accepted."""
    accepted = 0
    for split, step, payloads in groups:  # by place: `ingest_encoded` may get plain tuples
        accepted += log_payloads(sync, payloads, step=step, split=split, blocking=blocking, deadline=deadline)
    return accepted


@dataclasses.dataclass(frozen=True, slots=True)
class _Merging:
    """The collector's open steps (`merge`, guarded by `lock`) and the session they go to once
    merged, within `timeout`; it holds no reference to the collector, so the instance can go."""

    merge: StepMerge
    lock: threading.Condition
    sync: SyncTraceSession
    timeout: float

    def close_idle(self) -> None:
        """Merge steps whose parts stopped coming `step_timeout` seconds ago (its own thread)."""
        merge, lock = self.merge, self.lock
        with lock:
            while not merge.closed:
                now = time.monotonic()
                merged = merge.close_idle(now)
                if merged:
                    try:
                        _log_groups(self.sync, merged, now + self.timeout)
                    except Exception as exc:  # the session counts what it refused; carry on
                        logger.error("asynctrace: handing merged steps to the session failed: %s", exc)
                    continue
                due = merge.next_due(now)
                lock.wait(None if due is None else wait_arg(max(due, 1e-3)))

    def close_open(self, *, final: bool, blocking: bool = False) -> None:
        """Merge every open step and hand it to the session (flush); with `final` (finish, or the
        instance gone at exit) for good: clients' later parts go to the session as they are,
        which counts them as closed."""
        merge, lock = self.merge, self.lock
        try:
            with lock:
                if merge.closed:
                    return
                merged = merge.close_all()
                if final:
                    merge.closed = True
                    lock.notify_all()
                _log_groups(self.sync, merged, time.monotonic() + self.timeout, blocking)
        except Exception as exc:  # the session counts what it refused; flush or finish all the same
            logger.error("asynctrace: handing merged steps to the session failed: %s", exc)


# The plain class above keeps its module-level name, so Ray's workers import it by reference
# instead of pickling it by value.
RemoteTraceCollector: Any = _remote(
    concurrency_groups={"ingest": INGEST_CONCURRENCY, "control": CONTROL_CONCURRENCY},
)(TraceCollector)
"""`asynctrace.ray.TraceCollector`: the class below as a Ray actor; make it with `start_collector`
(or ``TraceCollector.remote(...)``) and call its methods with ``.remote(...)``."""


def start_collector(
    project: str | None = None,
    run: str | None = None,
    *,
    actor_options: Mapping[str, Any] | None = None,
    finish_at_exit: bool = True,
    exit_timeout: float = 30.0,
    ready_timeout: float = 120.0,
    **collector_kwargs: Any,
) -> ActorHandle[Any]:
    """Start a `TraceCollector`, wait until its session is open, and return its handle.

    Errors in the session's configuration surface here rather than in the first client. Sinks
    are sent to the actor pickled (the built-in ones can be, before they are opened); one that
    cannot be is given as a `SinkSpec`, or the session comes from a `session_factory`. With
    `finish_at_exit`, the driver finishes the collector when it exits normally; before an
    explicit ``ray.shutdown()``, call ``ray.get(collector.finish.remote())`` yourself.
    """
    if run is None and collector_kwargs.get("session_factory") is None:
        # Named here, not in the actor: a collector that Ray restarts (max_restarts) builds its
        # session again with the same arguments, and so resumes the same Trackio run.
        run = generated_run_name()
    if collector_kwargs.get("sinks") is not None:
        # Before Ray tries: its own error names neither the sink nor what to do instead.
        check_sendable(collector_kwargs["sinks"], ray.cloudpickle.dumps)
    actor_class = RemoteTraceCollector.options(**dict(actor_options or {}))
    handle: ActorHandle[Any] = actor_class.remote(project, run, **collector_kwargs)
    ray.get(handle.ready.remote(), timeout=ready_timeout)
    if finish_at_exit:
        ref = weakref.ref(handle)
        finish = functools.partial(_finish_from_driver, ref, exit_timeout)
        at_exit(Phase.REMOTE, finish, "finishing a collector from its driver")
    return handle


def _finish_from_driver(ref: weakref.ref[ActorHandle[Any]], timeout: float) -> None:
    handle = ref()
    # After ray.shutdown() a remote call would start a fresh local cluster: never do that.
    if handle is None or not ray.is_initialized():
        return
    try:
        ray.get(handle.finish.remote(timeout), timeout=timeout + 10.0)
    except Exception as exc:  # the collector may be gone already; nothing left to finish
        logger.debug("asynctrace: finishing the collector at exit: %s", exc)
