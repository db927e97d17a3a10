"""The blocking face of a session: its event loop on a daemon thread, behind a blocking portal."""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import anyio
import orjson
from anyio.from_thread import BlockingPortal

from ._checks import check_timeout, wait_arg
from ._records.types import SampleLike
from ._runtime import shutdown
from ._runtime.lifecycle import Lifecycle
from ._security import logger
from ._stats import SessionStats
from .exceptions import SessionClosedError

__all__ = ["SyncTraceSession"]


def _bounded(fn: Callable[[], Any], bound: float) -> Any:
    """`fn()`, waited for at most `bound` seconds (then `TimeoutError`; `fn` goes on alone).

    Handing work to the loop thread blocks until that thread takes it, so the waiting is done
    by a helper thread: a loop thread blocked by a misbehaving sink cannot hold the caller.
    """
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:
            done.set_exception(exc)

    try:
        threading.Thread(target=run, name="asynctrace-wait", daemon=True).start()
    except RuntimeError:  # no new threads at interpreter shutdown (Python 3.12+): wait inline
        return fn()
    try:
        return done.result(wait_arg(bound))
    except concurrent.futures.TimeoutError:
        raise TimeoutError from None


def log_within(
    sync: SyncTraceSession,
    samples: Sequence[Any],
    *,
    step: int,
    split: str,
    blocking: bool,
    timeout: float | None,
) -> int:
    """Log from a thread that is not the session's: under ``on_full="block"`` (`blocking`) wait
    for room at most `timeout` seconds; once the session is finished, or without blocking,
    never wait (samples after finish count as ``"closed"``)."""
    if blocking:
        try:
            return sync.log_samples(samples, step=step, split=split, timeout=timeout)
        except SessionClosedError:
            pass  # finished meanwhile: counted as dropped ("closed") just below
    return sync.log_samples_nowait(samples, step=step, split=split)


def log_payloads(
    sync: SyncTraceSession,
    payloads: Sequence[bytes],
    *,
    step: int,
    split: str,
    blocking: bool,
    deadline: float | None,
) -> int:
    """Log samples another process selected and encoded (a Ray client's, a rank's), by
    `log_within` until the `time.monotonic()` `deadline`; returns how many were accepted.

    The payloads are decoded and encoded again: the session validates every sample on its one
    path in. The cost is a few microseconds a sample, for the `k` a step that were selected.
    """
    samples = [orjson.loads(p) for p in payloads]
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    return log_within(sync, samples, step=step, split=split, blocking=blocking, timeout=left)


class AsyncFront(Protocol):
    """What the blocking form needs of the async session it runs."""

    project: str
    run: str
    finish_timeout: float
    max_traces_per_step: int | None
    sampler: Any

    async def __aenter__(self) -> Any: ...
    async def __aexit__(self, *exc: Any) -> None: ...
    async def finish(self, timeout: float | None = None) -> SessionStats: ...
    async def flush(self, timeout: float | None = None) -> bool: ...
    async def log_rollouts(self, input_ids: Any, *, tokenizer: Any, step: int, **kwargs: Any) -> int: ...
    def log_samples_nowait(
        self, samples: SampleLike | Iterable[SampleLike], *, step: int, split: str = "train"
    ) -> int: ...
    def record_invalid(self, n: int) -> None: ...
    def stats(self) -> SessionStats: ...


LogBlocking = Callable[[SampleLike | Iterable[SampleLike], int, str, float | None], int]


class SyncTraceSession:
    """The blocking face of a `TraceSession`, returned by ``with TraceSession(...) as s``."""

    def __init__(
        self,
        session: AsyncFront,
        runner: SyncRunner,
        *,
        log_blocking: LogBlocking,
        push_metrics: Callable[[Mapping[str, float], int], None],
    ) -> None:
        self.session = session
        self._runner = runner
        self._log_blocking = log_blocking
        self._push_metrics = push_metrics

    @property
    def project(self) -> str:
        """The session's project."""
        return self.session.project

    @property
    def run(self) -> str:
        """The session's run name (generated when none was given)."""
        return self.session.run

    @property
    def is_open(self) -> bool:
        """Whether it still accepts samples (not finishing, finished, or a forked child's copy)."""
        return self._runner.life.is_open()

    def log_samples(
        self,
        samples: SampleLike | Iterable[SampleLike],
        *,
        step: int,
        split: str = "train",
        timeout: float | None = None,
    ) -> int:
        """Blocking: waits for room under ``on_full="block"`` (at most `timeout` seconds)."""
        timeout = check_timeout(timeout)
        return self._log_blocking(samples, step, split, timeout)

    def log_samples_nowait(
        self, samples: SampleLike | Iterable[SampleLike], *, step: int, split: str = "train"
    ) -> int:
        """Never blocks; see `TraceSession.log_samples_nowait`."""
        return self.session.log_samples_nowait(samples, step=step, split=split)

    def record_invalid(self, n: int) -> None:
        """See `TraceSession.record_invalid`."""
        self.session.record_invalid(n)

    def log_metrics(self, metrics: Mapping[str, float], *, step: int) -> None:
        """Queue scalar metrics for `step`; never waits (see `TraceSession.log_metrics`)."""
        self._push_metrics(metrics, step)

    def log_rollouts(self, input_ids: Any, *, tokenizer: Any, step: int, **kwargs: Any) -> int:
        """Blocking `TraceSession.log_rollouts`."""
        call = functools.partial(
            self.session.log_rollouts, input_ids, tokenizer=tokenizer, step=step, **kwargs
        )
        return int(self._runner.call(call))

    def flush(self, timeout: float | None = None) -> bool:
        """Blocking `TraceSession.flush`."""
        timeout = check_timeout(timeout)
        bound = None if timeout is None else timeout + 1.0
        return bool(self._runner.call(self.session.flush, timeout, bound=bound))

    def finish(self, timeout: float | None = None) -> SessionStats:
        """Drain, close every sink and stop the writer thread; idempotent."""
        timeout = check_timeout(timeout)
        return self._runner.close(self.session.finish_timeout if timeout is None else timeout)

    def wait_finished(self, timeout: float | None = None) -> SessionStats | None:
        """Wait at most `timeout` seconds for a finish under way on another thread; its final stats,
        or None when it is not done by then."""
        life = self._runner.life
        life.closed.wait(None if timeout is None else wait_arg(timeout))
        return life.final

    def stats(self) -> SessionStats:
        """A consistent snapshot of the session's accounting; see `TraceSession.stats`."""
        return self.session.stats()

    def __enter__(self) -> SyncTraceSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


