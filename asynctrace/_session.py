"""TraceSession: the public entry point that ties encode → cap/sample → buffer → writer → sinks."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.abc

from ._checks import (
    check_encoding,
    check_flags,
    check_int,
    check_ints,
    check_project_run,
    check_seconds,
    check_step,
    check_text,
    check_timeout,
    checked_metrics,
)
from ._durable import segments
from ._durable.journal import ReplayPlan, replay_backlog
from ._durable.spool import Durability
from ._engine.buffer import OnFull, Room
from ._engine.build import build_engine
from ._engine.finish import after_drain, close_sinks, flush_until, report_finish
from ._engine.intake import Intake
from ._engine.retry import NO_RETRY, RetryPolicy
from ._engine.writer import Writer
from ._records.groups import GroupKey
from ._records.types import MetricsItem, Sample, SampleLike
from ._runtime import forks, shutdown
from ._runtime.lifecycle import Lifecycle, State, finish_bound
from ._security import generated_run_name, shown
from ._select.base import Sampler
from ._select.samplers import SamplerName, resolve_sampler
from ._select.watch import Watch, WatchCounter
from ._stats import SessionStats
from ._sync import SyncRunner, SyncTraceSession
from .exceptions import SessionClosedError
from .sinks._base import Sink

__all__ = ["TraceSession", "hurry_finish", "install_shutdown_hooks", "recovery_session"]

_OPEN = State.OPEN

_ON_FULL = ("block", "drop_newest", "drop_oldest")
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
        settings = dict(locals())
        _check_arguments(settings)  # every argument, before anything is built from them
        sinks = _checked_sinks(sinks)

        self.project = project
        self.run = run or generated_run_name()
        self.sinks = sinks
        self.max_traces_per_step = max_traces_per_step
        self.sampler = resolve_sampler(sampler)
        self.watch = watch
        self.queue_size = queue_size
        self.max_queue_bytes = max_queue_bytes
        self.on_full = on_full
        self.batch_size = batch_size
        self.flush_interval = float(flush_interval)
        self.retry = retry if retry is not None else NO_RETRY
        self.finish_timeout = float(finish_timeout)
        self.trace_key = trace_key
        self.on_invalid = on_invalid
        self.redact = redact
        self.durability = durability
        self.replay = replay
        self.shutdown_hooks = shutdown_hooks

        self.sink_names = _bind_sinks(sinks, project, self.run)
        # The step-closing rules, which a `Selected` sink's own selection follows too.
        self._step_rules = (max_open_steps, step_timeout)
        self._health_interval = float(health_interval) if health_metrics else None
        settings.update(run=self.run, sampler=self.sampler, sink_names=self.sink_names)
        engine = build_engine(settings, self._push_items)
        self._buffer, self._encoder, self._spool, self._groups = engine
        # Set by `recovery_session`: replay another (project, run)'s records, dead letters too.
        self._replay_plan: ReplayPlan | None = None
        self._life = Lifecycle(
            name=f"{project}/{self.run}",
            finish=self.finish,
            flush=self.flush,
            stats=self.stats,
            locks=lambda: [self._buffer.lock] + ([self._spool.io_lock] if self._spool else []),
            finish_timeout=self.finish_timeout,
            spooled=lambda: None if self._spool is None else self._spool.unresolved(),
        )
        self._intake = Intake(
            self._buffer,
            self._encoder,
            self._life,
            batch_size=batch_size,
            wake_writer=self._wake_writer,
            watch=WatchCounter(watch) if watch is not None and max_traces_per_step is not None else None,
        )
        self._tg: anyio.abc.TaskGroup | None = None
        self._writer: Writer | None = None
        self._finishing: anyio.Event | None = None
        self._sync: SyncRunner | None = None
        self._opening_sync = False

    @property
    def step_rules(self) -> tuple[int, float | None]:
        """When the sampler closes a step: (max_open_steps, step_timeout), as configured."""
        return self._step_rules

    def __repr__(self) -> str:
        return f"TraceSession(project={self.project!r}, run={self.run!r}, state={self._life.state.value})"

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> TraceSession:
        self._life.check_unopened()
        spool = self._spool
        scan: segments.DirScan | None = None
        if spool is not None:
            scan = await anyio.to_thread.run_sync(spool.open)
        try:
            await self._start()
        except BaseException:
            if spool is not None:
                spool.close()
            raise
        if spool is not None and scan is not None:
            try:
                plan = self._replay_plan or ReplayPlan((self.project, self.run))
                await replay_backlog(spool, scan, plan, self.replay, self._intake.replay)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.__aexit__(None, None, None)
                raise
        if self.shutdown_hooks and not self._opening_sync:
            shutdown.install_for_session(self._life)
        return self

    async def _start(self) -> None:
        self._writer = Writer(
            self._buffer,
            self.sinks,
            retry=self.retry,
            flush_interval=self.flush_interval,
            step_timeout=self._buffer.gate.step_timeout if self._buffer.gate else None,
            on_room=self._buffer.room.notify,
            max_open_steps=self._step_rules[0],
            sink_step_timeout=self._step_rules[1],
            health_interval=self._health_interval,
            groups=self._groups,
        )
        self._tg = await self._life.open(self._writer.run)
        forks.hold(self, self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        # A forked child has the session's state but not its writer thread or task: what it
        # logged would wait forever in its copy of the buffer, and its finish() would wait for a
        # loop that is not there (unwinding a `with` block, or at exit). It refuses to log instead.
        self._life.state = State.FORKED
        # The lock may have been held by a thread the child does not have.
        self._buffer.lock = threading.Lock()
        self._buffer.room = Room()

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
        self._life.check_unopened()
        self._opening_sync = True
        try:
            self._sync = SyncRunner(self, self._life)
        finally:
            self._opening_sync = False
        self._life.runner = self._sync
        if self.shutdown_hooks:
            shutdown.install_for_session(self._life)
        return SyncTraceSession(
            self, self._sync, log_blocking=self._intake.log_blocking, push_metrics=self._push_metrics
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
        self._life.check_loop_thread("finish")
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
            drained = False
            with anyio.CancelScope() as life.drain_scope:
                drained = await self._flush_until(deadline)
                if drained and self._writer is not None and self._writer.final_health():
                    # The health once more, counting everything the drain delivered.
                    await self._flush_until(deadline)
            life.drain_scope = None
            assert self._writer is not None
            left = await after_drain(life, self._writer, self._intake.until_queued, self._spool, self._buffer)
            await close_sinks(self.sinks, self.sink_names, left)
            stats = self.stats()
            report_finish(stats, self._spool, drained, life.budget)
            forks.release(self)
            self._finishing.set()
            life.finished(stats)
        return stats

    # -- submission ------------------------------------------------------------------------

    async def _flush_until(self, deadline: float | None) -> bool:
        if self._groups is not None:
            self._push_items(self._groups.close_all())
        return await flush_until(self._buffer, self._writer, self._intake.wake, deadline)

    def _push_items(self, items: Sequence[Any]) -> None:
        """Queue control items (group metrics of closed steps) for the writer."""
        for item in items:
            self._buffer.push_item(item)
        if items:
            self._intake.wake()

    def _wake_writer(self) -> None:
        if self._writer is not None:
            self._writer.wake()

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
        if self._life.state is not _OPEN:
            self._life.check_open()
        if timeout is not None:
            timeout = check_timeout(timeout)
        return await self._intake.log(samples, step, split, timeout)

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
        return self._intake.log_nowait(samples, step, split)

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
        self._buffer.push_item(MetricsItem(step, checked_metrics(metrics)))
        self._intake.wake()

    async def log_metrics(self, metrics: Mapping[str, float], *, step: int) -> None:
        """Queue scalar metrics for `step`; every sink that supports metrics gets them in order."""
        self._push_metrics(metrics, step)

    async def flush(self, timeout: float | None = None) -> bool:
        """Close open sampler steps and wait until everything submitted before the call is
        delivered or finally failed. Returns False when `timeout` passed first."""
        timeout = check_timeout(timeout)
        self._life.check_open()
        self._life.check_loop_thread("flush")
        deadline = None if timeout is None else anyio.current_time() + timeout
        # Samples submitted before this call but not queued yet (a caller waiting for room, rows
        # log_rollouts is decoding) must be queued before the marker that flush waits for.
        left = None if deadline is None else deadline - anyio.current_time()
        if not await self._intake.until_queued(self._buffer.last_ticket(), left):
            return False
        return await self._flush_until(deadline)

    def stats(self) -> SessionStats:
        """A consistent snapshot of the session's accounting (and of its spool, if it has one)."""
        snapshot = self._buffer.snapshot()
        spool = self._spool
        if spool is None:
            return snapshot
        duplicates = sum(int(getattr(sink, "duplicates_skipped", 0)) for sink in self.sinks)
        return dataclasses.replace(snapshot, spool=spool.stats(duplicates))

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
        self._life.check_open()
        check_step(step, split)
        return await self._intake.log_rollouts(
            input_ids, tokenizer=tokenizer, step=step, split=split, rewards=rewards, **decode_kwargs
        )


