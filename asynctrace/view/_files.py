"""The files of an archive as the index reads them: which Parquet files are of a ParquetSink's
schema (the others are skipped, with the reason), the lines of JSONL files (one that is no record
with a string id, an integer step and a string split is left out and counted), and a folder of
runs told apart from an archive. Whatever a file holds is a reason to leave it out, never a crash."""

from __future__ import annotations

import contextlib
import glob
import os
from pathlib import Path
from typing import Any

import duckdb

__all__ = ["REQUIRED", "archive_runs", "counted", "load_jsonl", "parquet_columns"]

# The columns every file of a ParquetSink archive has (docs/sinks/parquet.md); a file without them is
# skipped.
REQUIRED = frozenset(
    ("id", "step", "split", "messages", "metadata", "reward", "advantage", "policy_version", "stop_reason")
)
# Read as JSON, so that a line whose id, step or split is of another type is told apart (and left
# out, counted) rather than cast: DuckDB would round a step of 1.5 to 2 and read "7" as 7.
_JSONL_COLUMNS = (
    "{id: 'JSON', step: 'JSON', split: 'JSON', key: 'VARCHAR', timestamp: 'DOUBLE', sample: 'JSON'}"
)
_JSONL_PROBLEM = """CASE
    WHEN id IS NULL AND step IS NULL AND split IS NULL AND sample IS NULL THEN 'not a record'
    WHEN json_type(id) IS DISTINCT FROM 'VARCHAR' THEN 'no string id'
    WHEN json_type(step) NOT IN ('BIGINT', 'UBIGINT') OR TRY_CAST(step AS BIGINT) IS NULL
        THEN 'no integer step'
    WHEN json_type(split) IS DISTINCT FROM 'VARCHAR' THEN 'no string split'
END"""
# The Parquet types a step column may have: integers a 64-bit one holds.
_STEP_TYPES = {
    ("INT32", None),
    ("INT64", None),
    ("INT32", "INT_8"),
    ("INT32", "INT_16"),
    ("INT32", "INT_32"),
    ("INT64", "INT_64"),
}


def archive_runs(directory: Path) -> list[str]:
    """The folders right under `directory` that hold archive files (a folder of runs, as the demo
    writes them), by name; hidden ones are a sink's own."""
    found = []
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_dir():
                continue
            where = glob.escape(entry.path)
            if glob.glob(where + "/*.parquet") or glob.glob(where + "/*.jsonl"):
                found.append(entry.path)
    return sorted(found)


def counted(problems: dict[str, int], noun: str) -> str:
    """What was left out of one file, by reason: "3 lines left out: 2 no integer step, 1 not a record"."""
    total = sum(problems.values())
    return f"{total} {noun}{'' if total == 1 else 's'} left out: " + ", ".join(
        f"{n} {why}" for why, n in sorted(problems.items(), key=lambda p: (-p[1], p[0]))
    )


def parquet_columns_of(con: duckdb.DuckDBPyConnection, files: list[str]) -> dict[str, frozenset[str] | str]:
    """`parquet_columns` of each file: every footer in one query (100 files: a tenth of the
    time of one query each), each file on its own where one cannot be read."""
    try:
        rows = con.execute(
            "SELECT file_name, name, type, converted_type FROM parquet_schema($f)", {"f": files}
        ).fetchall()
    except duckdb.Error:
        return {f: parquet_columns(con, f) for f in files}
    schemas: dict[str, list[tuple[Any, ...]]] = {f: [] for f in files}
    for name, *column in rows:
        schemas.setdefault(str(name), []).append(tuple(column))
    return {f: _of_schema(schemas[f]) for f in files}


def parquet_columns(con: duckdb.DuckDBPyConnection, file: str) -> frozenset[str] | str:
    """The columns of a Parquet file of the archive's schema; else why it is skipped."""
    try:
        schema = con.execute("SELECT name, type, converted_type FROM parquet_schema(?)", [file]).fetchall()
    except duckdb.Error as exc:
        return f"not a Parquet file DuckDB can read: {str(exc).splitlines()[0]}"
    return _of_schema(schema)


def _of_schema(schema: list[tuple[Any, ...]]) -> frozenset[str] | str:
    columns = frozenset(r[0] for r in schema)
    missing = sorted(REQUIRED - columns)
    if missing:
        return f"not a ParquetSink file: no column {', '.join(missing)}"
    step = next((r[1], r[2]) for r in schema if r[0] == "step")
    if step not in _STEP_TYPES:
        return f"not a ParquetSink file: its step column holds {step[1] or step[0]}, not integers"
    return columns


def load_jsonl(con: duckdb.DuckDBPyConnection, files: list[str]) -> dict[str, str]:
    """Load the records of JSONL `files` (listed with their `src` in table `new_files`) into table
    `records`, with the Parquet archive's columns; the lines left out of each file, and why."""
    # Every line once, with what keeps it out of the archive (NULL: nothing).
    con.execute(
        f"""CREATE OR REPLACE TEMP TABLE jsonl_lines AS SELECT *, {_JSONL_PROBLEM} AS problem
            FROM read_json($files, format = 'newline_delimited', columns = {_JSONL_COLUMNS},
                           filename = true, ignore_errors = true)
            JOIN new_files USING (filename)""",
        {"files": files},
    )
    problems: dict[str, dict[str, int]] = {}
    for filename, problem, n in con.execute(
        "SELECT filename, problem, count(*) FROM jsonl_lines WHERE problem IS NOT NULL GROUP BY ALL"
    ).fetchall():
        problems.setdefault(filename, {})[problem] = n
    number = "json_type(m->'{k}') IN ('DOUBLE', 'BIGINT', 'UBIGINT')"
    integer = "json_type(m->'{k}') IN ('BIGINT', 'UBIGINT')"
    select = f"""
        SELECT id->>'$' AS id, TRY_CAST(step AS BIGINT) AS step, split->>'$' AS split, key,
            to_timestamp(timestamp) AS timestamp,
            coalesce(CAST(sample->'messages' AS VARCHAR), '[]') AS messages,
            CAST(m AS VARCHAR) AS metadata,
            CASE WHEN {number.format(k="reward")} THEN (m->>'reward')::DOUBLE END AS reward,
            CASE WHEN {number.format(k="advantage")} THEN (m->>'advantage')::DOUBLE END AS advantage,
            CASE WHEN {integer.format(k="policy_version")} THEN (m->>'policy_version')::BIGINT
                 WHEN {integer.format(k="policy_version_max")} THEN (m->>'policy_version_max')::BIGINT
            END AS policy_version,
            CASE WHEN json_type(m->'stop_reason') = 'VARCHAR' THEN m->>'stop_reason' END AS stop_reason,
            TRY_CAST(sample->>'score' AS DOUBLE) AS score,
            CAST(sample->'spans' AS VARCHAR) AS spans,
            CAST(sample->'tokens' AS VARCHAR) AS tokens,
            src
        FROM (SELECT *, coalesce(sample->'metadata', '{{}}'::JSON) AS m FROM jsonl_lines)
        WHERE problem IS NULL
    """
    exists = con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'records'"
    ).fetchone()
    verb = "INSERT INTO records " if exists and exists[0] else "CREATE TABLE records AS "
    con.execute(verb + select)
    con.execute("DROP TABLE jsonl_lines")
    return {filename: counted(counts, "line") for filename, counts in problems.items()}