class SyncRunner:
    """Runs a session's event loop on a daemon thread, reachable through a blocking portal."""

    def __init__(self, session: AsyncFront, life: Lifecycle) -> None:
        self.session = session
        self.life = life
        self._lock = threading.Lock()
        self._closed = False
        handoff: queue.Queue[BlockingPortal | BaseException] = queue.Queue()
        self._stop: anyio.Event | None = None

        async def host() -> None:
            try:
                async with BlockingPortal() as portal:
                    self._stop = anyio.Event()
                    handoff.put(portal)
                    await self._stop.wait()
            except BaseException as exc:  # pragma: no cover - reported to the opener
                handoff.put(exc)
                raise

        self._thread = threading.Thread(
            target=anyio.run, args=(host,), name=f"asynctrace-{session.project}", daemon=True
        )
        self._thread.start()
        got = handoff.get()
        if isinstance(got, BaseException):
            raise got
        self.portal = got
        # The session's task group must live in one task from enter to exit: the portal's
        # wrapped context manager gives it one.
        self._cm = self.portal.wrap_async_context_manager(session)
        try:
            self._cm.__enter__()
        except BaseException:
            self._shutdown_thread()
            raise
        shutdown.runners.add(self)

    def call(self, fn: Callable[..., Any], *args: Any, bound: float | None = None) -> Any:
        """Run `fn` on the loop thread; with `bound`, give up waiting after that many seconds."""
        self.life.check_usable()  # a forked child has no loop thread to call
        with self._lock:
            if self._closed:
                raise SessionClosedError("the session is finished")
        if bound is None:
            return self.portal.call(fn, *args)
        try:
            return _bounded(functools.partial(self.portal.call, fn, *args), bound)
        except TimeoutError:
            raise TimeoutError(
                f"the session's event loop did not answer within {bound:.1f}s: something is "
                "blocking its thread (a sink doing blocking work in an async method?)"
            ) from None

    def close(self, timeout: float, *, bound: float | None = None) -> SessionStats:
        """Finish within `timeout` and stop the loop thread, waiting at most `bound` seconds in all
        (default: finish()'s own bound and a margin)."""
        limit = shutdown.hook_bound(timeout, final=True) if bound is None else bound
        session, life = self.session, self.life
        if life.is_forked():
            # A forked child's copy: the loop thread is the parent's, which finishes the session.
            return session.stats()
        with self._lock:
            first = not self._closed
            self._closed = True
        if not first:
            # Another thread is finishing: wait for that finish, as the async finish() does.
            life.closed.wait(wait_arg(limit))
            return session.stats() if life.final is None else life.final
        shutdown.runners.discard(self)

        def teardown() -> SessionStats:
            try:
                stats: SessionStats = self.portal.call(session.finish, timeout)
                self._cm.__exit__(None, None, None)
                return stats
            finally:
                self._shutdown_thread()

        try:
            stats: SessionStats = _bounded(teardown, limit)
        except TimeoutError:
            logger.error(
                "asynctrace: finish() could not complete within %.1fs: the session's event "
                "loop thread is blocked (a sink doing blocking work in an async method?); it "
                "goes on finishing if that thread is freed",
                limit,
            )
            stats = session.stats()
        finally:
            # finish() ran on the loop thread, where signal handlers cannot be restored.
            hooks = life.hooks
            if hooks is not None:
                hooks.uninstall()
        return stats

    def _shutdown_thread(self) -> None:
        stop = self._stop
        if stop is not None:
            self.portal.call(stop.set)
        self._thread.join(timeout=5.0)
