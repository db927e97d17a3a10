"""ParquetSink's recovery: the journals of sinks that are gone (killed) made into their files.

Only journals asynctrace wrote are touched (`_parquet_journal.open_dead`: the header, a regular
file in its place, not locked by a running sink), and of the temporaries only the one of each
such journal's file. A journal's file gets the name its sink would have given it; where that file
is already there (a kill after the file was named and before the journal was removed), the
journal only goes, once that file is seen to hold the journal's records (else the journal is
left and named). A damaged line is skipped and counted, the rest of the journal is recovered,
and the journal is named in a warning; a journal that cannot be made a file at all is left as it
is and named too. Nothing here raises because of another sink's journal.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import NamedTuple

from .._security import logger
from ..exceptions import PermanentSinkError
from ._parquet_client import Made
from ._parquet_file import FileConverter, file_ids, journal_ids
from ._parquet_journal import (
    CLOEXEC,
    DamagedJournal,
    DeadJournal,
    JournalName,
    LiveJournal,
    fsync_dir,
    journal_name,
    open_dead,
    whole_lines,
)

__all__ = ["Recovered", "recover_journals"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class Recovered(NamedTuple):
    """What one pass over a directory's dead journals did."""

    rows: int
    damaged: list[DamagedJournal]


def recover_journals(directory: Path, compression_level: int | None, own: str | None) -> Recovered:
    """Make the dead journals in `directory` files. A running sink with the stem `own` is a
    `PermanentSinkError` (two sinks cannot share a stem); other running sinks are left alone."""
    rows = 0
    damaged: list[DamagedJournal] = []
    for path in sorted(directory.glob(".*.journal")):
        name = journal_name(path.name)
        if name is None:
            continue
        try:
            dead = open_dead(path)
        except LiveJournal:
            if name.stem == own:
                raise PermanentSinkError(
                    f"ParquetSink: another sink writes with stem {own!r} in {directory}"
                ) from None
            continue
        if dead is None:
            continue  # not asynctrace's, or gone meanwhile
        try:
            made = _to_file(directory, name, dead, compression_level)
            rows += made.rows
            os.unlink(path)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            damaged.append(DamagedJournal(path, 0, why))
            logger.warning("ParquetSink: the journal %s could not be made a file (%s); it is left", path, why)
            continue
        finally:
            os.close(dead.fd)
        if made.damaged:
            damaged.append(DamagedJournal(path, made.damaged))
            logger.warning(
                "ParquetSink: %d damaged lines of the journal %s skipped (their records are lost); "
                "its other %d records are in a file",
                made.damaged,
                path,
                made.rows,
            )
    return Recovered(rows, damaged)


def _to_file(directory: Path, name: JournalName, dead: DeadJournal, level: int | None) -> Made:
    """The dead journal's records as its file, in this thread, a row group at a time."""
    stem = f"{name.stem}-{name.number:05d}"
    final = directory / f"{stem}.parquet"
    temporary = directory / f".{stem}.parquet.tmp"
    end = whole_lines(dead.fd)
    if os.path.lexists(final):
        # Named before the kill, the journal only goes; but only where the file is its own, a
        # regular file holding every record of the journal: another file in its place (left by
        # something else) must not cost the journal its records.
        mine = not os.path.islink(final) and journal_ids(dead.fd, dead.start, end) <= file_ids([final])
        if not mine:
            raise FileExistsError(f"{final.name} is there already and does not hold this journal's records")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        return Made(0, 0)
    # A copy of the descriptor for the converter: the journal stays locked until it is removed.
    reader = os.dup(dead.fd)
    try:
        out = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | CLOEXEC | _NOFOLLOW, 0o644)
    except BaseException:
        os.close(reader)
        raise
    converter = FileConverter(level)
    try:
        converter.start(out, reader, dead.start)
        converter.append(end)
        rows = converter.finish()
        if rows:
            os.replace(temporary, final)
            fsync_dir(directory)
    finally:
        converter.reset()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    return Made(rows, converter.damaged)
