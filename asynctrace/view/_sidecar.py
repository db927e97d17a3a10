"""The sidecars a ParquetSink writes beside its files (`asynctrace.sinks._parquet_sidecar`): each
file's index rows (in row order, with its summary in the footer, and by prompt) and its words,
queried where they lie instead of reading the file, where they pass every check here.

A sidecar is data from the archive, trusted no more than its files: it is read only from the
archive's own hidden folder, under the name its file gives (never a path it names), as a regular
file (not a link), of exactly the expected columns and types, made by this version, for a file of
exactly its recorded size and row count. Anything else (missing, damaged, hostile, stale) is
ignored: the file is then read as if there were no sidecar. Each is checked when first needed: the
index sidecar (and its summary) at the first open, the by-prompt one at the first question by
prompt, the words one when the text index is built.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import duckdb
import orjson

from ..sinks._parquet_sidecar import SIDECAR_KEY, SIDECAR_VERSION, index_path, sidecar_path, words_path
from ..sinks._parquet_summary import SUMMARY_KEY
from . import _text
from ._partials import FileSummary, parse_summary

__all__ = ["INDEX_COLUMNS", "Sidecars", "by_prompt_sidecars", "index_sidecars", "words_sidecar"]

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


class Sidecars(NamedTuple):
    """The sidecars of one archive file a query reads, each a path: its index rows in row order
    and by prompt (the same path as in row order until the by-prompt one is checked, or where it
    fails: see `by_prompt_sidecars`)."""

    by_row: str
    by_prompt: str


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
    """What a sidecar's footer and its file's say: its columns, its notes, both row counts, and
    the summaries it carries (an index sidecar's)."""

    schema: list[tuple[str, str]]
    notes: list[str]
    rows: int | None
    data_rows: int | None
    summaries: list[bytes]


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
    summaries: dict[str, list[bytes]] = {s: [] for s in sidecars}
    for name, key, value in con.execute(
        "SELECT file_name, key, value FROM parquet_kv_metadata($f) WHERE key IN ($k, $s)",
        {"f": sidecars, "k": SIDECAR_KEY, "s": SUMMARY_KEY},
    ).fetchall():
        (notes if bytes(key) == SIDECAR_KEY else summaries)[str(name)].append(value)
    rows = dict(
        con.execute(
            "SELECT file_name, num_rows FROM parquet_file_metadata($f)",
            {"f": list(dict.fromkeys(sidecars + files))},
        ).fetchall()
    )
    return [_Facts(schema[s], notes[s], rows.get(s), rows.get(f), summaries[s]) for s, f in pairs]


def _checked(
    con: duckdb.DuckDBPyConnection,
    pairs: Sequence[tuple[Path, str]],
    columns: tuple[tuple[str, str], ...],
    block: int | None = None,
) -> list[_Facts | None]:
    """The facts of each (sidecar, file) pair that passes every check (see the module) with these
    `columns`, None for the others. Every footer is read in three queries, whatever the pairs."""
    ok = [_regular(sidecar) and _folder(sidecar.parent) for sidecar, _ in pairs]
    todo = [(str(sidecar), file) for (sidecar, file), good in zip(pairs, ok, strict=True) if good]
    if not todo:
        return [None for _ in pairs]
    try:
        facts = _facts(con, todo)
    except duckdb.Error:  # one of them unreadable: each on its own
        facts = []
        for pair in todo:
            try:
                facts.extend(_facts(con, [pair]))
            except duckdb.Error:
                facts.append(_Facts([], [], None, None, []))
    verdicts = iter(
        f if _passes(f, file, columns, block) else None for f, (_, file) in zip(facts, todo, strict=True)
    )
    return [next(verdicts) if good else None for good in ok]


def index_sidecars(
    con: duckdb.DuckDBPyConnection, files: Sequence[str], summaries: dict[str, FileSummary] | None = None
) -> dict[str, Sidecars]:
    """The sidecars of each of these archive files whose index sidecar is valid: file -> their
    paths (a file whose index sidecar is missing or fails is read instead; its by-prompt one is
    checked later, `by_prompt_sidecars`). With `summaries`, each such file's summary is put there,
    and a file whose summary fails is left out too."""
    pairs = [(index_path(Path(f)), f) for f in files]
    found: dict[str, Sidecars] = {}
    for (sidecar, f), facts in zip(pairs, _checked(con, pairs, INDEX_COLUMNS), strict=True):
        if facts is None:
            continue
        if summaries is not None:
            summary = parse_summary(facts.summaries[0]) if len(facts.summaries) == 1 else None
            if summary is None:
                continue
            summaries[f] = summary
        found[f] = Sidecars(str(sidecar), str(sidecar))
    return found


def by_prompt_sidecars(con: duckdb.DuckDBPyConnection, files: Sequence[str]) -> dict[str, str]:
    """The valid by-prompt sidecar of each of these archive files that has one: file -> its path."""
    pairs = [(sidecar_path(Path(f), "byprompt"), f) for f in files]
    return {
        f: str(sidecar)
        for (sidecar, f), facts in zip(pairs, _checked(con, pairs, INDEX_COLUMNS), strict=True)
        if facts is not None
    }


def words_sidecar(con: duckdb.DuckDBPyConnection, file: str) -> str | None:
    """The valid words sidecar of this archive file, if it has one."""
    sidecar = words_path(Path(file))
    return str(sidecar) if _checked(con, [(sidecar, file)], _WORDS_COLUMNS, _text.BLOCK)[0] else None
