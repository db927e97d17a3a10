"""The viewer's index of an archive: a few typed values of every record, in DuckDB, in memory.

The index holds a few typed values of every record (step, split, group, prompt id, reward,
advantage, policy version, stop reason, response length) so that the overview and the rankings
never parse the metadata JSON again. Parquet files are complete once they have their name (a
sink writes them under a hidden one and renames them), so a file indexed once never changes:
new files of a running trainer are indexed as they appear, and each file's index can be kept
on disk for the next start.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import glob
import hashlib
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import duckdb
from duckdb.func import SPECIAL

from .._records.groups import DEFAULT_GROUP_KEYS
from .._select.watch import DEFAULT_WATCH_KEYS

__all__ = ["LENGTH_KEYS", "TOKEN_COLUMNS", "Index"]

# Metadata keys of a completion's length in tokens, tried in order.
LENGTH_KEYS: tuple[str, ...] = ("response_len", "response_length")
# The token-level columns of an archive (a record's `tok` in the index says it has any).
TOKEN_COLUMNS: tuple[str, ...] = ("token_ids", "loss_mask", "logprobs", "advantages")
# Bumped whenever the index's columns or their meaning change: older cached indexes are not read.
_INDEX_VERSION = 2
# The columns every file of a ParquetSink archive has (docs/sinks.md); a file without them is skipped.
_REQUIRED = frozenset(
    ("id", "step", "split", "messages", "metadata", "reward", "advantage", "policy_version", "stop_reason")
)
_JSONL_COLUMNS = (
    "{id: 'VARCHAR', step: 'BIGINT', split: 'VARCHAR', key: 'VARCHAR', timestamp: 'DOUBLE', sample: 'JSON'}"
)


def _path(key: str) -> str:
    return '$."' + key.replace('"', "") + '"'


# Each metadata key is parsed once per record, whichever roles (group, prompt id, length) share it.
_KEYS = list(dict.fromkeys((*DEFAULT_GROUP_KEYS, *DEFAULT_WATCH_KEYS, *LENGTH_KEYS)))
_PATHS = [_path(k) for k in _KEYS]


def _coalesce(keys: Sequence[str]) -> str:
    return "coalesce(" + ", ".join(f"j[{_KEYS.index(k) + 1}]" for k in keys) + ")"


def _mask_count(b64: str | None) -> int | None:
    """The tokens a JSONL record's encoded loss mask (int8 values) keeps in the loss."""
    if b64 is None:
        return None
    try:
        raw = base64.b64decode(b64, validate=True)
    except binascii.Error:
        return None
    return len(raw) - raw.count(0)