def _check_arguments(settings: Mapping[str, Any]) -> None:
    """Check `TraceSession`'s arguments, given by name, each with a clear error naming it."""
    check_project_run(settings["project"], settings["run"])
    check_int("max_traces_per_step", settings["max_traces_per_step"], allow_none=True)
    check_ints(**{name: settings[name] for name in ("queue_size", "max_queue_bytes", "batch_size")})
    check_int("max_open_steps", settings["max_open_steps"], minimum=0)
    check_seconds("flush_interval", settings["flush_interval"])
    check_seconds("finish_timeout", settings["finish_timeout"])
    check_seconds("step_timeout", settings["step_timeout"], allow_none=True)
    on_full, retry, trace_key = settings["on_full"], settings["retry"], settings["trace_key"]
    if on_full not in _ON_FULL:
        raise ValueError(f"on_full must be one of {_ON_FULL}, got {shown(on_full)}")
    check_encoding(settings["on_invalid"], settings["redact"])
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
    durability, spool_dir = settings["durability"], settings["spool_dir"]
    if durability not in _DURABILITY:
        raise ValueError(f"durability must be one of {_DURABILITY}, got {shown(durability)}")
    if spool_dir is not None and not isinstance(spool_dir, (str, os.PathLike)):
        raise ValueError(f"spool_dir must be a path or None, got {type(spool_dir).__name__}")
    if spool_dir is not None and not os.fspath(spool_dir):
        raise ValueError("spool_dir must not be empty")
    check_seconds("health_interval", settings["health_interval"])
    watch, group_key = settings["watch"], settings["group_key"]
    if watch is not None and not isinstance(watch, Watch):
        raise ValueError(f"watch must be an asynctrace.Watch, got {type(watch).__name__}")
    if group_key is not None and not (
        callable(group_key)
        or isinstance(group_key, str)
        or (isinstance(group_key, (list, tuple)) and group_key and all(isinstance(k, str) for k in group_key))
    ):
        raise ValueError(
            "group_key must be a metadata key, a list of keys tried in order, or a function of "
            f"the metadata, got {shown(group_key)}"
        )
    check_flags(**{name: settings[name] for name in ("replay", "shutdown_hooks", "health_metrics")})


