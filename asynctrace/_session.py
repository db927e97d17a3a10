"""TraceSession: the public entry point that ties encode → cap/sample → buffer → writer → sinks."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc

from . import _forks, _segments, _shutdown
from ._abandon import call_abandonable
from ._buffer import Buffer, Marker, MetricsItem, OnFull, Waiting
from ._checks import MAX_STEP, check_int, check_seconds, check_split, check_step, check_text, check_timeout
from ._lifecycle import Lifecycle, State
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
from ._security import check_name, describe, generated_run_name, shown
from ._spool import Durability, Spool
from ._stats import SessionStats
from ._sync import SyncTraceSession, _SyncRunner
from ._writer import STOP_GRACE, Writer, close_grace, finish_bound
from .exceptions import AsyncTraceError, RecordError, SessionClosedError
from .sinks._base import Sink

if TYPE_CHECKING:
    from ._sampling import Entry

__all__ = ["TraceSession", "hurry_finish", "install_shutdown_hooks", "recovery_session"]

logger = logging.getLogger("asynctrace")


_OPEN = State.OPEN

_ON_FULL = ("block", "drop_newest", "drop_oldest")
_ON_INVALID = ("raise", "skip")
_DURABILITY = ("writer", "enqueue")
_DEFAULT_RETRY = RetryPolicy()


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
        step_timeout: float | None = 300.0,
        redact: Callable[[Sample], Sample] | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        durability: Durability = "writer",
        replay: bool = True,
        shutdown_hooks: bool = False,
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
        for name, flag in (("replay", replay), ("shutdown_hooks", shutdown_hooks)):
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
        self.run = run or generated_run_name()
        self.sinks = sinks
        self.max_traces_per_step = max_traces_per_step
        self.sampler = resolve_sampler(sampler)
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
        self._keys: dict[str, str] = {}
        self._life = Lifecycle(
            name=f"{project}/{self.run}",
            finish=self.finish,
            flush=self.flush,
            stats=self.stats,
            locks=self._drain_locks,
            finish_timeout=self.finish_timeout,
            spooled=lambda: None if self._spool is None else self._spool.unresolved(),
        )
        self._tg: anyio.abc.TaskGroup | None = None
        self._writer: Writer | None = None
        self._room_event: anyio.Event | None = None
        self._async_waiters = 0
        self._finishing: anyio.Event | None = None
        self._sync: _SyncRunner | None = None
        self._opening_sync = False

    def __repr__(self) -> str:
        return f"TraceSession(project={self.project!r}, run={self.run!r}, state={self._life.state.value})"

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> TraceSession:
        if self._life.state is not State.UNOPENED:
            raise SessionClosedError(
                f"a TraceSession can be opened once; this one is {self._life.state.value}"
            )
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
        self._room_event = anyio.Event()
        self._writer = Writer(
            self._buffer,
            self.sinks,
            retry=self.retry,
            flush_interval=self.flush_interval,
            step_timeout=self._buffer.gate.step_timeout if self._buffer.gate else None,
            on_room=self._on_room,
        )
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._tg.start(self._writer.run)
        except BaseException:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            raise
        await self._life.opened(self._tg)
        _forks.hold(self)

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

    def _drain_locks(self) -> list[threading.Lock]:
        locks = [self._buffer.lock]
        if self._spool is not None:
            locks.append(self._spool.io_lock)
        return locks

    def _install_hooks(self) -> None:
        if threading.current_thread() is threading.main_thread():
            install_shutdown_hooks(self)
        else:
            logger.warning(
                "asynctrace: shutdown_hooks=True but the session was opened off the main thread; "
                "only the exit hook is installed (Python runs signal handlers on the main thread)"
            )
            _shutdown.hook_exit(self._life)

    def _after_fork_in_child(self) -> None:
        # A forked child has the session's state but not its writer thread or task: what it
        # logged would wait forever in its copy of the buffer, and its finish() would wait for a
        # loop that is not there (unwinding a `with` block, or at exit). It refuses to log instead.
        self._life.state = State.FORKED
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
        if self._life.is_forked():
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
        if self._life.state is not State.UNOPENED:
            raise SessionClosedError(
                f"a TraceSession can be opened once; this one is {self._life.state.value}"
            )
        self._opening_sync = True
        try:
            self._sync = _SyncRunner(self, self._life)
        finally:
            self._opening_sync = False
        self._life.runner = self._sync
        if self.shutdown_hooks:
            self._install_hooks()
        return SyncTraceSession(
            self, self._sync, log_blocking=self._log_blocking, push_metrics=self._push_metrics
        )

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
        life = self._life
        if life.state is State.CLOSED:
            assert life.final is not None
            return life.final
        if life.state is State.UNOPENED:
            raise SessionClosedError("the session was never opened; use `async with` or `with`")
        if life.state is State.FORKED:
            return self.stats()  # the parent process finishes it
        self._check_loop_thread("finish")
        if self._finishing is not None:
            # Another finish() is under way: wait for its outcome, within this call's own bound.
            bound = finish_bound(self.finish_timeout if timeout is None else timeout)
            with anyio.CancelScope(shield=True), anyio.move_on_after(bound):
                await self._finishing.wait()
            return life.final if life.final is not None else self.stats()
        self._finishing = anyio.Event()
        budget = self.finish_timeout if timeout is None else float(timeout)
        with anyio.CancelScope(shield=True):
            start = anyio.current_time()
            deadline = start + budget
            life.finishing(budget, deadline)
            self._buffer.close()
            self._on_room()
            drained = False
            with anyio.CancelScope() as life.drain_scope:
                drained = await self._flush_until(deadline)
            life.drain_scope = None
            budget, deadline = life.budget, life.deadline
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
            if life.hooks is not None:
                life.hooks.uninstall()
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
            _forks.release(self)
            self._finishing.set()
            life.finished(stats)
        return stats

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
    ) -> tuple[list[TraceRecord], int, int]:
        """Validate and encode samples once, in the caller; returns records, the invalid count and
        how many the cap refused before they were encoded (only with `precheck`). Without
        `precheck`, the indices of samples left out as invalid go to `skipped`."""
        if type(step) is not int or step < 0 or step > MAX_STEP or type(split) is not str or not split:
            check_step(step, split)  # raises, or accepts an int subclass
        items = samples if type(samples) is list else as_list(samples)
        key = self._keys.get(split) or self._key_for(split)
        now = time.time()
        kept = self._encode_kept(items, step, split) if precheck and self._precheck_cap else None
        if kept is not None:
            encoded, invalid, refused = kept
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
        return records_for(encoded, self._ids, self._id_prefix, step, split, key, now), invalid, refused

    def _encode_kept(
        self, items: Sequence[Any], step: int, split: str
    ) -> tuple[list[tuple[bytes, float | None]], int, int] | None:
        """Encode only the samples the cap would keep if offered now; None when that cannot be
        told cheaply (the caller then encodes everything).

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
            scores: list[Any] = [preview_score(obj) for obj in items]
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
        while candidates:
            keeps = self._buffer.keeps([scores[i] for i in candidates], split=split, step=step)
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
        return [encoded[i] for i in sorted(encoded)], len(invalid), n - len(invalid) - len(encoded)

    def _commit_spool(self, blocking: bool = True) -> None:
        spool = self._spool
        if spool is not None and (blocking or spool.has_staged):
            # Blocking, even with nothing staged: another thread's commit may have taken this
            # caller's records and still be writing them; taking the commit lock waits for it.
            spool.commit(blocking=blocking)

    def _check_loop_thread(self, what: str) -> None:
        # Its waits are on the session's own event loop: awaited from another thread's loop
        # they would break that loop's primitives (and the writer with them) instead of waiting.
        loop_thread = self._life.loop_thread
        if loop_thread is not None and threading.get_ident() != loop_thread:
            raise AsyncTraceError(
                f"{what}() must be awaited on the event loop that opened the session; from another "
                "thread or event loop, use the session's blocking form (`with TraceSession(...)`), "
                "whose methods may be called from any thread"
            )

    def _wake(self) -> None:
        writer = self._writer
        if writer is None:
            return
        if self._life.on_loop_thread():
            writer.wake()
        else:
            # A closing loop: its writer no longer needs waking.
            self._life.call_soon(writer.wake)

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
        if self._life.state is not _OPEN:
            self._life.check_open()
        if timeout is not None:
            timeout = check_timeout(timeout)
        if threading.get_ident() != self._life.loop_thread:
            return await self._log_from_other_loop(samples, step, split, timeout)
        records, invalid, refused = self._encode(samples, step, split)
        adm = self._buffer.admit(
            records, split=split, step=step, nowait=False, invalid=invalid, refused=refused
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
            return adm.accepted
        return adm.accepted - await self._wait_for_room(adm.waiting, timeout)

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
        self._life.check_open()
        records, invalid, refused = self._encode(samples, step, split)
        buf = self._buffer
        # Under "block" this call may be left waiting for room: its ticket is taken before it
        # admits anything, so a flush() from another thread cannot slip in between.
        ticket = buf.take_ticket() if self.on_full == "block" else None
        try:
            adm = buf.admit(
                records, split=split, step=step, nowait=False, invalid=invalid, refused=refused, ticket=ticket
            )
            if self._spool_sync:
                self._commit_spool()
            if adm.wake:
                self._wake()
            if adm.waiting is None:
                return adm.accepted
            return self._wait_blocking(adm.waiting, adm.accepted, timeout, cancelled)
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
        state = self._life.state
        if state is not _OPEN and state is not State.CLOSED:
            self._life.check_usable()
        records, invalid, refused = self._encode(samples, step, split)
        adm = self._buffer.admit(
            records, split=split, step=step, nowait=True, invalid=invalid, refused=refused
        )
        if self._spool_sync:
            # Never blocks: if another commit is under way, that one or the writer's next
            # one writes these records (before any sink sees them).
            self._commit_spool(blocking=False)
        if adm.wake:
            self._wake()
        return adm.accepted

    def record_invalid(self, n: int) -> None:
        """Count `n` samples that could not even be built (an adapter's unconvertible rows).

        They are counted as submitted and dropped (``"invalid"``), so `stats()` accounts for
        them like any other loss. Any thread, never blocks, also after the session finished.
        """
        check_int("n", n, minimum=0)
        self._buffer.count_invalid(n)

    def _push_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._life.check_open()
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
        self._life.check_open()
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
            records, _, _ = self._encode(samples, step, split, precheck=False, skipped=skipped)
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

        self._life.check_open()
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


def install_shutdown_hooks(
    session: TraceSession | SyncTraceSession,
    *,
    timeout: float = _shutdown.DEFAULT_TIMEOUT,
    signals: Iterable[int] = _shutdown.DEFAULT_SIGNALS,
) -> Callable[[], None]:
    """Drain `session` within `timeout` seconds on SIGTERM/SIGINT and at interpreter exit.

    Chains to the handlers installed before (see `asynctrace._shutdown` for what each case
    does). Must be called from the main thread. Returns a function that removes the hooks
    (finishing the session removes them too).
    """
    target = session.session if isinstance(session, SyncTraceSession) else session
    assert isinstance(target, TraceSession)
    check_seconds("timeout", timeout)
    return _shutdown.install(target._life, float(timeout), signals)


def hurry_finish(session: TraceSession, timeout: float) -> None:
    """Cut a finish() under way on `session`'s loop to end within `timeout` seconds, from any thread."""
    session._life.schedule(session._life.hurry, timeout)


def recovery_session(
    spool_dir: str | os.PathLike[str], target: tuple[str, str], source: tuple[str, str], *, dead_letters: bool
) -> TraceSession:
    """A session that replays what the spool holds of `source` (dead letters too, with
    `dead_letters`) into the (project, run) `target`, for `asynctrace recover`."""
    from .sinks import TrackioSink

    session = TraceSession(
        target[0],
        run=target[1],
        sinks=[TrackioSink()],
        spool_dir=spool_dir,
        durability="writer",
        replay=True,
        finish_timeout=120.0,
    )
    session._replay_from = source
    session._replay_dead = dead_letters
    session._replay_quiet = True
    return session
