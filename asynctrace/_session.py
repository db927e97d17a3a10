"""TraceSession: the public entry point that ties encode → cap/sample → buffer → writer → sinks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import itertools
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Hashable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc
import sniffio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from . import _forks, _segments, _shutdown
from ._abandon import call_abandonable
from ._buffer import Buffer, Marker, MetricsItem, OnFull, Waiting
from ._checks import MAX_STEP, check_int, check_seconds, check_split, check_step, check_text, check_timeout
from ._group_metrics import GroupMetrics
from ._groups import GroupKey, group_of
from ._record import (
    UNKNOWN,
    Sample,
    SampleLike,
    TraceRecord,
    as_list,
    encode_checked,
    encode_samples,
    missing_score,
    preview_score,
    records_for,
)
from ._retry import NO_RETRY, RetryPolicy
from ._sampling import Gate, Sampler, SamplerName, resolve_sampler
from ._security import check_name, describe, shown
from ._spool import Durability, Spool
from ._stats import SessionStats
from ._sync import SyncTraceSession, _SyncRunner
from ._watch import Watch, WatchCounter
from ._writer import STOP_GRACE, Writer, close_grace, finish_bound
from .exceptions import AsyncTraceError, RecordError, SessionClosedError
from .sinks._base import Sink

if TYPE_CHECKING:
    from ._sampling import Entry
    from ._shutdown import _Hooks

__all__ = ["TraceSession"]

logger = logging.getLogger("asynctrace")


class _State(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"
    FORKED = "forked"  # a copy in a process forked from the session's own


_OPEN = _State.OPEN


# A coroutine function run as a task of the session (see TraceSession._run_jobs).
Job = Callable[[], Coroutine[Any, Any, None]]

_ON_FULL = ("block", "drop_newest", "drop_oldest")
_ON_INVALID = ("raise", "skip")
_DURABILITY = ("writer", "enqueue")
_DEFAULT_RETRY = RetryPolicy()


def _threadsafe_caller() -> Callable[[Callable[[], None]], None]:
    """A non-blocking way for other threads to run a callback on this event loop."""
    library = sniffio.current_async_library()
    if library == "asyncio":
        loop = asyncio.get_running_loop()

        def call(fn: Callable[[], None]) -> None:
            loop.call_soon_threadsafe(fn)

        return call
    if library == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()

        def call_trio(fn: Callable[[], None]) -> None:
            token.run_sync_soon(fn)

        return call_trio
    raise RuntimeError(f"unsupported async library {library!r}")


def _generated_run_name() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4]


class TraceSession:
    """Logs rollout traces without slowing the caller: validate and encode once, cap and sample,
    buffer within bounds, and write to every sink from a background writer with retries.

    Use it as ``async with TraceSession(...) as session`` or, from synchronous code, as
    ``with TraceSession(...) as session`` (its writer then runs on its own event-loop thread).

    With `spool_dir`, records are kept in a write-ahead spool until every sink has them, and a
    session started on a spool a killed one left behind delivers those records first (see
    docs/reliability.md): ``durability="writer"`` spools each batch as the writer takes it
    (nothing on the caller's path; a hard kill loses what was still queued in memory),
    ``"enqueue"`` spools before `log_samples` returns (a hard kill loses nothing accepted).
    `shutdown_hooks=True` drains the session on SIGTERM/SIGINT and at exit
    (see `asynctrace.install_shutdown_hooks`).
    """

    def __init__(
        self,
        project: str,
        run: str | None = None,
        *,
        sinks: Sequence[Sink] | None = None,
        max_traces_per_step: int | None = None,
        sampler: SamplerName | Sampler = "first",
        queue_size: int = 10_000,
        max_queue_bytes: int = 256 * 2**20,
        on_full: OnFull = "block",
        batch_size: int = 256,
        flush_interval: float = 1.0,
        retry: RetryPolicy | None = _DEFAULT_RETRY,
        finish_timeout: float = 30.0,
        trace_key: str = "{split}/traces",
        on_invalid: Literal["raise", "skip"] = "raise",
        max_open_steps: int = 2,
        watch: Watch | None = None,
        step_timeout: float | None = 300.0,
        redact: Callable[[Sample], Sample] | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        durability: Durability = "writer",
        replay: bool = True,
        shutdown_hooks: bool = False,
        health_metrics: bool = True,
        health_interval: float = 5.0,
        group_key: GroupKey | None = None,
    ) -> None:
        if not isinstance(project, str) or not project:
            raise ValueError(f"project must be a non-empty str, got {shown(project)}")
        check_name("project", project)
        if run is not None and (not isinstance(run, str) or not run):
            raise ValueError(f"run must be a non-empty str or None, got {shown(run)}")
        if run is not None:
            check_name("run", run)
        check_int("max_traces_per_step", max_traces_per_step, allow_none=True)
        check_int("queue_size", queue_size)
        check_int("max_queue_bytes", max_queue_bytes)
        check_int("batch_size", batch_size)
        check_int("max_open_steps", max_open_steps, minimum=0)
        check_seconds("flush_interval", flush_interval)
        check_seconds("finish_timeout", finish_timeout)
        check_seconds("step_timeout", step_timeout, allow_none=True)
        if on_full not in _ON_FULL:
            raise ValueError(f"on_full must be one of {_ON_FULL}, got {shown(on_full)}")
        if on_invalid not in _ON_INVALID:
            raise ValueError(f"on_invalid must be one of {_ON_INVALID}, got {shown(on_invalid)}")
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ValueError(f"retry must be a RetryPolicy or None, got {type(retry).__name__}")
        if not isinstance(trace_key, str) or not trace_key:
            raise ValueError(f"trace_key must be a non-empty str, got {shown(trace_key)}")
        check_text("trace_key", trace_key)
        try:
            trace_key.format(split="train")
        except Exception:  # KeyError, IndexError, ValueError, AttributeError ("{split.x}")
            # Not chained: the KeyError would quote a part of trace_key unscrubbed.
            raise ValueError(f"trace_key may only use the {{split}} field, got {shown(trace_key)}") from None
        if redact is not None and not callable(redact):
            raise ValueError("redact must be a callable taking and returning a Sample")
        if durability not in _DURABILITY:
            raise ValueError(f"durability must be one of {_DURABILITY}, got {shown(durability)}")
        if spool_dir is not None and not isinstance(spool_dir, (str, os.PathLike)):
            raise ValueError(f"spool_dir must be a path or None, got {type(spool_dir).__name__}")
        if spool_dir is not None and not os.fspath(spool_dir):
            raise ValueError("spool_dir must not be empty")
        check_seconds("health_interval", health_interval)
        if group_key is not None and not (
            callable(group_key)
            or isinstance(group_key, str)
            or (
                isinstance(group_key, (list, tuple))
                and group_key
                and all(isinstance(k, str) for k in group_key)
            )
        ):
            raise ValueError(
                "group_key must be a metadata key, a list of keys tried in order, or a function of "
                f"the metadata, got {shown(group_key)}"
            )
        for name, flag in (
            ("replay", replay),
            ("shutdown_hooks", shutdown_hooks),
            ("health_metrics", health_metrics),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {shown(flag)}")

        if sinks is None:
            from .sinks import TrackioSink

            sinks = [TrackioSink()]
        if isinstance(sinks, Sink):
            raise ValueError(f"sinks must be a list of sinks, got one {type(sinks).__name__}: pass [sink]")
        if isinstance(sinks, (str, bytes)) or not isinstance(sinks, Iterable):
            raise ValueError(f"sinks must be a list of asynctrace.Sink instances, got {type(sinks).__name__}")
        sinks = list(sinks)
        if not sinks:
            raise ValueError("sinks must name at least one sink (or be None for the default TrackioSink)")
        for sink in sinks:
            if not isinstance(sink, Sink):
                raise ValueError(f"sinks must be asynctrace.Sink instances, got {type(sink).__name__}")

        self.project = project
        self.run = run or _generated_run_name()
        self.sinks = sinks
        self.max_traces_per_step = max_traces_per_step
        self.sampler = resolve_sampler(sampler)
        self._group_key: GroupKey | None = getattr(self.sampler, "group_key", None)
        if watch is not None and not isinstance(watch, Watch):
            raise ValueError(f"watch must be an asynctrace.Watch, got {type(watch).__name__}")
        self.watch = watch
        self._watch = WatchCounter(watch) if watch is not None and max_traces_per_step is not None else None
        self.queue_size = queue_size
        self.max_queue_bytes = max_queue_bytes
        self.on_full = on_full
        self.batch_size = batch_size
        # log_samples yields to the writer once this many records wait for it (see there).
        self._yield_at = 2 * batch_size
        self._since_turn = 0
        self.flush_interval = float(flush_interval)
        self.retry = retry if retry is not None else NO_RETRY
        self.finish_timeout = float(finish_timeout)
        self.trace_key = trace_key
        self.on_invalid = on_invalid
        self.redact = redact
        self.durability = durability
        self.replay = replay
        self.shutdown_hooks = shutdown_hooks

        names: list[str] = []
        for sink in sinks:
            base = getattr(sink, "name", type(sink).__name__) or type(sink).__name__
            name, i = base, 2
            while name in names:
                name, i = f"{base}#{i}", i + 1
            names.append(name)
            sink.bind(project, self.run)
        self.sink_names = names
        # The step-closing rules, which a `Selected` sink's own selection follows too.
        self._step_rules = (max_open_steps, step_timeout)
        self._health_interval = float(health_interval) if health_metrics else None
        self._groups = (
            GroupMetrics(group_key, max_open_steps=max_open_steps, step_timeout=step_timeout)
            if group_key is not None
            else None
        )

        gate = (
            Gate(
                max_traces_per_step,
                self.sampler,
                max_open_steps=max_open_steps,
                step_timeout=step_timeout,
            )
            if max_traces_per_step is not None
            else None
        )
        # The sampler's name when it ranks by score (every sample then needs one), else None.
        needs_score = gate is not None and self.sampler.needs_score
        self._score_needed_by = type(self.sampler).__name__ if needs_score else None
        # With a cap, encode only what it would keep (see _encode_kept); a redact callable
        # may change a score, so then everything is encoded first.
        self._precheck_cap = gate is not None and redact is None
        self._buffer = Buffer(
            queue_size=queue_size,
            max_bytes=max_queue_bytes,
            on_full=on_full,
            batch_size=batch_size,
            gate=gate,
            sink_names=names,
            clock=time.monotonic,
        )
        self._buffer.on_drop = self._note_drop
        self._warned: set[str] = set()
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:12]
        self._spool = (
            Spool(spool_dir, project=project, run=self.run, session=self._id_prefix, durability=durability)
            if spool_dir is not None
            else None
        )
        # durability="enqueue": callers write their records to the spool before returning.
        self._spool_sync = self._spool is not None and durability == "enqueue"
        # Set by `asynctrace recover`: replay another (project, run)'s records, dead letters too.
        self._replay_from: tuple[str, str] | None = None
        self._replay_dead = False
        self._replay_quiet = False
        self._hooks: _Hooks | None = None
        # Jobs other threads and signal handlers start in the session's task group (see _run_jobs).
        self._jobs: MemoryObjectSendStream[Job] | None = None
        self._keys: dict[str, str] = {}
        self._state = _State.UNOPENED
        self._pid = os.getpid()
        self._loop_thread: int | None = None
        self._call_soon: Callable[[Callable[[], None]], None] | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._writer: Writer | None = None
        self._room_event: anyio.Event | None = None
        self._async_waiters = 0
        self._finishing: anyio.Event | None = None
        # The drain of a finish() under way, and its budget and deadline, which `_hurry` may cut.
        self._drain_scope: anyio.CancelScope | None = None
        self._finish_budget = 0.0
        self._finish_deadline = 0.0
        # Set once finish() is done, for waiters on other threads (a signal handler).
        self._closed_event = threading.Event()
        # Run on the loop, through its own callback machinery, once finish() is done.
        self._after_finish: list[Callable[[], None]] = []
        self._final: SessionStats | None = None
        self._sync: _SyncRunner | None = None
        self._opening_sync = False

    @property
    def step_rules(self) -> tuple[int, float | None]:
        """When the sampler closes a step: (max_open_steps, step_timeout), as configured."""
        return self._step_rules

    def __repr__(self) -> str:
        return f"TraceSession(project={self.project!r}, run={self.run!r}, state={self._state.value})"

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> TraceSession:
        if self._state is not _State.UNOPENED:
            raise SessionClosedError(f"a TraceSession can be opened once; this one is {self._state.value}")
        spool = self._spool
        scan: _segments.DirScan | None = None
        if spool is not None:
            scan = await anyio.to_thread.run_sync(spool.open)
            self._buffer.spool = spool
            self._buffer.spool_on_admit = self.durability == "enqueue"
        try:
            await self._start()
        except BaseException:
            if spool is not None:
                spool.close()
            raise
        if scan is not None:
            try:
                await self._replay_backlog(scan)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.__aexit__(None, None, None)
                raise
        if self.shutdown_hooks and not self._opening_sync:
            self._install_hooks()
        return self

    async def _start(self) -> None:
        self._loop_thread = threading.get_ident()
        self._call_soon = _threadsafe_caller()
        self._room_event = anyio.Event()
        self._writer = Writer(
            self._buffer,
            self.sinks,
            retry=self.retry,
            flush_interval=self.flush_interval,
            step_timeout=self._buffer.gate.step_timeout if self._buffer.gate else None,
            on_room=self._on_room,
            max_open_steps=self._step_rules[0],
            sink_step_timeout=self._step_rules[1],
            health_interval=self._health_interval,
            groups=self._groups,
        )
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._tg.start(self._writer.run)
        except BaseException:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            raise
        self._jobs, jobs = anyio.create_memory_object_stream[Job](math.inf)
        self._tg.start_soon(self._run_jobs, jobs)
        self._pid = os.getpid()
        self._state = _State.OPEN
        _forks.hold(self)

    async def _run_jobs(self, jobs: MemoryObjectReceiveStream[Job]) -> None:
        # Starting a task needs a task context (anyio detects the event loop from it), which a
        # loop callback scheduled by another thread or a signal handler does not have; this
        # task starts such jobs for them. It ends when finish() closes the stream.
        assert self._tg is not None
        async with jobs:
            async for job in jobs:
                self._tg.start_soon(job)

    def _submit_job(self, job: Job) -> bool:
        """Start `job` in the session's task group; event-loop thread only (use `_call_soon`)."""
        jobs = self._jobs
        if jobs is None:
            return False
        try:
            jobs.send_nowait(job)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return False
        return True

    async def _replay_backlog(self, scan: _segments.DirScan) -> None:
        """Deliver what a previous session left unacknowledged in the spool, ahead of new records."""
        spool = self._spool
        assert spool is not None
        for name, problem in scan.problems:
            logger.warning("asynctrace: spool file %s: %s", spool.directory / name, problem)
        source = self._replay_from or (self.project, self.run)
        others = {g: n for g, n in scan.groups().items() if g != source}
        if others and not self._replay_quiet:
            listed = ", ".join(f"{p}/{r} ({n})" for (p, r), n in sorted(others.items()))
            logger.warning(
                "asynctrace: the spool in %s holds unacknowledged records of other runs: %s; "
                "this session replays only its own; deliver them with `asynctrace recover %s`",
                spool.directory,
                listed,
                spool.directory,
            )
        if not self.replay:
            mine = scan.groups().get(source, 0)
            if mine:
                logger.warning(
                    "asynctrace: replay=False leaves %d unacknowledged records in the spool in %s",
                    mine,
                    spool.directory,
                )
            return

        def selects(f: _segments.FileScan) -> bool:
            wanted = f.kind == _segments.SEGMENT or (self._replay_dead and f.kind == _segments.DEAD)
            return wanted and (f.project, f.run) == source

        backlog = spool.backlog(scan, selects)
        total = 0
        while True:
            records = await anyio.to_thread.run_sync(next, backlog, None)
            if records is None:
                break
            total += len(records)
            adm = self._buffer.admit_replayed(records)
            if adm.wake:
                self._wake()
            if adm.waiting is not None:
                await self._wait_for_room(adm.waiting, None)
        if total:
            logger.info("asynctrace: replaying %d unacknowledged records from %s", total, spool.directory)

    def _install_hooks(self) -> None:
        if threading.current_thread() is threading.main_thread():
            _shutdown.install_shutdown_hooks(self)
        else:
            logger.warning(
                "asynctrace: shutdown_hooks=True but the session was opened off the main thread; "
                "only the exit hook is installed (Python runs signal handlers on the main thread)"
            )
            _shutdown._hooked.add(self)

    def _is_open(self) -> bool:
        return self._state is _State.OPEN

    def _is_closing(self) -> bool:
        return self._state is _State.CLOSING

    def _is_forked(self) -> bool:
        return self._state is _State.FORKED

    def _after_fork_in_child(self) -> None:
        # A forked child has the session's state but not its writer thread or task: what it
        # logged would wait forever in its copy of the buffer, and its finish() would wait for a
        # loop that is not there (unwinding a `with` block, or at exit). It refuses to log instead.
        self._state = _State.FORKED
        # The lock may have been held by a thread the child does not have.
        self._buffer.lock = threading.Lock()
        self._buffer.room = threading.Condition(self._buffer.lock)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._tg is not None
        if self._state is _State.FORKED:
            # The parent finishes the session. The child's copy of the task group waits on a
            # loop that forking left unusable (asyncio refuses to run it in a child at all).
            return
        try:
            # Shielded: a cancelled or crashing body must still drain and close every sink.
            with anyio.CancelScope(shield=True):
                await self.finish(timeout=self.finish_timeout)
        finally:
            # finish() stopped the writer, so the group only has to notice. The body's own
            # exception is not passed in: it propagates as it is, never wrapped in a group.
            self._tg.cancel_scope.shield = True
            await self._tg.__aexit__(None, None, None)

    def __enter__(self) -> SyncTraceSession:
        if self._state is not _State.UNOPENED:
            raise SessionClosedError(f"a TraceSession can be opened once; this one is {self._state.value}")
        self._opening_sync = True
        try:
            self._sync = _SyncRunner(self)
        finally:
            self._opening_sync = False
        if self.shutdown_hooks:
            self._install_hooks()
        return SyncTraceSession(self)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._sync is not None:
            self._sync.close(self.finish_timeout)

    def start(self) -> SyncTraceSession:
        """Open for synchronous use without a `with` block; call `finish()` on the result when done."""
        return self.__enter__()

    async def finish(self, timeout: float | None = None) -> SessionStats:
        """Drain within `timeout` (default `finish_timeout`), close every sink, and return the final stats.

        Idempotent. What was not delivered by the deadline stays counted as `pending`.
        """
        timeout = check_timeout(timeout)
        if self._state is _State.CLOSED:
            assert self._final is not None
            return self._final
        if self._state is _State.UNOPENED:
            raise SessionClosedError("the session was never opened; use `async with` or `with`")
        if self._state is _State.FORKED:
            return self.stats()  # the parent process finishes it
        self._check_loop_thread("finish")
        if self._finishing is not None:
            # Another finish() is under way: wait for its outcome, within this call's own bound.
            bound = finish_bound(self.finish_timeout if timeout is None else timeout)
            with anyio.CancelScope(shield=True), anyio.move_on_after(bound):
                await self._finishing.wait()
            return self._final if self._final is not None else self.stats()
        self._finishing = anyio.Event()
        budget = self.finish_timeout if timeout is None else float(timeout)
        with anyio.CancelScope(shield=True):
            start = anyio.current_time()
            deadline = start + budget
            self._state = _State.CLOSING
            self._buffer.close()
            self._on_room()
            self._finish_budget, self._finish_deadline = budget, deadline
            drained = False
            with anyio.CancelScope() as self._drain_scope:
                drained = await self._flush_until(deadline)
                if drained and self._writer is not None and self._writer.final_health():
                    # The health once more, counting everything the drain delivered.
                    await self._flush_until(deadline)
            self._drain_scope = None
            budget, deadline = self._finish_budget, self._finish_deadline
            writer = self._writer
            assert writer is not None and writer.scope is not None
            writer.scope.cancel()
            with anyio.move_on_after(STOP_GRACE):
                await writer.stopped.wait()
            if not writer.stopped.is_set():
                # A sink call that ignores its cancel is left running on its own (see _writer).
                logger.error(
                    "asynctrace: %s still running %.0fs after finish() cancelled it; "
                    "finish() goes on without it and leaves that call running. A sink's write "
                    "must be cancellable: use async I/O, or a thread it may abandon",
                    writer.still_running(),
                    STOP_GRACE,
                )
                writer.abandon()
                await writer.stopped.wait()
            if self._hooks is not None:
                self._hooks.uninstall()
            # Callers waiting for room were woken when the buffer closed, and rows log_rollouts
            # is still decoding cannot be queued any more: each holds a ticket until it has
            # counted its samples as "closed" (and acknowledged them in the spool). Wait for
            # that before the spool is closed and the final count is taken; bounded all the same.
            await self._until_queued(None, 1.0)
            spool = self._spool
            if spool is not None:
                # Whatever is still queued goes to the spool (durability="writer" had not
                # written it yet), so a later session or `asynctrace recover` delivers it.
                spool.stage(self._buffer.undispatched_records())
                try:
                    await anyio.to_thread.run_sync(spool.close)
                except Exception as exc:  # never a reason to leave the sinks' runs open
                    logger.error(
                        "asynctrace: closing the spool in %s failed: %s", spool.directory, describe(exc)
                    )
            # Closing gets what is left of the deadline, and at least a short grace, so a
            # slow drain can never skip finishing the runs the sinks opened.
            close_budget = max(deadline - anyio.current_time(), close_grace(budget))
            async with anyio.create_task_group() as tg:
                for sink, name in zip(self.sinks, self.sink_names, strict=True):
                    tg.start_soon(self._close_sink, sink, name, close_budget)
            stats = self.stats()
            if spool is not None and stats.pending:
                logger.warning(
                    "asynctrace: %d undelivered records stay in the spool in %s; the next session "
                    "on it (or `asynctrace recover`) delivers them",
                    spool.unresolved(),
                    spool.directory,
                )
            if not drained:
                logger.warning(
                    "asynctrace: finish() reached its %.1fs deadline with %d samples undelivered (%s)",
                    budget,
                    stats.pending,
                    stats.summary(),
                )
            elif stats.pending:
                # Drained in time, yet something is unresolved: not the deadline's doing.
                logger.warning(
                    "asynctrace: finish() ended with %d samples undelivered (%s)",
                    stats.pending,
                    stats.summary(),
                )
            elif stats.failed or stats.dropped_total - stats.dropped.get("capped", 0):
                logger.warning("asynctrace: session finished with losses: %s", stats.summary())
            self._final = stats
            self._state = _State.CLOSED
            _forks.release(self)
            if self._jobs is not None:
                self._jobs.close()
            self._finishing.set()
            self._closed_event.set()
            # After the state is CLOSED: a signal handler that saw CLOSING has added its
            # callback by now, and one that runs later sees CLOSED and hands on by itself.
            while self._after_finish:
                callback = self._after_finish.pop(0)
                if not _shutdown._call_soon(self, callback):
                    callback()
        return stats

    async def _hurry(self, timeout: float) -> None:
        """Cut the drain of a finish() under way to end within `timeout` seconds from now, and its
        close grace to match (a shutdown hook with a shorter deadline). A session job: run it
        with `_shutdown._schedule`."""
        scope = self._drain_scope
        deadline = anyio.current_time() + timeout
        if scope is not None and deadline < self._finish_deadline:
            self._finish_budget = min(self._finish_budget, timeout)
            self._finish_deadline = deadline
            scope.deadline = deadline

    async def _close_sink(self, sink: Sink, name: str, budget: float) -> None:
        with anyio.move_on_after(budget) as scope:
            try:
                # A close that ignores its cancel is left running on its own at the deadline.
                await call_abandonable(sink.close, grace=0.0)
            except Exception as exc:
                logger.error("asynctrace: closing sink %r failed: %s", name, describe(exc))
        if scope.cancelled_caught:
            logger.error("asynctrace: closing sink %r did not finish within %.1fs", name, budget)

    # -- submission ------------------------------------------------------------------------

    def _check_open(self) -> None:
        self._check_nowait()
        if self._state is not _State.OPEN:
            raise SessionClosedError("the session is finished; it accepts no more samples")

    def _check_nowait(self) -> None:
        # What even log_samples_nowait refuses (it counts samples after finish as "closed").
        if self._state is _State.UNOPENED:
            raise SessionClosedError("the session is not open yet; use `async with` or `with`")
        if self._state is _State.FORKED:
            raise SessionClosedError(
                f"this session belongs to process {self._pid}, which this process was forked "
                "from; a forked child cannot log through it (open a session in the child, or "
                "see docs/distributed.md to send samples to one session from many processes)"
            )

    def _key_for(self, split: str) -> str:
        key = self._keys.get(split)
        if key is None:
            # Once per split, not on every call: one a sink could not store is refused here.
            check_split(split)
            try:
                key = self.trace_key.format(split=split)
            except Exception:  # "{split[3]}" with a shorter split
                raise ValueError(
                    f"trace_key {shown(self.trace_key)} cannot be formatted with split {shown(split)}"
                ) from None
            self._keys[split] = key
        return key

    def _encode(
        self,
        samples: SampleLike | Iterable[SampleLike],
        step: int,
        split: str,
        *,
        precheck: bool = True,
        skipped: list[int] | None = None,
    ) -> tuple[list[TraceRecord], int, int, list[int] | None]:
        """Validate and encode samples once, in the caller; returns records, the invalid count,
        how many the cap refused before they were encoded (only with `precheck`) and, then, how
        many of those came right before each record (a positional sampler counts them). Without
        `precheck`, the indices of samples left out as invalid go to `skipped`."""
        if type(step) is not int or step < 0 or step > MAX_STEP or type(split) is not str or not split:
            check_step(step, split)  # raises, or accepts an int subclass
        items = samples if type(samples) is list else as_list(samples)
        key = self._keys.get(split) or self._key_for(split)
        if self._groups is not None and precheck:
            # Every sample the caller submitted, before the cap, counts for the group metrics
            # (log_rollouts' decoded rows, which come without `precheck`, are only the kept ones).
            closed = self._groups.observe(items, step, split, time.monotonic())
            for item in closed:
                self._buffer.push_item(item)
            if closed:
                self._wake()
        now = time.time()
        kept = self._encode_kept(items, step, split) if precheck and self._precheck_cap else None
        gaps: list[int] | None = None
        if kept is not None:
            encoded, invalid, refused, gaps = kept
        else:
            refused = 0
            encoded, invalid = encode_samples(
                items,
                redact=self.redact,
                skip_invalid=self.on_invalid == "skip",
                max_bytes=self.max_queue_bytes,
                score_needed_by=self._score_needed_by,
                skipped=skipped,
            )
        records = records_for(encoded, self._ids, self._id_prefix, step, split, key, now)
        return records, invalid, refused, gaps

    def _encode_kept(
        self, items: Sequence[Any], step: int, split: str
    ) -> tuple[list[tuple[bytes, float | None]], int, int, list[int]] | None:
        """Encode only the samples the cap would keep if offered now; None when that cannot be
        told cheaply (the caller then encodes everything). Also returns, per encoded sample, how
        many refused ones came right before it.

        A sample the cap refuses is counted as capped without being encoded or validated, as
        `log_rollouts` skips decoding rows it will not keep. The gate still decides at
        admission; a selection only gets harder to enter, so nothing refused here could have
        been kept there.
        """
        n = len(items)
        ranked_by = self._score_needed_by  # the sampler's name when it ranks by score
        skip = self.on_invalid == "skip"
        invalid: set[int] = set()
        if ranked_by is not None:
            scores: list[Any] = [
                # The common case inline: a Sample whose metadata holds a finite float reward.
                raw
                if type(obj) is Sample
                and obj.score is None
                and type(md := obj.metadata) is dict
                and type(raw := md.get("reward")) is float
                and math.isfinite(raw)
                else preview_score(obj)
                for obj in items
            ]
            if any(sc is UNKNOWN for sc in scores):
                return None
            for i, sc in enumerate(scores):
                if sc is None:
                    if not skip:
                        raise missing_score(i, ranked_by)
                    invalid.add(i)
        elif all(type(obj) is Sample or type(obj) is dict for obj in items):
            scores = [None] * n
        else:
            return None  # an unusual item gets the full path, and its error if it is wrong
        candidates = [i for i in range(n) if i not in invalid]
        encoded: dict[int, tuple[bytes, float | None]] = {}
        groups = self._groups_of(items) if self._group_key is not None else None
        while candidates:
            keeps = self._buffer.keeps(
                [scores[i] for i in candidates],
                split=split,
                step=step,
                groups=None if groups is None else [groups[i] for i in candidates],
            )
            if keeps is None:
                return None
            failed = False
            for i, keep in zip(candidates, keeps, strict=True):
                if not keep or i in encoded:
                    continue
                try:
                    pair = encode_checked(items[i], i, None, self.max_queue_bytes, "max_queue_bytes", None)
                except RecordError:
                    if not skip:
                        raise
                    invalid.add(i)
                    failed = True
                    continue
                if ranked_by is not None and pair[1] != scores[i]:
                    return None  # the preview misread this shape; let the full path decide
                encoded[i] = pair
            if not failed:
                break
            # An invalid sample takes no place, so one refused in its favour may fit now.
            candidates = [i for i in candidates if i not in invalid]
        gaps: list[int] = []
        if len(candidates) == n:  # nothing invalid: candidate positions are the indices
            last = -1
            for i in sorted(encoded):
                gaps.append(i - last - 1)
                last = i
        else:
            gap = 0
            for i in candidates:
                if i in encoded:
                    gaps.append(gap)
                    gap = 0
                else:
                    gap += 1
        return [encoded[i] for i in sorted(encoded)], len(invalid), n - len(invalid) - len(encoded), gaps

    def _groups_of(self, items: Sequence[Any]) -> list[Hashable | None]:
        """Each sample's prompt group, read from its metadata (a group sampler's `keeps` ranks by it)."""
        key = self._group_key
        assert key is not None
        out: list[Hashable | None] = []
        for obj in items:
            metadata = obj.metadata if type(obj) is Sample else obj.get("metadata", obj)
            if type(metadata) is dict and type(key) is tuple:
                # The common case inline (a call per sample is a measurable part of this path).
                for name in key:
                    value = metadata.get(name)
                    if value is not None:
                        out.append(tuple(value) if type(value) is list else value)
                        break
                else:
                    out.append(None)
            else:
                out.append(group_of(metadata, key) if isinstance(metadata, Mapping) else None)
        return out

    def _commit_spool(self, blocking: bool = True) -> None:
        spool = self._spool
        if spool is not None and (blocking or spool.has_staged):
            # Blocking, even with nothing staged: another thread's commit may have taken this
            # caller's records and still be writing them; taking the commit lock waits for it.
            spool.commit(blocking=blocking)

    def _on_loop_thread(self) -> bool:
        return threading.get_ident() == self._loop_thread

    def _check_loop_thread(self, what: str) -> None:
        # Its waits are on the session's own event loop: awaited from another thread's loop
        # they would break that loop's primitives (and the writer with them) instead of waiting.
        if self._loop_thread is not None and threading.get_ident() != self._loop_thread:
            raise AsyncTraceError(
                f"{what}() must be awaited on the event loop that opened the session; from another "
                "thread or event loop, use the session's blocking form (`with TraceSession(...)`), "
                "whose methods may be called from any thread"
            )

    def _wake(self) -> None:
        writer = self._writer
        if writer is None:
            return
        if self._on_loop_thread():
            writer.wake()
        elif self._call_soon is not None:
            # A closing loop raises RuntimeError: its writer no longer needs waking.
            with contextlib.suppress(RuntimeError):
                self._call_soon(writer.wake)

    async def _until_room(self) -> None:
        """Wait (event-loop thread) until buffer room is freed or the session closes."""
        event = self._room_event
        assert event is not None
        self._async_waiters += 1
        try:
            await event.wait()
        finally:
            self._async_waiters -= 1

    def _on_room(self) -> None:
        """Buffer room was freed (event-loop thread): wake callers waiting under `block`."""
        if self._async_waiters and self._room_event is not None:
            event, self._room_event = self._room_event, anyio.Event()
            event.set()

    def _note_drop(self, reason: str, n: int) -> None:
        # Called under the buffer lock: only bookkeeping and a first-time warning here.
        # Capping is the point of a cap, not a loss, so it is counted but not warned about.
        if reason != "capped" and reason not in self._warned:
            self._warned.add(reason)
            logger.warning("asynctrace: dropping samples (%s); counts are in session.stats().dropped", reason)

    async def log_samples(
        self,
        samples: SampleLike | Iterable[SampleLike],
        *,
        step: int,
        split: str = "train",
        timeout: float | None = None,
    ) -> int:
        """Validate, encode, cap and queue samples; returns how many were accepted.

        With ``on_full="block"`` this waits for room (at most `timeout` seconds, after which
        the rest are dropped as ``"queue_full"``); the drop policies never wait.
        """
        # Inline checks: after a training step every function this call touches runs cold,
        # and on the machines measured each costs microseconds (docs/performance.md).
        if self._state is not _OPEN:
            self._check_open()
        if timeout is not None:
            timeout = check_timeout(timeout)
        if threading.get_ident() != self._loop_thread:
            return await self._log_from_other_loop(samples, step, split, timeout)
        watched = 0
        if self._watch is not None:
            samples, watched = self._log_watched(samples, step, split)
        records, invalid, refused, gaps = self._encode(samples, step, split)
        adm = self._buffer.admit(
            records, split=split, step=step, nowait=False, invalid=invalid, refused=refused, gaps=gaps
        )
        if self._spool_sync:
            self._commit_spool()
        if adm.wake:
            self._wake()
        if adm.waiting is None:
            buf = self._buffer
            under_pressure = False
            if buf.pressed:
                self._since_turn += len(records) + invalid
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
        return watched + adm.accepted - await self._wait_for_room(adm.waiting, timeout)

    async def _wait_for_room(self, waiting: Waiting, timeout: float | None) -> int:
        """Admit `waiting` as room frees up; returns how many will not be queued after all
        (given up, or refused by the cap when they were offered at last)."""
        self._async_waiters += 1
        ticket = self._buffer.take_ticket()
        try:
            with anyio.move_on_after(timeout):
                while len(waiting):
                    event = self._room_event
                    assert event is not None
                    adm = self._buffer.admit_waiting(waiting)
                    if adm.wake:
                        self._wake()
                    if adm.waiting is not None and adm.waiting is not waiting:
                        waiting = adm.waiting  # what a sampler passed, waiting for the queue
                    if len(waiting):
                        await event.wait()
                return waiting.lost
            self._buffer.give_up_waiting(waiting, "queue_full")
            return waiting.lost
        except BaseException:
            if len(waiting):
                self._buffer.give_up_waiting(waiting, "cancelled")
            raise
        finally:
            self._async_waiters -= 1
            self._buffer.return_ticket(ticket)

    async def _log_from_other_loop(
        self, samples: SampleLike | Iterable[SampleLike], step: int, split: str, timeout: float | None
    ) -> int:
        """`await log_samples` on another thread's event loop: the blocking form in a worker
        thread, which a cancellation of the caller makes give up its wait for room."""
        cancelled = threading.Event()
        try:
            return await anyio.to_thread.run_sync(
                self._log_blocking, samples, step, split, timeout, cancelled, abandon_on_cancel=True
            )
        except BaseException:
            # The worker thread sees this at its next look at the buffer (within 0.25 s) and
            # counts what is still waiting for room as "cancelled", as the same call on the
            # session's own loop does.
            cancelled.set()
            raise

    def _log_blocking(
        self,
        samples: SampleLike | Iterable[SampleLike],
        step: int,
        split: str,
        timeout: float | None,
        cancelled: threading.Event | None = None,
    ) -> int:
        """The blocking form, for threads other than the session's event loop."""
        self._check_open()
        watched = 0
        if self._watch is not None:
            samples, watched = self._log_watched(samples, step, split)
        records, invalid, refused, gaps = self._encode(samples, step, split)
        buf = self._buffer
        # Under "block" this call may be left waiting for room: its ticket is taken before it
        # admits anything, so a flush() from another thread cannot slip in between.
        ticket = buf.take_ticket() if self.on_full == "block" else None
        try:
            adm = buf.admit(
                records,
                split=split,
                step=step,
                nowait=False,
                invalid=invalid,
                refused=refused,
                ticket=ticket,
                gaps=gaps,
            )
            if self._spool_sync:
                self._commit_spool()
            if adm.wake:
                self._wake()
            if adm.waiting is None:
                return watched + adm.accepted
            return watched + self._wait_blocking(adm.waiting, adm.accepted, timeout, cancelled)
        finally:
            if ticket is not None:
                buf.return_ticket(ticket)

    def _wait_blocking(
        self,
        waiting: Waiting,
        accepted: int,
        timeout: float | None,
        cancelled: threading.Event | None = None,
    ) -> int:
        buf = self._buffer
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(waiting):
            if cancelled is not None and cancelled.is_set():
                buf.give_up_waiting(waiting, "cancelled")
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                buf.give_up_waiting(waiting, "queue_full")
                break
            with buf.lock:
                # finish() gives up what is still waiting itself (Buffer.close): nothing left then.
                if len(waiting) and not buf.has_room(waiting) and not buf.closed:
                    buf.thread_waiters += 1
                    try:
                        buf.room.wait(timeout=0.25 if left is None else min(left, 0.25))
                    finally:
                        buf.thread_waiters -= 1
            adm = buf.admit_waiting(waiting)
            if adm.wake:
                self._wake()
            if adm.waiting is not None and adm.waiting is not waiting:
                waiting = adm.waiting  # what a sampler passed, waiting for the queue
        return accepted - waiting.lost

    def log_samples_nowait(
        self,
        samples: SampleLike | Iterable[SampleLike],
        *,
        step: int,
        split: str = "train",
    ) -> int:
        """Queue samples from any thread without blocking; on a full buffer drop per `on_full`.

        After the session is finished, samples are counted as dropped (``"closed"``) rather
        than raising, so a rollout thread racing shutdown never crashes.
        """
        if self._state is not _OPEN and self._state is not _State.CLOSED:
            self._check_nowait()
        watched = 0
        if self._watch is not None:
            samples, watched = self._log_watched(samples, step, split)
        records, invalid, refused, gaps = self._encode(samples, step, split)
        adm = self._buffer.admit(
            records, split=split, step=step, nowait=True, invalid=invalid, refused=refused, gaps=gaps
        )
        if self._spool_sync:
            # Never blocks: if another commit is under way, that one or the writer's next
            # one writes these records (before any sink sees them).
            self._commit_spool(blocking=False)
        if adm.wake:
            self._wake()
        return watched + adm.accepted

    def _log_watched(
        self, samples: SampleLike | Iterable[SampleLike], step: int, split: str
    ) -> tuple[list[Any], int]:
        """Queue the call's watched samples past the cap (never waiting for room: under "block"
        a full queue drops them as "queue_full"); returns the other samples and how many
        watched ones were accepted."""
        assert self._watch is not None
        check_step(step, split)
        items = samples if type(samples) is list else list(as_list(samples))
        watched, rest = self._watch.split(items, split, step)
        if not watched:
            return rest, 0
        records, invalid, _, _ = self._encode(watched, step, split, precheck=False)
        adm = self._buffer.admit(records, split=split, step=step, nowait=True, invalid=invalid, gated=False)
        if adm.wake:
            self._wake()
        return rest, adm.accepted

    def record_invalid(self, n: int) -> None:
        """Count `n` samples that could not even be built (an adapter's unconvertible rows).

        They are counted as submitted and dropped (``"invalid"``), so `stats()` accounts for
        them like any other loss. Any thread, never blocks, also after the session finished.
        """
        check_int("n", n, minimum=0)
        self._buffer.count_invalid(n)

    def _push_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._check_open()
        check_step(step, "train")
        if not isinstance(metrics, Mapping):
            raise ValueError(f"metrics must be a mapping of str to number, got {type(metrics).__name__}")
        clean: dict[str, float] = {}
        for k, v in metrics.items():
            if not isinstance(k, str):
                raise ValueError(f"metrics: key {shown(k)} is not a str")
            check_text("metrics: key", k)
            try:
                clean[k] = float(v)
            except Exception:  # OverflowError (10**400) or a caller's __float__ failing
                # Not chained: float()'s error quotes the value (a string) unscrubbed.
                raise ValueError(
                    f"metrics[{shown(k)}]: expected a number a float can hold, got {type(v).__name__}"
                ) from None
        self._buffer.push_item(MetricsItem(step, clean))
        self._wake()

    async def log_metrics(self, metrics: Mapping[str, float], *, step: int) -> None:
        """Queue scalar metrics for `step`; every sink that supports metrics gets them in order."""
        self._push_metrics(metrics, step)

    async def flush(self, timeout: float | None = None) -> bool:
        """Close open sampler steps and wait until everything submitted before the call is
        delivered or finally failed. Returns False when `timeout` passed first."""
        timeout = check_timeout(timeout)
        self._check_open()
        self._check_loop_thread("flush")
        deadline = None if timeout is None else anyio.current_time() + timeout
        # Samples submitted before this call but not queued yet (a caller waiting for room, rows
        # log_rollouts is decoding) must be queued before the marker that flush waits for.
        left = None if deadline is None else deadline - anyio.current_time()
        if not await self._until_queued(self._buffer.last_ticket(), left):
            return False
        return await self._flush_until(deadline)

    async def _until_queued(self, ticket: int | None, timeout: float | None) -> bool:
        """Wait until the submissions numbered `ticket` or earlier (None: every one) are queued or
        given up; False when `timeout` passed first."""
        with anyio.move_on_after(timeout):
            while self._buffer.tickets_upto(ticket):
                await anyio.sleep(0.005)
        return not self._buffer.tickets_upto(ticket)

    async def _flush_until(self, deadline: float | None) -> bool:
        self._buffer.close_steps()
        if self._groups is not None:
            for item in self._groups.close_all():
                self._buffer.push_item(item)
        marker = Marker(len(self.sinks))
        self._buffer.push_item(marker)
        self._wake()
        timeout = None if deadline is None else max(0.0, deadline - anyio.current_time())
        writer = self._writer
        assert writer is not None
        with anyio.move_on_after(timeout):
            # A finish() on another task stops the writer, after which the marker never arrives.
            async with anyio.create_task_group() as tg:

                async def until_stopped() -> None:
                    await writer.stopped.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(until_stopped)
                await marker.done.wait()
                tg.cancel_scope.cancel()
        return marker.done.is_set()

    def stats(self) -> SessionStats:
        """A consistent snapshot of the session's accounting (and of its spool, if it has one)."""
        snapshot = self._buffer.snapshot()
        spool = self._spool
        if spool is None:
            return snapshot
        duplicates = sum(int(getattr(sink, "duplicates_skipped", 0)) for sink in self.sinks)
        return dataclasses.replace(snapshot, spool=spool.stats(duplicates))

    # -- reservations (used by log_rollouts) -----------------------------------------------

    async def _reserve(
        self, scores: Sequence[float | None], rows: list[int], *, step: int, split: str
    ) -> tuple[list[int], list[Entry]]:
        """Reserve places for `rows` by their scores; returns the rows the cap can keep and
        their entries. A row without the score a ranking sampler needs raises, or with
        ``on_invalid="skip"`` is counted as ``"invalid"``."""
        invalid = 0
        if self._score_needed_by is not None:
            missing = [i for i in rows if scores[i] is None]  # row_scores: None unless finite
            if missing and self.on_invalid != "skip":
                i = missing[0]
                raise RecordError(
                    f"sample {i}: rewards: the {self._score_needed_by} ranks by score; "
                    "every row needs a finite reward",
                    index=i,
                    path="rewards",
                )
            rows = [i for i in rows if scores[i] is not None]
            invalid = len(missing)
        wanted = [scores[i] for i in rows]
        while (reserved := self._buffer.reserve(wanted, split=split, step=step, invalid=invalid)) is None:
            # A holding sampler's selection takes rows only while the queue has room (block).
            await self._until_room()
        entries, wake = reserved
        if wake:
            self._wake()
        kept = [(i, e) for i, e in zip(rows, entries, strict=True) if e is not None]
        return [i for i, _ in kept], [e for _, e in kept]

    async def _fill(
        self, entries: Sequence[Entry], samples: Sequence[SampleLike], *, step: int, split: str
    ) -> int:
        try:
            skipped: list[int] = []
            records, _, _, _ = self._encode(samples, step, split, precheck=False, skipped=skipped)
            if skipped:
                # on_invalid="skip" left these rows out: only their places are given back.
                gone = set(skipped)
                self._buffer.cancel([entries[i] for i in skipped], "invalid", split=split, step=step)
                entries = [e for i, e in enumerate(entries) if i not in gone]
        except BaseException:
            self._buffer.cancel(entries, "invalid", split=split, step=step)
            raise
        adm = self._buffer.fill(entries, records)
        if self._spool_sync:
            self._commit_spool()
        if adm.wake:
            self._wake()
        if adm.waiting is not None:
            return adm.accepted - await self._wait_for_room(adm.waiting, None)
        return adm.accepted

    async def log_rollouts(
        self,
        input_ids: Any,
        *,
        tokenizer: Any,
        step: int,
        split: str = "train",
        rewards: Any = None,
        **decode_kwargs: Any,
    ) -> int:
        """Decode and log a batch of token sequences, decoding only the rows the cap can keep.

        The cap and sampler decide from the rewards alone (one small transfer) which rows can
        still be kept; only those are moved and decoded (see `asynctrace.rollouts.decode_rollouts`
        for the other arguments). Rows that cannot be kept are counted as ``"capped"``.
        """
        from .rollouts import decode_rollouts
        from .rollouts._decode import _check_rows, row_scores

        self._check_open()
        check_step(step, split)
        n = len(input_ids)
        # `rows` picks (and orders) the rows to log, as in decode_rollouts; the cap chooses
        # among those.
        candidates = _check_rows(decode_kwargs.pop("rows", None), n)
        # Taken before reserving, so a flush() from now on waits until these rows are queued.
        ticket = self._buffer.take_ticket()
        try:
            rows, kept = await self._reserve(row_scores(rewards, n), candidates, step=step, split=split)
            if not rows:
                return 0
            try:
                samples = await anyio.to_thread.run_sync(
                    functools.partial(
                        decode_rollouts,
                        input_ids,
                        tokenizer=tokenizer,
                        rewards=rewards,
                        rows=rows,
                        **decode_kwargs,
                    )
                )
            except anyio.get_cancelled_exc_class():
                self._buffer.cancel(kept, "cancelled", split=split, step=step)
                raise
            except BaseException:
                self._buffer.cancel(kept, "invalid", split=split, step=step)
                raise
            return await self._fill(kept, samples, step=step, split=split)
        finally:
            self._buffer.return_ticket(ticket)