def _bind_sinks(sinks: Sequence[Sink], project: str, run: str) -> list[str]:
    """Bind every sink to the run; returns their names, numbered where two share one."""
    names: list[str] = []
    for sink in sinks:
        base = getattr(sink, "name", type(sink).__name__) or type(sink).__name__
        name, i = base, 2
        while name in names:
            name, i = f"{base}#{i}", i + 1
        names.append(name)
        sink.bind(project, run)
    return names


def _checked_sinks(sinks: Sequence[Sink] | None) -> list[Sink]:
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
    return sinks


def install_shutdown_hooks(
    session: TraceSession | SyncTraceSession,
    *,
    timeout: float = shutdown.DEFAULT_TIMEOUT,
    signals: Iterable[int] = shutdown.DEFAULT_SIGNALS,
) -> Callable[[], None]:
    """Drain `session` within `timeout` seconds on SIGTERM/SIGINT and at interpreter exit.

    Chains to the handlers installed before (see `asynctrace._runtime.shutdown` for what each case
    does). Must be called from the main thread. Returns a function that removes the hooks
    (finishing the session removes them too).
    """
    target = session.session if isinstance(session, SyncTraceSession) else session
    assert isinstance(target, TraceSession)
    check_seconds("timeout", timeout)
    return shutdown.install(target._life, float(timeout), signals)


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
    session._replay_plan = ReplayPlan(source, dead_letters=dead_letters, quiet=True)
    return session
