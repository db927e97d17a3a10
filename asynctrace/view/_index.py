"""The viewer's index of an archive: a few typed values of every record, in DuckDB (a database
file of the process's own, compressed, read through DuckDB's buffer: see `_store`).

The index holds a few typed values of every record (step, split, group, prompt id, reward,
advantage, policy version, stop reason, response length) so that the overview and the rankings
never parse the metadata JSON again. Parquet files are complete once they have their name (a
sink writes them under a hidden one and renames them), so a file indexed once never changes:
new files of a running trainer are indexed as they appear, and each file's index can be kept
on disk for the next start. A file with valid sidecars (`_sidecar`) is not read at all: its
sidecars are queried where they lie (`_held`).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import duckdb
from duckdb.func import SPECIAL

from .._records.groups import DEFAULT_GROUP_KEYS
from .._select.watch import DEFAULT_WATCH_KEYS
from ._files import counted, load_jsonl, parquet_columns_of
from ._held import HeldIndex
from ._sidecar import index_sidecars, words_sidecar
from ._store import write_rows
from ._text import words_sql

__all__ = ["LENGTH_KEYS", "TOKEN_COLUMNS", "Index"]

# Bumped (with `_text`'s words or its BLOCK) so that older kept text indexes are not read: they
# are kept in a folder of this name beside the index's files.
_TEXT_FOLDER = "text-1"
# Metadata keys of a completion's length in tokens, tried in order.
LENGTH_KEYS: tuple[str, ...] = ("response_len", "response_length")
# The token-level columns of an archive (a record's `tok` in the index says it has any).
TOKEN_COLUMNS: tuple[str, ...] = ("token_ids", "loss_mask", "logprobs", "advantages")


def _path(key: str) -> str:
    return '$."' + key.replace('"', "") + '"'


# Each metadata key is parsed once per record, whichever roles (group, prompt id, length) share it.
_KEYS = list(dict.fromkeys((*DEFAULT_GROUP_KEYS, *DEFAULT_WATCH_KEYS, *LENGTH_KEYS)))
_PATHS = [_path(k) for k in _KEYS]


def _coalesce(keys: Sequence[str]) -> str:
    return "coalesce(" + ", ".join(f"j[{_KEYS.index(k) + 1}]" for k in keys) + ")"


def _token_values(columns: set[str] | frozenset[str]) -> tuple[str, str]:
    """SQL of whether a record has token-level fields, and of its tokens in the loss (else its
    tokens), over a Parquet file with these columns."""
    present = [c for c in TOKEN_COLUMNS if c in columns]
    tokens = " OR ".join(f"{c} IS NOT NULL" for c in present) or "false"
    count = "NULL"
    if "loss_mask" in columns:
        count = "list_sum(loss_mask)"
    elif "token_ids" in columns:
        count = "len(token_ids)"
    return tokens, count


def _mask_count(b64: str | None) -> int | None:
    """The tokens a JSONL record's encoded loss mask (int8 values) keeps in the loss."""
    if b64 is None:
        return None
    try:
        raw = base64.b64decode(b64, validate=True)
    except binascii.Error:
        return None
    return len(raw) - raw.count(0)