class Index:
    """A Parquet archive directory (of `ParquetSink` files), a JSONL file, or a directory of
    JSONL files, indexed: table `idx` (and for JSONL, table `records`, the records whole)."""

    def __init__(
        self, source: str | os.PathLike[str], *, cache: str | os.PathLike[str] | None = None
    ) -> None:
        self.path = Path(source)
        # Where each Parquet file's index is kept for the next start (None: nowhere).
        self.cache = Path(cache) if cache is not None else None
        if not self.path.exists():
            raise FileNotFoundError(f"no archive at {self.path}")
        if self.path.is_dir():
            parquet = bool(glob.glob(glob.escape(str(self.path)) + "/*.parquet"))
            jsonl = bool(glob.glob(glob.escape(str(self.path)) + "/*.jsonl"))
            self.kind = "jsonl" if jsonl and not parquet else "parquet"
        elif self.path.suffix == ".jsonl":
            self.kind = "jsonl"
        else:
            raise ValueError(f"{self.path}: expected a directory of .parquet files or a .jsonl file")
        self._con = duckdb.connect(":memory:")
        self._con.execute(f"SET threads = {max(1, min(8, os.cpu_count() or 1))}")
        # A sink's file never changes once named: its footer is read once, not at every page.
        self._con.execute("SET parquet_metadata_cache = true")
        self._lock = threading.Lock()
        self.files: list[str] = []
        # Files of the directory that are not of the archive's schema, with the reason.
        self.skipped: dict[str, str] = {}
        self._scanned = 0.0
        self._udf = False
        self._loading = False
        # Cache files to write: (path, src) of files indexed but not yet kept.
        self._unkept: list[tuple[Path, int]] = []
        self._keep_lock = threading.Lock()
        self._con.execute(
            "CREATE TABLE idx (id VARCHAR, step BIGINT, split VARCHAR, grp VARCHAR, prompt VARCHAR, "
            "reward DOUBLE, advantage DOUBLE, policy_version BIGINT, stop_reason VARCHAR, rlen BIGINT, "
            "tok BOOLEAN, rn BIGINT, src INTEGER)"
        )

    def build(self) -> None:
        """Index every file there is now; the indexes to keep wait for `keep()`."""
        with self._lock:
            self._loading = True
            try:
                self._scan()
            finally:
                self._loading = False

    def _indexed(self) -> None:
        """Called, under the lock, once new files are in the index: answers derived from it are stale."""

    def _listing(self) -> list[str]:
        if self.path.is_file():
            return [str(self.path)]
        pattern = "*.jsonl" if self.kind == "jsonl" else "*.parquet"
        # Hidden names are a sink's temporaries and journals: never read.
        return sorted(glob.glob(os.path.join(glob.escape(str(self.path)), pattern)))

    def _scan(self, every: float = 0.0) -> None:
        """Index the files that appeared since the last scan, listing them at most once per `every`
        seconds (the caller holds the lock)."""
        now = time.monotonic()
        if self.files and now - self._scanned < every:
            return
        self._scanned = now
        new = [f for f in self._listing() if f not in set(self.files)]
        if not new:
            return
        first = len(self.files)
        self.files.extend(new)
        if self.kind == "parquet":
            self._index_parquet(new, first)
        else:
            self._index_jsonl(new, first)
        self._indexed()

    def _index_select(self, relation: str, tokens: str, token_count: str, row: str) -> str:
        """The index's columns from `relation` (a table with the Parquet archive's columns)."""
        length = f"TRY_CAST({_coalesce(LENGTH_KEYS)} AS BIGINT)"
        return (
            f"SELECT id, step, split, {_coalesce(DEFAULT_GROUP_KEYS)}, {_coalesce(DEFAULT_WATCH_KEYS)}, "
            "reward, advantage, "
            f"policy_version, stop_reason, coalesce({length}, "
            f"{token_count}), {tokens}, {row}, src FROM (SELECT *, json_extract_string(metadata, "
            f"{_PATHS!r}) AS j FROM {relation})"
        )

    def _readable(self, files: list[str]) -> tuple[list[str], set[str]]:
        """The files of the archive's schema, and their columns; any other is skipped with its reason."""
        usable: list[str] = []
        have: set[str] = set()
        for f in files:
            try:
                columns = {
                    r[0] for r in self._con.execute("SELECT name FROM parquet_schema(?)", [f]).fetchall()
                }
            except duckdb.Error as exc:
                self.skipped[f] = f"not a Parquet file DuckDB can read: {str(exc).splitlines()[0]}"
                continue
            missing = sorted(_REQUIRED - columns)
            if missing:
                self.skipped[f] = f"not a ParquetSink file: no column {', '.join(missing)}"
                continue
            usable.append(f)
            have |= columns
        return usable, have

    def _index_parquet(self, every: list[str], first: int) -> None:
        files, have = self._readable(every)
        if not files:
            return
        self._con.execute("CREATE OR REPLACE TEMP TABLE new_files (filename VARCHAR, src INTEGER)")
        self._con.executemany(
            "INSERT INTO new_files VALUES (?, ?)", [(f, first + every.index(f)) for f in files]
        )
        present = [c for c in TOKEN_COLUMNS if c in have]
        tokens = " OR ".join(f"{c} IS NOT NULL" for c in present) or "false"
        count = (
            "list_sum(loss_mask)"
            if "loss_mask" in have
            else ("len(token_ids)" if "token_ids" in have else "NULL")
        )
        relation = (
            "(SELECT * FROM read_parquet($files, filename = true, file_row_number = true, "
            "union_by_name = true) JOIN new_files USING (filename))"
        )
        kept = {f: self._cached(f) for f in files}
        hits = {f: path for f, path in kept.items() if path is not None and path.is_file()}
        if hits:
            self._con.execute("CREATE OR REPLACE TEMP TABLE hit_files (filename VARCHAR, src INTEGER)")
            self._con.executemany(
                "INSERT INTO hit_files VALUES (?, ?)",
                [(str(path), first + every.index(f)) for f, path in hits.items()],
            )
            self._con.execute(
                "INSERT INTO idx SELECT * EXCLUDE (filename) FROM read_parquet($paths, filename = true) "
                "JOIN hit_files USING (filename)",
                {"paths": [str(p) for p in hits.values()]},
            )
        rest = [f for f in files if f not in hits]
        if not rest:
            return
        self._con.execute(
            "DELETE FROM new_files WHERE filename IN (SELECT unnest($hits))", {"hits": list(hits)}
        )
        self._con.execute(
            "INSERT INTO idx " + self._index_select(relation, tokens, count, "file_row_number"),
            {"files": rest},
        )
        for f in rest:
            path = kept[f]
            if path is not None:
                self._unkept.append((path, first + every.index(f)))
        if not self._loading:
            self.keep()

    def _cached(self, file: str) -> Path | None:
        """Where the index of `file` is kept: named after the file's path, size and time, so a
        file that changed (it never does once a sink named it) is indexed again."""
        if self.cache is None:
            return None
        try:
            stat = os.stat(file)
        except OSError:
            return None
        key = f"{_INDEX_VERSION}\0{os.path.abspath(file)}\0{stat.st_size}\0{stat.st_mtime_ns}"
        return self.cache / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".parquet")

    def keep(self) -> None:
        """Write the index of each file indexed since the last call into the cache, for the next start.

        It reads the index through a cursor of its own, so that pages can be answered meanwhile."""
        with self._keep_lock:
            pending, self._unkept = self._unkept, []
        if not pending:
            return
        cursor = self._con.cursor()
        try:
            for path, src in pending:
                self._keep(cursor, path, src)
        finally:
            cursor.close()

    def _keep(self, con: duckdb.DuckDBPyConnection, path: Path, src: int) -> None:
        """Write one file's index rows; a cache that cannot be written is skipped (it only saves time)."""
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        quoted = str(temporary).replace("'", "''")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            con.execute(
                f"COPY (SELECT * EXCLUDE (src) FROM idx WHERE src = {int(src)}) TO '{quoted}' "
                "(FORMAT parquet, COMPRESSION zstd)"
            )
            os.replace(temporary, path)
        except (OSError, duckdb.Error):
            with contextlib.suppress(OSError):
                os.unlink(temporary)

    def _index_jsonl(self, files: list[str], first: int) -> None:
        """JSONL files are loaded whole into a table with the Parquet archive's columns."""
        self._con.execute("CREATE OR REPLACE TEMP TABLE new_files (filename VARCHAR, src INTEGER)")
        self._con.executemany(
            "INSERT INTO new_files VALUES (?, ?)", [(f, first + i) for i, f in enumerate(files)]
        )
        number = "json_type(m->'{k}') IN ('DOUBLE', 'BIGINT', 'UBIGINT')"
        integer = "json_type(m->'{k}') IN ('BIGINT', 'UBIGINT')"
        select = f"""
            SELECT id, step, split, key, to_timestamp(timestamp) AS timestamp,
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
            FROM (SELECT *, coalesce(sample->'metadata', '{{}}'::JSON) AS m
                  FROM read_json($files, format = 'newline_delimited', columns = {_JSONL_COLUMNS},
                                 filename = true, ignore_errors = true)
                  JOIN new_files USING (filename))
            WHERE id IS NOT NULL
        """
        exists = self._con.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_name = 'records'"
        ).fetchone()
        verb = "INSERT INTO records " if exists and exists[0] else "CREATE TABLE records AS "
        self._con.execute(verb + select, {"files": files})
        if not self._udf:
            self._con.create_function("mask_count", _mask_count, ["VARCHAR"], "BIGINT", null_handling=SPECIAL)
            self._udf = True
        self._con.execute(
            "INSERT INTO idx "
            + self._index_select(
                f"(SELECT * FROM records WHERE src >= {int(first)})",
                "tokens IS NOT NULL",
                "mask_count(tokens->'loss_mask'->>'b64')",
                "NULL",
            )
        )
