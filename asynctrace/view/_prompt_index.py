"""One by-prompt index for the whole archive (`archive.byprompt.parquet` in the sidecar folder):
every record's index row of the files it covers, sorted by prompt id, in row groups of a few
prompts each, so that a question about one prompt reads one or two row groups of one file, not
the by-prompt sidecar of each of the ~100 files that hold it (a prompt recurs over the run).

The viewer writes it in the background after a first open (`build`), under a temporary name of
the sidecar makers' pattern (`remove_leftovers` removes a killed builder's), then renames it.
Its footer lists the files it covers (name, size, rows); a later start reads it for those files
where each is still there, the same size and row count, and held through its sidecars, and the
other files' own by-prompt sidecars as before.

It is data from the archive, trusted no more than a sidecar (`_sidecar`): read only from the
archive's own hidden folder, as a regular file (not a link), of exactly these columns, made by
this version, its list of files parsed as data (names, never paths); anything else is ignored,
and a new one is written.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import duckdb
import orjson

from ..sinks._parquet_sidecar import SIDECAR_FOLDER
from ._sidecar import INDEX_COLUMNS
from ._sql import quoted

__all__ = ["PROMPT_INDEX", "PROMPT_INDEX_COLUMNS", "Covered", "PromptIndex", "build", "discard", "read"]

PROMPT_INDEX = "archive.byprompt.parquet"
# Its footer's key: the version and the files it covers (orjson).
_KEY = "asynctrace.archive"
_VERSION = 1
# The index sidecar's columns and the covered file's number in the footer's list.
PROMPT_INDEX_COLUMNS: tuple[tuple[str, str], ...] = (*INDEX_COLUMNS, ("f", "INT32"))
# Rows a row group: a prompt's ~2,000 records at 10M lie in one or two. Smaller groups cost more
# than they save: DuckDB weighs each row group's statistics of each column at every query
# (4,882 groups of 2,048 rows: 350 ms a prompt, against 50-100 ms for 153 of 65,536).
_ROW_GROUP = 65_536


class Covered(NamedTuple):
    """A file the index covers: its name in the archive's folder, its size and its rows."""

    name: str
    size: int
    rows: int


class PromptIndex(NamedTuple):
    """A valid archive-wide by-prompt index: its path, and its files in the order of column `f`."""

    path: str
    covered: list[Covered]


def path_of(directory: Path) -> Path:
    """Where an archive directory's by-prompt index lies."""
    return directory / SIDECAR_FOLDER / PROMPT_INDEX


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode) and stat.S_ISDIR(os.lstat(path.parent).st_mode)
    except OSError:
        return False


def _covered(note: object) -> list[Covered] | None:
    """The footer's note as data: its list of covered files, or None where it is not exactly one."""
    if (
        not isinstance(note, dict)
        or note.get("version") != _VERSION
        or not isinstance(note.get("files"), list)
    ):
        return None
    out = []
    for entry in note["files"]:
        if not isinstance(entry, dict):
            return None
        name, size, rows = entry.get("name"), entry.get("size"), entry.get("rows")
        if not isinstance(name, str) or not name or "/" in name or os.sep in name or name.startswith("."):
            return None  # a name in the archive's folder, never a path
        if type(size) is not int or type(rows) is not int or size < 0 or rows < 0:
            return None
        out.append(Covered(name, size, rows))
    return out if len({c.name for c in out}) == len(out) else None


def read(con: duckdb.DuckDBPyConnection, directory: Path) -> PromptIndex | None:
    """The archive's by-prompt index where its footer passes every check (see the module), else
    None. Whether its covered files are still those of the archive is the caller's to check."""
    path = path_of(directory)
    if not _regular(path):
        return None
    try:
        schema = con.execute(
            "SELECT name, type, num_children FROM parquet_schema($f)", {"f": str(path)}
        ).fetchall()
        notes = con.execute(
            "SELECT value FROM parquet_kv_metadata($f) WHERE key = $k", {"f": str(path), "k": _KEY.encode()}
        ).fetchall()
        rows = con.execute("SELECT num_rows FROM parquet_file_metadata($f)", {"f": str(path)}).fetchall()
    except duckdb.Error:
        return None
    # Its root (named by its writer), then exactly these columns, none of them nested.
    if not schema or schema[0][1] is not None or schema[0][2] != len(PROMPT_INDEX_COLUMNS):
        return None
    if tuple((str(n), str(t)) for n, t, _ in schema[1:]) != PROMPT_INDEX_COLUMNS:
        return None
    if any(children for _, _, children in schema[1:]) or len(notes) != 1 or len(rows) != 1:
        return None
    try:
        covered = _covered(orjson.loads(notes[0][0]))
    except orjson.JSONDecodeError:
        return None
    if covered is None or sum(c.rows for c in covered) != rows[0][0]:
        return None
    return PromptIndex(str(path), covered)


def discard(directory: Path) -> None:
    """Remove the archive's by-prompt index, found damaged past its footer (which every start
    would check and take again), so that the next start writes a new one: only the regular file
    of that name in the archive's own folder."""
    path = path_of(directory)
    if _regular(path):
        with contextlib.suppress(OSError):
            os.unlink(path)


def build(con: duckdb.DuckDBPyConnection, directory: Path, files: Sequence[tuple[str, str, int]]) -> bool:
    """Write the by-prompt index of these files, each (file, its checked by-prompt sidecar, its
    rows), through `con` (a connection of its own: the caller sets its threads and memory).
    Written under a temporary name, then renamed; whether it was."""
    folder = directory / SIDECAR_FOLDER
    covered = [
        {"name": os.path.basename(f), "size": os.stat(f).st_size, "rows": int(rows)} for f, _, rows in files
    ]
    note = orjson.dumps({"version": _VERSION, "files": covered}).decode()
    # The sidecar makers' temporary pattern (`.<name>.<kind>.parquet.<pid>.tmp`): a killed
    # builder's is removed as theirs are (`remove_leftovers`).
    temporary = folder / f".archive.byprompt.parquet.{os.getpid()}.tmp"
    listed = "[" + ", ".join(quoted(s) for _, s, _ in files) + "]"
    columns = ", ".join(name for name, _ in INDEX_COLUMNS)
    try:
        con.execute("CREATE OR REPLACE TEMP TABLE covered_src (filename VARCHAR, f INTEGER)")
        con.execute(
            "INSERT INTO covered_src SELECT unnest($s), unnest($f)",
            {"s": [s for _, s, _ in files], "f": list(range(len(files)))},
        )
        con.execute(
            f"COPY (SELECT {columns}, f FROM read_parquet({listed}, filename = true) "
            "JOIN covered_src USING (filename) ORDER BY prompt, f, rn) "
            f"TO {quoted(str(temporary))} (FORMAT parquet, ROW_GROUP_SIZE {_ROW_GROUP}, "
            f"KV_METADATA {{{quoted(_KEY)}: {quoted(note)}}})"
        )
        os.replace(temporary, folder / PROMPT_INDEX)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
