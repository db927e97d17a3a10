"""The spool's directory: private to this user, locked to one session, and its write errors told."""

from __future__ import annotations

import contextlib
import math
import os
import stat
import time
from pathlib import Path

from .._runtime import forks
from .._security import describe, logger
from ..exceptions import SpoolError

try:  # POSIX; elsewhere the directory is simply not locked
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "SpoolDir", "WriteErrors"]

LOCK_NAME = ".lock"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
ERROR_LOG_INTERVAL = 60.0


class SpoolDir:
    """Creates or checks the directory (0700) and holds its lock while the session has it open.

    `within`: another `SpoolDir` of the same directory, already locked, whose lock this one
    shares instead of taking its own: `asynctrace recover` holds the lock across the sessions it
    opens one after another, so that no other process (a second recover, a restarted trainer)
    takes the directory between them.
    """

    def __init__(self, directory: Path, *, within: SpoolDir | None = None) -> None:
        self.directory = directory
        self._lock_fd: int | None = None
        self._within = within

    @property
    def locked(self) -> bool:
        return self._lock_fd is not None

    def lock(self) -> None:
        directory = self.directory
        if self._within is not None:
            if not self._within.locked:
                raise SpoolError(f"the spool directory {directory} is no longer locked by its recovery")
            return
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise SpoolError(f"cannot create the spool directory {directory}: {describe(exc)}") from exc
        if not directory.is_dir():
            raise SpoolError(f"the spool path {directory} is not a directory")
        mode = directory.stat().st_mode & 0o777
        if mode & 0o077:
            # Samples can hold private data: the spool is for this user only.
            try:
                directory.chmod(0o700)
            except OSError as exc:
                raise SpoolError(
                    f"the spool directory {directory} is accessible to other users "
                    f"(mode {mode:o}) and cannot be made private: {describe(exc)}"
                ) from exc
        try:
            # A spool directory gets copied between machines and people: its lock file is opened
            # only as the regular file it is, never through a link (truncated and written below).
            flags = os.O_RDWR | os.O_CREAT | _NOFOLLOW | os.O_NONBLOCK
            fd = os.open(directory / LOCK_NAME, flags, 0o600)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise SpoolError(f"the spool directory's {LOCK_NAME} is not a regular file")
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    owner = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise SpoolError(
                        f"the spool directory {directory} is in use by another session "
                        f"(process {owner}); give each session its own spool_dir"
                    ) from None
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        except OSError as exc:  # a read-only or vanished directory, no permission
            raise SpoolError(f"cannot lock the spool directory {directory}: {describe(exc)}") from exc
        self._lock_fd = fd
        forks.hold(self, self._after_fork_in_child)

    def unlock(self) -> None:
        """Let go of the lock (a shared one stays with its holder)."""
        fd, self._lock_fd = self._lock_fd, None
        forks.release(self)
        if fd is not None:
            if fcntl is not None:
                # Explicitly: closing releases it only if no forked process still has the file open.
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _after_fork_in_child(self) -> None:
        # A flock belongs to the open file, which fork shares: a child (a DataLoader worker, say)
        # that outlived a killed session would otherwise keep its spool locked against the next one.
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class WriteErrors:
    """Failed spool writes: counted as `unspooled`, told once a minute, and when writes work again."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.unspooled = 0
        self.last_error: str | None = None
        self._failing = False
        self._failed_since = 0
        self._logged_at = -math.inf
        self._logged = False

    def failed(self, error: str, records: int) -> None:
        self.unspooled += records
        self.last_error = error
        if not self._failing:
            self._failing = True
            self._failed_since = 0
        # A nearly full disk flaps (small writes fit, large ones do not): say it once a minute.
        now = time.monotonic()
        if now - self._logged_at >= ERROR_LOG_INTERVAL:
            self._logged_at = now
            self._logged = True
            logger.error(
                "asynctrace: cannot write to the spool in %s (%s); records are still delivered to "
                "the sinks, but are not crash-safe until spool writes succeed again; the loss is "
                "counted in stats().spool.unspooled",
                self.directory,
                error,
            )
        self._failed_since += records

    def succeeded(self) -> None:
        """Records were written again."""
        if self._failing and self._logged:
            logger.warning(
                "asynctrace: spool writes to %s succeed again (%d records were not spooled)",
                self.directory,
                self._failed_since,
            )
            self._logged = False
        self._failing = False
