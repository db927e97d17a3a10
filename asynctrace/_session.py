"""TraceSession: the public entry point that ties encode → cap/sample → buffer → writer → sinks."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.abc

from ._checks import check_int, check_seconds, check_step, check_timeout
from ._durable.directory import SpoolDir
from ._durable.journal import ReplayPlan
from ._durable.spool import Durability
from ._engine.engine import Engine
from ._engine.queue import OnFull
from ._engine.retry import RetryPolicy
from ._engine.settings import DEFAULT_RETRY, Settings
from ._records.groups import GroupKey
from ._records.types import Sample, SampleLike
from ._runtime import forks, shutdown
from ._runtime.lifecycle import Lifecycle, State
from ._select.base import Sampler
from ._select.samplers import SamplerName
from ._select.watch import Watch
from ._stats import SessionStats
from ._sync import SyncRunner, SyncTraceSession
from .sinks._base import Sink

__all__ = ["TraceSession", "hurry_finish", "install_shutdown_hooks", "log_watched", "recovery_session"]

_OPEN = State.OPEN


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
        retry: RetryPolicy | None = DEFAULT_RETRY,
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
        settings = Settings(
            project=project,
            run=run,
            sinks=sinks,
            max_traces_per_step=max_traces_per_step,
            sampler=sampler,
            queue_size=queue_size,
            max_queue_bytes=max_queue_bytes,
            on_full=on_full,
            batch_size=batch_size,
            flush_interval=flush_interval,
            retry=retry,
            finish_timeout=finish_timeout,
            trace_key=trace_key,
            on_invalid=on_invalid,
            max_open_steps=max_open_steps,
            watch=watch,
            step_timeout=step_timeout,
            redact=redact,
            spool_dir=spool_dir,
            durability=durability,
            replay=replay,
            shutdown_hooks=shutdown_hooks,
            health_metrics=health_metrics,
            health_interval=health_interval,
            group_key=group_key,
        )
        self._setup(settings, None)

    def _setup(self, s: Settings, plan: ReplayPlan | None) -> None:
        self.project, self.run, self.sinks = s.project, s.run_name, s.sink_list
        self.max_traces_per_step, self.sampler, self.watch = s.max_traces_per_step, s.sampler_in_use, s.watch
        self.queue_size, self.max_queue_bytes, self.on_full = s.queue_size, s.max_queue_bytes, s.on_full
        self.batch_size, self.flush_interval, self.retry = s.batch_size, s.flush_interval, s.retry_policy
        self.finish_timeout, self.trace_key, self.on_invalid = s.finish_timeout, s.trace_key, s.on_invalid
        self.redact, self.durability, self.replay = s.redact, s.durability, s.replay
        self.shutdown_hooks, self.group_key = s.shutdown_hooks, s.group_key
        # The step-closing rules, which a `Selected` sink's own selection follows too.
        self._step_rules = (s.max_open_steps, s.step_timeout)
        self._life = Lifecycle(
            name=f"{s.project}/{self.run}",
            finish=self.finish,
            flush=self.flush,
            stats=self.stats,
            locks=lambda: self._engine.locks(),
            finish_timeout=self.finish_timeout,
            spooled=lambda: self._engine.spooled(),
        )
        self._engine = Engine(s, self._life, plan)
        self.sink_names = self._engine.sink_names
        self._tg: anyio.abc.TaskGroup | None = None
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
        self._tg = await self._engine.start()
        forks.hold(self, self._after_fork_in_child)
        try:
            await self._engine.replay()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.__aexit__(None, None, None)
            raise
        if self.shutdown_hooks and not self._opening_sync:
            shutdown.install_for_session(self._life)
        return self

    def _after_fork_in_child(self) -> None:
        # A forked child has the session's state but not its writer thread or task: what it
        # logged would wait forever in its copy of the buffer, and its finish() would wait for a
        # loop that is not there (unwinding a `with` block, or at exit). It refuses to log instead.
        self._life.state = State.FORKED
        self._engine.after_fork()

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
        intake = self._engine.intake
        return SyncTraceSession(
            self, self._sync, log_blocking=intake.log_blocking, push_metrics=intake.log_metrics
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
        return await self._life.finish_once(check_timeout(timeout), self._finish_now)

    async def _finish_now(self) -> SessionStats:
        stats, _ = await self._engine.finish()
        forks.release(self)
        return stats

    # -- submission ------------------------------------------------------------------------

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
        return await self._engine.intake.log(samples, step, split, timeout)

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
        return self._engine.intake.log_nowait(samples, step, split)

    def record_invalid(self, n: int) -> None:
        """Count `n` samples that could not even be built (an adapter's unconvertible rows).

        They are counted as submitted and dropped (``"invalid"``), so `stats()` accounts for
        them like any other loss. Any thread, never blocks, also after the session finished.
        """
        check_int("n", n, minimum=0)
        self._engine.buffer.count_invalid(n)

    async def log_metrics(self, metrics: Mapping[str, float], *, step: int) -> None:
        """Queue scalar metrics for `step`; every sink that supports metrics gets them in order.

        Never waits: a sink whose backlog holds its share of `max_queue_bytes` (a stuck sink)
        misses them, counted in `stats().sinks[name].metrics_dropped`; without room for any
        sink they are dropped and counted in `stats().metrics_dropped`."""
        self._engine.intake.log_metrics(metrics, step)

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
        engine = self._engine
        if not await engine.intake.waits.until_queued(engine.buffer.last_ticket(), left):
            return False
        return await engine.flush(deadline)

    def stats(self) -> SessionStats:
        """A consistent snapshot of the session's accounting (and of its spool, if it has one)."""
        return self._engine.stats()

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
        return await self._engine.intake.log_rollouts(
            input_ids, tokenizer=tokenizer, step=step, split=split, rewards=rewards, **decode_kwargs
        )


def install_shutdown_hooks(
    session: TraceSession | SyncTraceSession,
    *,
    timeout: float = shutdown.DEFAULT_TIMEOUT,
    signals: Iterable[int] = shutdown.DEFAULT_SIGNALS,
) -> Callable[[], None]:
    """Drain `session` within `timeout` seconds on SIGTERM/SIGINT and at interpreter exit.

    Chains to the handlers installed before (docs/reliability.md says what each case does).
    Must be called from the main thread. Returns a function that removes the hooks (finishing
    the session removes them too).
    """
    target = session.session if isinstance(session, SyncTraceSession) else session
    assert isinstance(target, TraceSession)
    check_seconds("timeout", timeout)
    return shutdown.install(target._life, float(timeout), signals)


def log_watched(
    session: TraceSession, samples: SampleLike | Iterable[SampleLike], *, step: int, split: str = "train"
) -> int:
    """Queue samples another process's watch list passed by, within the step's watch cap there
    (a rank of `asynctrace.distributed`): marked watched, past the session's cap and every
    `Selected` sink's selection, as the session's own watched samples. Any thread, never waits
    (under ``on_full="block"`` a full queue drops them as ``"queue_full"``); returns how many
    were accepted."""
    check_step(step, split)
    return session._engine.intake.log_watched(samples, step, split)


def hurry_finish(session: TraceSession, timeout: float) -> None:
    """Cut a finish() under way on `session`'s loop to end within `timeout` seconds, from any thread."""
    session._life.schedule(session._life.hurry, timeout)


def recovery_session(
    spool_dir: str | os.PathLike[str],
    target: tuple[str, str],
    source: tuple[str, str],
    *,
    dead_letters: bool,
    sinks: Sequence[Sink] | None = None,
    sessions: frozenset[str] | None = None,
    held: SpoolDir | None = None,
) -> TraceSession:
    """A session that replays what the spool holds of `source` (dead letters too, with
    `dead_letters`; only what `sessions` spooled, if given) into the (project, run) `target`
    through `sinks` (default: Trackio), for `asynctrace recover`, sharing the directory's
    lock `held` when recover holds it."""
    from .sinks import TrackioSink

    session = TraceSession.__new__(TraceSession)
    settings = Settings(
        project=target[0],
        run=target[1],
        sinks=list(sinks) if sinks is not None else [TrackioSink()],
        spool_dir=spool_dir,
        durability="writer",
        replay=True,
        finish_timeout=120.0,
    )
    plan = ReplayPlan(source, dead_letters=dead_letters, quiet=True, sessions=sessions, held=held)
    session._setup(settings, plan)
    return session
