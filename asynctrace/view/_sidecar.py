"""The sidecars a ParquetSink writes beside its files (`asynctrace.sinks._parquet_sidecar`): each
file's index rows (in row order and by prompt), its overview's rows and prompt counts, and its
words, queried where they lie instead of reading the file, where they pass every check here.

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
from typing import NamedTuple

import duckdb
import orjson

from ..sinks._parquet_sidecar import SIDECAR_KEY, SIDECAR_VERSION, sidecar_path, words_path
from . import _text

__all__ = ["INDEX_COLUMNS", "Sidecars", "index_sidecars", "words_sidecar"]

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
# The ``steps`` sidecar's: the overview's row (`_model.StepRow`) of each step of the file.
_STEPS_COLUMNS: tuple[tuple[str, str], ...] = (
    ("split", "BYTE_ARRAY"),
    ("step", "INT64"),
    ("samples", "INT64"),
    ("reward_mean", "DOUBLE"),
    ("reward_std", "DOUBLE"),
    ("groups", "INT64"),
    ("zero_signal", "INT64"),
    ("mean_spread", "DOUBLE"),
    ("truncated", "DOUBLE"),
    ("length_mean", "DOUBLE"),
    ("lag_mean", "DOUBLE"),
    ("lag_max", "INT64"),
)
_COUNTS_COLUMNS: tuple[tuple[str, str], ...] = (
    ("prompt", "BYTE_ARRAY"),
    ("steps", "INT64"),
    ("samples", "INT64"),
)


class Sidecars(NamedTuple):
    """The valid sidecars of one archive file, each a path: its index rows in row order and by
    prompt, its overview's rows of its steps, and its prompts' counts."""

    by_row: str
    by_prompt: str
    steps: str
    counts: str


# The sidecars a file's index is read from, each kind with its columns (every one must pass).
_KINDS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("index", INDEX_COLUMNS),
    ("byprompt", INDEX_COLUMNS),
    ("steps", _STEPS_COLUMNS),
    ("counts", _COUNTS_COLUMNS),
)


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


class _Facts(NamedTuple):
    """What a sidecar's footer and its file's say: its columns, its notes, both row counts."""

    schema: list[tuple[str, str]]
    notes: list[str]
    rows: int | None
    data_rows: int | None


def _passes(facts: _Facts, file: str, columns: tuple[tuple[str, str], ...], block: int | None) -> bool:
    """Whether a sidecar with these facts passes every check (see the module) for `file`."""
    if tuple(facts.schema) != columns or len(facts.notes) != 1:
        return False
    try:
        note = orjson.loads(facts.notes[0])
        size = os.stat(file).st_size
    except (orjson.JSONDecodeError, OSError):
        return False
    if not isinstance(note, dict) or note.get("version") != SIDECAR_VERSION:
        return False
    if block is not None and note.get("block") != block:
        return False  # words of blocks of another size than a search reads
    rows_match = columns is not INDEX_COLUMNS or facts.rows == facts.data_rows  # a row a record
    return (
        note.get("size") == size
        and facts.data_rows is not None
        and note.get("rows") == facts.data_rows
        and rows_match
    )


def _facts(con: duckdb.DuckDBPyConnection, pairs: Sequence[tuple[str, str]]) -> list[_Facts]:
    """The facts of each (sidecar, file) pair, read from their footers in three queries; a
    footer DuckDB cannot read fails them all (the caller then asks one pair at a time)."""
    sidecars, files = [p[0] for p in pairs], [p[1] for p in pairs]
    schema: dict[str, list[tuple[str, str]]] = {s: [] for s in sidecars}
    for name, column, kind in con.execute(
        "SELECT file_name, name, type FROM parquet_schema($f) WHERE name <> 'schema'", {"f": sidecars}
    ).fetchall():
        schema[str(name)].append((str(column), str(kind)))
    notes: dict[str, list[str]] = {s: [] for s in sidecars}
    for name, value in con.execute(
        "SELECT file_name, value FROM parquet_kv_metadata($f) WHERE key = $k",
        {"f": sidecars, "k": SIDECAR_KEY},
    ).fetchall():
        notes[str(name)].append(value)
    rows = dict(
        con.execute(
            "SELECT file_name, num_rows FROM parquet_file_metadata($f)",
            {"f": list(dict.fromkeys(sidecars + files))},
        ).fetchall()
    )
    return [_Facts(schema[s], notes[s], rows.get(s), rows.get(f)) for s, f in pairs]


def _checked(
    con: duckdb.DuckDBPyConnection,
    pairs: Sequence[tuple[Path, str]],
    columns: Sequence[tuple[tuple[str, str], ...]],
    block: int | None = None,
) -> list[bool]:
    """Whether each (sidecar, file) pair passes every check (see the module), with its `columns`
    (the same place in the list). Every footer is read in three queries, whatever the pairs."""
    ok = [_regular(sidecar) and _folder(sidecar.parent) for sidecar, _ in pairs]
    todo = [(str(sidecar), file) for (sidecar, file), good in zip(pairs, ok, strict=True) if good]
    specs = [spec for spec, good in zip(columns, ok, strict=True) if good]
    if not todo:
        return ok
    try:
        facts = _facts(con, todo)
    except duckdb.Error:  # one of them unreadable: each on its own
        facts = []
        for pair in todo:
            try:
                facts.extend(_facts(con, [pair]))
            except duckdb.Error:
                facts.append(_Facts([], [], None, None))
    verdicts = iter(
        _passes(f, file, spec, block) for f, (_, file), spec in zip(facts, todo, specs, strict=True)
    )
    return [good and next(verdicts) for good in ok]


def index_sidecars(con: duckdb.DuckDBPyConnection, files: Sequence[str]) -> dict[str, Sidecars]:
    """The valid sidecars of each of these archive files that has every kind of them valid:
    file -> their paths (a file with one missing or failing is read instead)."""
    pairs = [(sidecar_path(Path(f), kind), f) for f in files for kind, _ in _KINDS]
    specs = [columns for _ in files for _, columns in _KINDS]
    good = {f: True for f in files}
    for (_, f), ok in zip(pairs, _checked(con, pairs, specs), strict=True):
        good[f] = good[f] and ok
    return {f: Sidecars(*(str(sidecar_path(Path(f), kind)) for kind, _ in _KINDS)) for f in files if good[f]}


def words_sidecar(con: duckdb.DuckDBPyConnection, file: str) -> str | None:
    """The valid words sidecar of this archive file, if it has one."""
    sidecar = words_path(Path(file))
    return str(sidecar) if _checked(con, [(sidecar, file)], [_WORDS_COLUMNS], _text.BLOCK)[0] else None
