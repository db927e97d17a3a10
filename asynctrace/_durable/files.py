"""A spool's files on disk: found by a scan, created when a commit needs one, written whole or
not at all, closed; the spool decides what goes into them (see spool.py)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .._security import describe
from . import segments as seg
from .books import Books, SpoolFile
from .directory import WriteErrors

__all__ = ["SpoolFiles"]


class SpoolFiles:
    """One session's files of a spool directory: the table of `books`, by index and by name, the
    active segment and dead-letter file it appends to, and its write errors."""

    def __init__(
        self,
        directory: Path,
        books: Books,
        *,
        project: str,
        run: str,
        session: str,
        segment_bytes: int,
    ) -> None:
        self.directory = directory
        self.books = books
        self.table = books.files  # the books decide which files may go; these are made here
        self.errors = WriteErrors(directory)
        self._by_name: dict[str, SpoolFile] = {}
        self._project = project
        self._run = run
        self._session = session
        self._segment_bytes = segment_bytes  # a segment this large is closed and a new one begun
        self._next = 0
        self._made = 0
        self._active: SpoolFile | None = None
        self._dead: SpoolFile | None = None

    def register(self, scan: seg.FileScan) -> SpoolFile:
        """Take up a file a scan found: an empty one is deleted, an unreadable one set aside."""
        f = SpoolFile(self._next, scan.name, scan.path, scan.kind, size=scan.size, session=scan.session)
        f.tiers = bool(scan.tiers)
        self._next += 1
        if scan.empty:
            self.unlink(f)
        elif not scan.usable:
            # Its records cannot be attributed to a project and run: set it aside, keep it.
            quarantine = scan.path.with_name(scan.name + seg.CORRUPT_SUFFIX)
            with contextlib.suppress(OSError):
                scan.path.rename(quarantine)
                f.path = quarantine
            f.keep = True
        else:
            f.live = len(scan.unresolved)
        self.table[f.index] = f
        self._by_name[f.name] = f
        for name in scan.deps:
            dep = self._by_name.get(name)
            if dep is not None:
                f.deps.add(dep.index)
        return f

    def named(self, name: str) -> SpoolFile:
        """The file registered under `name`."""
        return self._by_name[name]

    def ensure(self, kind: seg.FileKind) -> SpoolFile | None:
        """The file a commit appends `kind` lines to, a new one when there is none or it is
        full; None when none can be created (the error is told)."""
        current = self._active if kind == seg.SEGMENT else self._dead
        if current is not None and current.fd is not None and current.size < self._segment_bytes:
            return current
        if current is not None:
            self.close(current)
        name = seg.new_file_name(kind, self._session, self._made)
        self._made += 1
        path = self.directory / name
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        except OSError as exc:
            self.errors.failed(describe(exc), 0)
            return None
        f = SpoolFile(self._next, name, path, kind, fd=fd, session=self._session)
        self._next += 1
        self.table[f.index] = f
        self._by_name[name] = f
        head = seg.header_line(self._project, self._run, self._session, kind)
        # A new segment starts with every tier total, so the newest one holds them all.
        state = self.books.tier_lines(None) if kind == seg.SEGMENT else b""
        error = self.append(f, head + state)
        if error is not None:
            self.errors.failed(error, 0)
            self.close(f)
            self.unlink(f)
            return None
        if kind == seg.SEGMENT:
            self._active = f
            if state:
                f.tiers = True
        else:
            self._dead = f
        return f

    def append(self, f: SpoolFile, data: bytes) -> str | None:
        """Append all of `data` or nothing: a failed write is truncated away, so no torn line stays."""
        assert f.fd is not None
        view = memoryview(data)
        try:
            while view:
                n = os.write(f.fd, view)
                view = view[n:]
        except OSError as exc:
            try:
                os.ftruncate(f.fd, f.size)
            except OSError:
                # The partial line cannot be removed: nothing more goes into this file.
                self.close(f)
            return describe(exc)
        f.size += len(data)
        return None

    def close(self, f: SpoolFile) -> None:
        fd, f.fd = f.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        if f is self._active:
            self._active = None
        if f is self._dead:
            self._dead = None

    def close_all(self) -> None:
        for f in list(self.table.values()):
            if f.fd is not None:
                self.close(f)

    def unlink(self, f: SpoolFile) -> None:
        with contextlib.suppress(FileNotFoundError):
            f.path.unlink()
        f.deleted = True

    def present(self) -> list[SpoolFile]:
        """The files not deleted yet."""
        # list() copies in one step: a commit on another thread may add or drop files meanwhile.
        return [f for f in list(self.table.values()) if not f.deleted]
