"""The Trackio run a `TrackioWriter` logs to: opened with `trackio.init`, and on the public path
finished after a write (Trackio's only public flush) and opened again for the next.

Imported in the writer only (it imports Trackio).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["TrackioRun"]


class TrackioRun:
    """One Trackio run, by name (or by the id of a run another process opened)."""

    def __init__(
        self,
        project: str,
        name: str,
        *,
        space_id: str | None,
        server_url: str | None,
        init_kwargs: Mapping[str, Any],
        run_id: str | None,
        quiet: bool,
    ) -> None:
        """`quiet`: silence what Trackio prints when the run is opened again or finished to flush
        it, by redirecting this process's stdout meanwhile: only for a process whose console is
        the writer's own (the writer process)."""
        self.project = project
        self.name = name
        self.space_id = space_id
        self.server_url = server_url
        self.init_kwargs = dict(init_kwargs)
        self.run_id = run_id
        self.quiet = quiet
        #: The `trackio.Run`, once opened (the last one after a seal).
        self.run: Any = None
        #: Finished to flush it: opened again (`reopen`) before it logs anything.
        self.sealed = False
        self._busy: list[threading.Thread] = []  # threads of finished runs still committing

    def open(self) -> None:
        """Open the run, or open it again after a seal (`trackio.init` resumes it by name)."""
        import trackio

        kwargs: dict[str, Any] = {
            "embed": False,
            "auto_log_cpu": False,
            "auto_log_gpu": False,
            "resume": "allow",
        }
        kwargs.update(self.init_kwargs)
        if self.run is not None:
            kwargs["resume"] = "allow"  # opened again after a seal: the run exists
        run = trackio.init(
            self.project, name=self.name, space_id=self.space_id, server_url=self.server_url, **kwargs
        )
        if self.run_id is not None:
            # Joining a run another process opened (TRL's own, say): Trackio resumes a run by
            # name only once it has logged something, so two processes opening one name at the
            # same moment would make two runs. By id, this one writes where the other does;
            # the run's config stays its owner's.
            run.id = self.run_id
            run._config_logged = True
        elif self.run is not None and run.id != self.run.id:
            # Opened again after a seal: the same run, even if another of its name began since.
            run.id = self.run.id
        self.run = run
        self.sealed = False

    def reopen(self) -> None:
        """Open the run again if it was sealed."""
        if self.sealed:
            self.quietly(self.open)

    def is_local(self) -> bool:
        """Whether the run writes to local SQLite, as Trackio itself decided in `init`.

        Trackio also reads ``TRACKIO_SPACE_ID`` / ``TRACKIO_SERVER_URL`` from the environment,
        so the constructor's arguments alone cannot tell: the opened run knows, where it says
        (a private attribute); else Trackio's own resolution; else the variables it documents.
        """
        is_local = getattr(self.run, "_is_local", None)
        if isinstance(is_local, bool):
            return is_local
        from trackio import utils

        resolve = getattr(utils, "resolve_space_id_and_server_url", None)
        if callable(resolve):
            space_id, server_url = resolve(self.space_id, self.server_url)
            return space_id is None and server_url is None
        remote = (self.space_id, self.server_url, os.environ.get("TRACKIO_SPACE_ID"))
        return not any(remote) and not os.environ.get("TRACKIO_SERVER_URL")

    def seal(self) -> None:
        """Finish the run: Trackio commits what it was given before `finish` returns, unless a
        commit outlasts finish's own wait (30 s in 0.43); its threads are then kept until they
        end (`settled`)."""
        if self.run is None or self.sealed:
            return
        # Any thread the run holds, whatever Trackio calls it: its sender thread among them.
        held = getattr(self.run, "__dict__", {}).values()
        threads = [v for v in held if isinstance(v, threading.Thread)]
        try:
            self.quietly(self.run.finish)
        finally:
            self._forget()
            self.sealed = True
            self._busy += [t for t in threads if t.is_alive()]

    def settled(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the threads of sealed runs; whether all have ended."""
        deadline = time.monotonic() + timeout
        for thread in self._busy:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._busy = [t for t in self._busy if t.is_alive()]
        return not self._busy

    def finish(self) -> None:
        """Finish the run for good (a sealed one is finished already)."""
        if self.run is not None and not self.sealed:
            self.run.finish()
            self._forget()
            self.sealed = True

    def _forget(self) -> None:
        """trackio.init made the run current; clear that, so Trackio's own exit hook does not
        finish it a second time."""
        import trackio

        current = getattr(getattr(trackio, "context_vars", None), "current_run", None)
        if current is not None and current.get() is self.run:
            current.set(None)

    def quietly(self, call: Callable[[], object]) -> None:
        """`call()`, with this process's stdout silenced where `quiet` allows it."""
        if not self.quiet:
            call()
            return
        with contextlib.redirect_stdout(io.StringIO()):
            call()