class Index(HeldIndex):
    """A Parquet archive directory (of `ParquetSink` files), a JSONL file, or a directory of
    JSONL files, indexed: table `idx` (and for JSONL, table `records`, the records whole), and
    the text index of `TextIndex`."""

    def __init__(
        self, source: str | os.PathLike[str], *, cache: str | os.PathLike[str] | None = None
    ) -> None:
        super().__init__(source, cache=cache)
        # Files read but for some records (no integer step, no id...), with how many and why.
        self.left_out: dict[str, str] = {}
        self._scanned = 0.0
        self._udf = False
        self._loading = False
        self._defer = False
        self._columns: dict[str, frozenset[str]] = {}  # each readable Parquet file's columns
        # Parquet files indexed without their token-level values: (src, file's columns).
        self._untokened: list[tuple[int, frozenset[str]]] = []
        # Whether table `ids` (see `index_ids`) holds every Parquet record of the index.
        self._ids_ready = False
        # Cleared while some are: the pages that show token-level values wait for it.
        self.tokens_ready = threading.Event()
        self.tokens_ready.set()
        # Cache files to write: (path, src) of files indexed but not yet kept.
        self._unkept: list[tuple[Path, int]] = []
        self._keep_lock = threading.Lock()

    def build(self, *, defer_tokens: bool = False) -> None:
        """Index every file there is now; the indexes to keep wait for `keep()`. With
        `defer_tokens`, what needs the token-level columns (whether a record has any, and the
        length of one whose metadata has none: most of the reading) waits for `complete_tokens()`."""
        with self._lock:
            self._loading = True
            self._defer = defer_tokens
            try:
                self._scan()
            finally:
                self._loading = self._defer = False

    def _indexed(self) -> None:
        """Called, under the lock, once new files are in the index: answers derived from it are stale."""

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
        if self._ids_ready:
            self._add_ids(self._con, first)
        if self.kind == "parquet" and not self._loading:
            self.index_text_soon()  # a file a running trainer added: searched whole until then

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
        for f, columns in parquet_columns_of(self._con, files).items():
            if isinstance(columns, str):
                self.skipped[f] = columns
                continue
            usable.append(f)
            have |= columns
            self._columns[f] = columns
        return usable, have

    def _index_parquet(self, every: list[str], first: int) -> None:
        files, have = self._readable(every)
        if not files:
            return
        # The sink's sidecars (`_sidecar`): queried where they lie, not copied. Those the first
        # open's summary checked already are not checked again.
        checked, self.checked_sidecars = self.checked_sidecars, {}
        sidecars = {f: checked[f] for f in files if f in checked}
        sidecars.update(index_sidecars(self._con, [f for f in files if f not in checked]))
        if sidecars:
            held = {first + every.index(f): found for f, found in sidecars.items()}
            self.add_sidecars(held)
            if self._defer:
                # Read whole only when a query fails (`repair`): reading them is seconds of both
                # cores at 10M records, which the pages would wait for.
                self._unverified += list(held)
            else:
                self.prompt_view()  # checked now: what is verified is what the pages read
                self._verify(self._con, list(held))
        rest = [f for f in files if f not in sidecars]
        if rest:
            self._read_files([(f, first + every.index(f)) for f in rest], have)

    def _read_files(self, files: list[tuple[str, int]], have: set[str]) -> None:
        """Copy the index rows of these (file, src) into table `idx_rows`: from the cache where
        kept, else from the files themselves (the caller holds the lock)."""
        kept = {f: self._cached(f) for f, _ in files}
        src_of = dict(files)
        hits = {f: path for f, path in kept.items() if path is not None and path.is_file()}
        if hits:
            self._con.execute("CREATE OR REPLACE TEMP TABLE hit_files (filename VARCHAR, src INTEGER)")
            self._con.executemany(
                "INSERT INTO hit_files VALUES (?, ?)", [(str(path), src_of[f]) for f, path in hits.items()]
            )
            self._con.execute(
                "INSERT INTO idx_rows SELECT * EXCLUDE (filename) FROM read_parquet($paths, filename = true) "
                "JOIN hit_files USING (filename)",
                {"paths": [str(p) for p in hits.values()]},
            )
        first = min(src_of.values())
        rest = [f for f, _ in files if f not in hits]
        if not rest:
            self._leave_out_incomplete(first)
            return
        self._con.execute("CREATE OR REPLACE TEMP TABLE new_files (filename VARCHAR, src INTEGER)")
        self._con.executemany("INSERT INTO new_files VALUES (?, ?)", [(f, src_of[f]) for f in rest])
        tokens, count = _token_values(have)
        if self._defer:
            tokens, count = "NULL::BOOLEAN", "NULL::BIGINT"
        relation = (
            "(SELECT * FROM read_parquet($files, filename = true, file_row_number = true, "
            "union_by_name = true) JOIN new_files USING (filename))"
        )
        self._con.execute(
            "INSERT INTO idx_rows " + self._index_select(relation, tokens, count, "file_row_number"),
            {"files": rest},
        )
        partial = self._leave_out_incomplete(first)
        if self._defer:
            self.tokens_ready.clear()
            self._untokened += [(src_of[f], self._columns[f]) for f in rest]
        for f in rest:
            path = kept[f]
            # A file with records left out is read again at each start, so each start says so.
            if path is not None and f not in partial:
                self._unkept.append((path, src_of[f]))
        if not self._loading:
            self.keep()

    def _read_instead(self, srcs: list[int]) -> None:
        """Stop querying these files' sidecars; read the files themselves (the caller holds the lock)."""
        for src in srcs:
            found = self.sidecars.pop(src)
            self._con.execute(
                "DELETE FROM sidecar_src WHERE filename IN (?, ?)", [found.by_row, found.by_prompt]
            )
        if self._prompt_srcs.intersection(srcs):  # its rows of these files would be read twice
            self.take_prompt_index()
        self._views()
        files = [(self.files[src], src) for src in sorted(srcs)]
        have: set[str] = set().union(*(self._columns[f] for f, _ in files))
        self._read_files(files, have)
        self._indexed()

    def _leave_out_incomplete(self, first: int) -> set[str]:
        """Take out of the index the records just read without an id, a step or a split (a file
        another tool wrote: ParquetSink never writes them), each file's count kept in `left_out`;
        the files they came from."""
        incomplete = f"src >= {int(first)} AND (id IS NULL OR step IS NULL OR split IS NULL)"
        rows = self._con.execute(
            f"SELECT src, count(*) FROM idx_rows WHERE {incomplete} GROUP BY src"
        ).fetchall()
        if not rows:
            return set()
        self._con.execute(f"DELETE FROM idx_rows WHERE {incomplete}")
        for src, n in rows:
            self.left_out[self.files[src]] = counted({"without an id, a step or a split": n}, "record")
        return {self.files[src] for src, _ in rows}

    def lengths_need_tokens(self) -> bool:
        """Whether a record indexed without its token-level values has no length in its metadata
        and may have one in its tokens (the overview's lengths then wait for them)."""
        with self._lock:
            srcs = [src for src, columns in self._untokened if columns & {"loss_mask", "token_ids"}]
            if not srcs:
                return False
            row = self._con.execute(
                "SELECT count(*) FROM idx_rows WHERE rlen IS NULL AND src IN (SELECT unnest($s))", {"s": srcs}
            ).fetchone()
        return bool(row and row[0])

    def complete_tokens(self) -> None:
        """Fill in the token-level values the first open left for later (see `build`), through a
        cursor of its own so that the overview is answered meanwhile."""
        with self._lock:
            pending, self._untokened = self._untokened, []
        with self.cursor() as cursor:
            for src, columns in pending:
                if self.closing.is_set():
                    return
                tokens, count = _token_values(columns)
                # A file that went away since is left without them: its pages say it is gone.
                with contextlib.suppress(duckdb.Error):
                    cursor.execute(
                        "UPDATE idx_rows SET tok = coalesce(t.tok, false), "
                        "rlen = coalesce(idx_rows.rlen, t.n) "
                        f"FROM (SELECT file_row_number AS rn, {tokens} AS tok, {count} AS n "
                        f"FROM read_parquet($file, file_row_number = true)) t "
                        f"WHERE idx_rows.src = {int(src)} AND idx_rows.rn = t.rn",
                        {"file": self.files[src]},
                    )
        with self._lock:
            if not self._untokened:
                self.tokens_ready.set()

    def index_ids(self) -> None:
        """Make table `ids`: each Parquet record of table `idx_rows` (not of a sidecar) with its
        id hashed, with its place (src, rn), in hash order. DuckDB keeps a string's statistics by
        its first 8 bytes, which the ids of a run share, so `WHERE id = ...` decompresses the
        whole id column (1.3 s at 10M records); in hash order an integer's statistics skip to the
        rows (`located`). Built through a cursor of its own after the overview, so pages are
        answered meanwhile (by the id column until then). A sidecar's id column is read where
        it lies (50 ms at 10M records): copying it would cost more than it saves."""
        if self.kind != "parquet":
            return
        with self._lock:
            upto = len(self.files)
        with self.cursor() as cursor:
            cursor.execute(
                f"CREATE OR REPLACE TABLE ids AS SELECT hash(id) AS h, src, rn FROM idx_rows "
                f"WHERE src < {int(upto)} ORDER BY h"
            )
        with self._lock:
            self._add_ids(self._con, upto)  # files indexed meanwhile
            self._ids_ready = True

    def _add_ids(self, con: duckdb.DuckDBPyConnection, first: int) -> None:
        con.execute(
            f"INSERT INTO ids SELECT hash(id), src, rn FROM idx_rows WHERE src >= {int(first)} ORDER BY 1"
        )

    def located(self, con: duckdb.DuckDBPyConnection, ids: Sequence[str]) -> str:
        """SQL that the index rows of these record ids meet, with at most a few others: a filter
        on their places, which DuckDB's statistics skip to; "true" until table `ids` is made (the
        caller holds the lock, and matches the ids themselves too)."""
        if not self._ids_ready or not ids:
            return "true"
        places = con.execute(
            "SELECT DISTINCT src, rn FROM ids WHERE h IN (SELECT hash(unnest($ids)))", {"ids": list(ids)}
        ).fetchall()
        held = ", ".join(str(int(s)) for s in sorted(self.sidecars))
        # The rows of a sidecar are not in table `ids`: matched by their id where they lie.
        in_sidecars = f"src IN ({held})" if held else "false"
        if not places:
            return in_sidecars if held else "false"
        srcs = ", ".join(str(int(s)) for s in sorted({p[0] for p in places}))
        rows = ", ".join(str(int(r)) for r in sorted({p[1] for p in places}))
        return f"((src IN ({srcs}) AND rn IN ({rows})) OR {in_sidecars})"

    def keep(self) -> None:
        """Write the index of each file indexed since the last call into the cache, for the next start.

        It reads the index through a cursor of its own, so that pages can be answered meanwhile."""
        with self._keep_lock:
            pending, self._unkept = self._unkept, []
        if not pending:
            return
        with self.cursor() as cursor:
            for path, src in pending:
                if self.closing.is_set():
                    return
                self._keep(cursor, path, src)

    def _keep(self, con: duckdb.DuckDBPyConnection, path: Path, src: int) -> None:
        """Write one file's index rows."""
        write_rows(con, f"SELECT * EXCLUDE (src) FROM idx_rows WHERE src = {int(src)}", path)

    def _words_kept(self, con: duckdb.DuckDBPyConnection, file: str) -> bool:
        kept = self._cached(file)
        if kept is not None and (kept.parent / _TEXT_FOLDER / kept.name).is_file():
            return True
        return words_sidecar(con, file) is not None

    def _index_words(self, con: duckdb.DuckDBPyConnection, src: int, file: str) -> None:
        """Put one file's words in table `words`, from the cache or from the file."""
        sidecar = words_sidecar(con, file)
        if sidecar is not None:
            try:
                con.execute(f"INSERT INTO words SELECT {int(src)}, blk, w FROM read_parquet(?)", [sidecar])
                return
            except duckdb.Error:
                con.execute(f"DELETE FROM words WHERE src = {int(src)}")  # damaged past its footer
        kept = self._cached(file)
        path = None if kept is None else kept.parent / _TEXT_FOLDER / kept.name
        if path is not None and path.is_file():
            try:
                con.execute(f"INSERT INTO words SELECT {int(src)}, blk, w FROM read_parquet(?)", [str(path)])
                return
            except duckdb.Error:
                con.execute(f"DELETE FROM words WHERE src = {int(src)}")  # a torn cache file: index anew
        relation = "read_parquet($file, file_row_number = true)"
        con.execute(
            f"INSERT INTO words SELECT {int(src)}, blk, w FROM ({words_sql(relation)})", {"file": file}
        )
        if path is not None:
            write_rows(con, f"SELECT blk, w FROM words WHERE src = {int(src)}", path)

    def _index_jsonl(self, files: list[str], first: int) -> None:
        """JSONL files are loaded whole into a table with the Parquet archive's columns."""
        self._con.execute("CREATE OR REPLACE TEMP TABLE new_files (filename VARCHAR, src INTEGER)")
        self._con.executemany(
            "INSERT INTO new_files VALUES (?, ?)", [(f, first + i) for i, f in enumerate(files)]
        )
        self.left_out.update(load_jsonl(self._con, files))
        if not self._udf:
            self._con.create_function("mask_count", _mask_count, ["VARCHAR"], "BIGINT", null_handling=SPECIAL)
            self._udf = True
        self._con.execute(
            "INSERT INTO idx_rows "
            + self._index_select(
                f"(SELECT * FROM records WHERE src >= {int(first)})",
                "tokens IS NOT NULL",
                "mask_count(tokens->'loss_mask'->>'b64')",
                "NULL",
            )
        )
