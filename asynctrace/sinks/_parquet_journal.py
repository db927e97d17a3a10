"""ParquetSink's journals: one a file, `.<stem>-<n>.journal`, holding the records of
`<stem>-<n>.parquet` until that file is named.

A journal's first line says asynctrace wrote it (`header`): recovery reads, converts and deletes
only such journals, never another program's hidden files that happen to be named alike. A sink
makes its journal unnamed, locks it (`flock`), writes the header and only then links it under its
final name, exclusively (`create`): a recovery that sees the header and still gets the lock knows
the sink is gone, and a kill never leaves a journal without its header. Where the system cannot
make a file unnamed, the journal is created under its name and locked before the header is
written; one that shows no header is touched by nothing. A journal is opened for recovery without following a
link and only as a regular file (`open_dead`), and the lock is checked to cover the file the name
still holds.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import orjson

from ._appends import write_all

try:  # POSIX; elsewhere a journal is recovered only once its writer is gone for good
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "FORMAT",
    "CLOEXEC",
    "DamagedJournal",
    "DeadJournal",
    "Journal",
    "JournalName",
    "LiveJournal",
    "create",
    "fsync_dir",
    "journal_name",
    "next_index",
    "open_dead",
    "whole_lines",
]

FORMAT = 1
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_KIND = "asynctrace.parquet-journal"
_NAME = re.compile(r"\.(?P<stem>[A-Za-z0-9._-]+)-(?P<number>\d{5,})\.journal")
_HEADER_MAX = 4096


class LiveJournal(Exception):
    """The journal is asynctrace's and its sink is running (it holds the lock)."""


class JournalName(NamedTuple):
    """What a journal's name says: the stem and the number of the file it holds."""

    stem: str
    number: int


class DamagedJournal(NamedTuple):
    """A dead sink's journal that recovery could not take whole: `lines` damaged lines were
    skipped (their records are lost; the rest went into the file), or, with `error`, the journal
    was left as it is."""

    path: Path
    lines: int
    error: str | None = None


class DeadJournal(NamedTuple):
    """A dead sink's journal, open and locked by recovery: its descriptor, where its records start."""

    fd: int
    start: int


@dataclass(slots=True, eq=False)
class Journal:
    """A live sink's journal: its descriptor (appending, locked), where its records start (after
    the header) and end, and how many records and encoded bytes it holds."""

    path: Path
    index: int
    fd: int
    start: int
    end: int
    count: int = 0
    nbytes: int = 0


def journal_name(name: str) -> JournalName | None:
    """The stem and file number a journal's file name gives, or None for another name."""
    match = _NAME.fullmatch(name)
    return JournalName(match["stem"], int(match["number"])) if match else None


def _header(name: JournalName) -> bytes:
    return orjson.dumps({"journal": _KIND, "format": FORMAT, "stem": name.stem, "file": name.number}) + b"\n"


def _header_end(fd: int, name: JournalName) -> int | None:
    """Where the header of the journal open at `fd` ends, or None when it has none for `name`."""
    head = os.pread(fd, _HEADER_MAX, 0)
    cut = head.find(b"\n")
    return cut + 1 if cut >= 0 and head[: cut + 1] == _header(name) else None


def create(directory: Path, name: JournalName) -> Journal:
    """A new journal, locked and with its header: FileExistsError where that name is taken."""
    path = directory / f".{name.stem}-{name.number:05d}.journal"
    header = _header(name)
    fd = _create_whole(directory, path, header)
    if fd is None:
        fd = _create_in_place(path, header)
    return Journal(path, name.number, fd, len(header), len(header))


def _create_whole(directory: Path, path: Path, header: bytes) -> int | None:
    """The journal made unnamed (O_TMPFILE), locked and given its header, then linked under its
    name: a kill at any point leaves either no journal or a whole one, never a file without the
    header that recovery must leave alone for good. None where the system cannot (not Linux, a
    file system without O_TMPFILE, no /proc)."""
    if fcntl is None or not hasattr(os, "O_TMPFILE"):
        return None
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_APPEND | CLOEXEC, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        write_all(fd, [header])
        folder = os.open(directory, os.O_RDONLY | CLOEXEC)
        try:
            # Through /proc and with the directory's descriptor, so that `linkat` follows the
            # link to the unnamed file (os.link would call `link`, which does not follow it).
            os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=folder, follow_symlinks=True)
        finally:
            os.close(folder)
    except FileExistsError:
        os.close(fd)
        raise
    except OSError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _create_in_place(path: Path, header: bytes) -> int:
    """The journal created under its name, then locked and given its header: a kill between the
    two leaves a file without the header, which recovery leaves alone."""
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | CLOEXEC | _NOFOLLOW
    fd = os.open(path, flags, 0o644)
    try:
        if fcntl is not None:
            # Nobody else locks a journal without a header: this never waits.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        write_all(fd, [header])
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def next_index(directory: Path, stem: str) -> int:
    """The number after every file, temporary and journal of `stem` in `directory`."""
    files = re.compile(rf"\.?{re.escape(stem)}-(\d{{5,}})\.parquet(\.tmp)?")
    highest = -1
    for path in directory.iterdir():
        match = files.fullmatch(path.name)
        name = journal_name(path.name)
        if match is not None and (path.name[0] == ".") == bool(match[2]):
            highest = max(highest, int(match[1]))
        elif name is not None and name.stem == stem:
            highest = max(highest, name.number)
    return highest + 1


def open_dead(path: Path) -> DeadJournal | None:
    """A dead sink's journal at `path`, opened and locked: its descriptor and where its records
    start. `LiveJournal` where its sink is running; None for a link, anything but a regular
    file, a file without the header, or one whose name was removed or replaced meanwhile."""
    name = journal_name(path.name)
    if name is None:
        return None
    try:
        # Not following a link, and not waiting on a FIFO: a journal is a file in its place.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | CLOEXEC | _NOFOLLOW)
    except OSError:
        return None
    try:
        start = _locked_start(fd, path, name)
    except BaseException:
        os.close(fd)
        raise
    if start is None:
        os.close(fd)
        return None
    return DeadJournal(fd, start)


def _locked_start(fd: int, path: Path, name: JournalName) -> int | None:
    """Where the records of the dead journal open at `fd` start, once it is locked (see `open_dead`)."""
    opened = os.fstat(fd)
    start = _header_end(fd, name) if stat.S_ISREG(opened.st_mode) else None
    if start is None:
        return None
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LiveJournal(str(path)) from None
    # Its sink may have named its file and removed the journal since it was opened.
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return start if (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino) else None


def whole_lines(fd: int) -> int:
    """Where a journal's last whole line ends (a kill may have cut the last one short)."""
    end = os.lseek(fd, 0, os.SEEK_END)
    step = 2**16
    while end > 0:
        start = max(0, end - step)
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        end = start
    return 0


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
