"""The sidecars a ParquetSink writes beside its files (`asynctrace.sinks._parquet_sidecar`): each
file's index rows and words, read instead of the file where they pass every check here.

A sidecar is data from the archive, trusted no more than its files: it is read only from the
archive's own hidden folder, under the name its file gives (never a path it names), as a regular
file (not a link), of exactly the expected columns and types, made by this version, for a file of
exactly its recorded size and row count. Anything else (missing, damaged, hostile, stale) is
ignored: the file is then read as if there were no sidecar.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

import duckdb
import orjson

from ..sinks._parquet_sidecar import SIDECAR_KEY, SIDECAR_VERSION, index_path, words_path
from . import _text

__all__ = ["INDEX_COLUMNS", "index_sidecars", "words_sidecar"]

# The index sidecar's columns, in order, with their DuckDB types (as `parquet_schema` reads them).
INDEX_COLUMNS: tuple[tuple[str, str], ...] = (
    ("rn", "INT64"),
    ("id", "BYTE_ARRAY"),
    ("step", "INT64"),
    ("split", "BYTE_ARRAY"),
    ("grp", "BYTE_ARRAY"),
    ("prompt", "BYTE_ARRAY"),
    ("reward", "DOUBLE"),
    ("advantage", "DOUBLE"),
    ("policy_version", "INT64"),
    ("stop_reason", "BYTE_ARRAY"),
    ("rlen", "INT64"),
    ("tok", "BOOLEAN"),
)
_WORDS_COLUMNS: tuple[tuple[str, str], ...] = (("blk", "INT32"), ("w", "BYTE_ARRAY"))


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _folder(path: Path) -> bool:
    """A directory of its own, not a link to one elsewhere."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _valid(
    con: duckdb.DuckDBPyConnection,
    sidecar: Path,
    file: str,
    columns: tuple[tuple[str, str], ...],
    block: int | None = None,
) -> bool:
    """Whether `sidecar` passes every check (see the module) for archive file `file`."""
    if not _regular(sidecar) or not _folder(sidecar.parent):
        return False
    where = str(sidecar)
    try:
        schema = con.execute(
            "SELECT name, type FROM parquet_schema(?) WHERE name <> 'schema'", [where]
        ).fetchall()
        if tuple((str(n), str(t)) for n, t in schema) != columns:
            return False
        notes = con.execute(
            "SELECT value FROM parquet_kv_metadata(?) WHERE key = ?", [where, SIDECAR_KEY]
        ).fetchall()
        if len(notes) != 1:
            return False
        note = orjson.loads(notes[0][0])
        if not isinstance(note, dict) or note.get("version") != SIDECAR_VERSION:
            return False
        if block is not None and note.get("block") != block:
            return False  # words of blocks of another size than a search reads
        data_rows = con.execute("SELECT num_rows FROM parquet_file_metadata(?)", [file]).fetchone()
        return (
            note.get("size") == os.stat(file).st_size
            and data_rows is not None
            and note.get("rows") == data_rows[0]
            and (columns is not INDEX_COLUMNS or _rows(con, where) == data_rows[0])
        )
    except (duckdb.Error, OSError, orjson.JSONDecodeError, TypeError, ValueError):
        return False


def _rows(con: duckdb.DuckDBPyConnection, where: str) -> int | None:
    row = con.execute("SELECT num_rows FROM parquet_file_metadata(?)", [where]).fetchone()
    return int(row[0]) if row else None


def index_sidecars(con: duckdb.DuckDBPyConnection, files: Sequence[str]) -> dict[str, str]:
    """The valid index sidecar of each of these archive files that has one: file -> its path."""
    found: dict[str, str] = {}
    for file in files:
        sidecar = index_path(Path(file))
        if _valid(con, sidecar, file, INDEX_COLUMNS):
            found[file] = str(sidecar)
    return found


def words_sidecar(con: duckdb.DuckDBPyConnection, file: str) -> str | None:
    """The valid words sidecar of this archive file, if it has one."""
    sidecar = words_path(Path(file))
    return str(sidecar) if _valid(con, sidecar, file, _WORDS_COLUMNS, _text.BLOCK) else None
