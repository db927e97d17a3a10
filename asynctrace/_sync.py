"""The blocking face of a session: its event loop on a daemon thread, behind a blocking portal."""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
from anyio.from_thread import BlockingPortal

from . import _shutdown
from ._record import SampleLike
from ._stats import SessionStats
from .exceptions import SessionClosedError

if TYPE_CHECKING:
    from ._session import TraceSession

__all__ = ["SyncTraceSession"]


class SyncTraceSession:
    """The blocking face of a `TraceSession`, returned by ``with TraceSession(...) as s``."""

    def __init__(self, session: TraceSession) -> None:
        self.session = session

    @property
    def project(self) -> str:
        return self.session.project

    @property
    def run(self) -> str:
        return self.session.run

    def log_samples(
        self,
        samples: SampleLike | Iterable[SampleLike],
        *,
        step: int,
        split: str = "train",
        timeout: float | None = None,
    ) -> int:
        """Blocking: waits for room under ``on_full="block"`` (at most `timeout` seconds)."""
        return self.session._log_blocking(samples, step, split, timeout)

    def log_samples_nowait(
        self, samples: SampleLike | Iterable[SampleLike], *, step: int, split: str = "train"
    ) -> int:
        """Never blocks; see `TraceSession.log_samples_nowait`."""
        return self.session.log_samples_nowait(samples, step=step, split=split)

    def log_metrics(self, metrics: Mapping[str, float], *, step: int) -> None:
        """Queue scalar metrics for `step`."""
        self.session._push_metrics(metrics, step)

    def log_rollouts(self, input_ids: Any, *, tokenizer: Any, step: int, **kwargs: Any) -> int:
        """Blocking `TraceSession.log_rollouts`."""
        runner = self.session._sync
        assert runner is not None
        call = functools.partial(
            self.session.log_rollouts, input_ids, tokenizer=tokenizer, step=step, **kwargs
        )
        return int(runner.call(call))

    def flush(self, timeout: float | None = None) -> bool:
        """Blocking `TraceSession.flush`."""
        runner = self.session._sync
        assert runner is not None
        return bool(runner.call(self.session.flush, timeout))

    def finish(self, timeout: float | None = None) -> SessionStats:
        """Drain, close every sink and stop the writer thread; idempotent."""
        runner = self.session._sync
        assert runner is not None
        return runner.close(self.session.finish_timeout if timeout is None else timeout)

    def stats(self) -> SessionStats:
        return self.session.stats()

    def __enter__(self) -> SyncTraceSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


class _SyncRunner:
    """Runs a session's event loop on a daemon thread, reachable through a blocking portal."""

    def __init__(self, session: TraceSession) -> None:
        self.session = session
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
        _shutdown.register_runner(self)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            if self._closed:
                raise SessionClosedError("the session is finished")
        return self.portal.call(fn, *args)

    def close(self, timeout: float) -> SessionStats:
        with self._lock:
            if self._closed:
                return self.session.stats() if self.session._final is None else self.session._final
            self._closed = True
        _shutdown.unregister_runner(self)
        try:
            stats: SessionStats = self.portal.call(self.session.finish, timeout)
            self._cm.__exit__(None, None, None)
        finally:
            self._shutdown_thread()
            # finish() ran on the loop thread, where signal handlers cannot be restored.
            hooks = self.session._hooks
            if hooks is not None:
                hooks.uninstall()
        return stats

    def _shutdown_thread(self) -> None:
        stop = self._stop
        if stop is not None:
            self.portal.call(stop.set)
        self._thread.join(timeout=5.0)
