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
from collections.abc import Iterator, Sequence
from pathlib import Path

import duckdb
from duckdb.func import SPECIAL

from .._records.groups import DEFAULT_GROUP_KEYS
from .._select.watch import DEFAULT_WATCH_KEYS
from ._files import archive_runs, counted, load_jsonl, parquet_columns
from ._text import words_sql

__all__ = ["LENGTH_KEYS", "TOKEN_COLUMNS", "Index"]

# Metadata keys of a completion's length in tokens, tried in order.
LENGTH_KEYS: tuple[str, ...] = ("response_len", "response_length")
# The token-level columns of an archive (a record's `tok` in the index says it has any).
TOKEN_COLUMNS: tuple[str, ...] = ("token_ids", "loss_mask", "logprobs", "advantages")
# Bumped whenever the index's columns or their meaning change: older cached indexes are not read.
_INDEX_VERSION = 2
# The same for the text index (`_text`: bumped when its words or its BLOCK change), kept in a
# folder of its own beside the index's files.
_TEXT_FOLDER = "text-1"


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


def _write_rows(con: duckdb.DuckDBPyConnection, query: str, path: Path) -> None:
    """Write the rows of `query` to `path`, whole or not at all; a cache that cannot be
    written is skipped (it only saves time)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    quoted = str(temporary).replace("'", "''")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        con.execute(f"COPY ({query}) TO '{quoted}' (FORMAT parquet, COMPRESSION zstd)")
        os.replace(temporary, path)
    except (OSError, duckdb.Error):
        with contextlib.suppress(OSError):
            os.unlink(temporary)


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
            runs = archive_runs(self.path) if not parquet and not jsonl else []
            if runs:
                shown = ", ".join(os.path.basename(r) for r in runs[:5]) + (" …" if len(runs) > 5 else "")
                raise ValueError(
                    f"{self.path} holds no archive files but {len(runs)} "
                    f"{'run' if len(runs) == 1 else 'runs'} ({shown}): view one of them, "
                    f"e.g. asynctrace view {runs[0]}"
                )
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
        # Files read but for some records (no integer step, no id...), with how many and why.
        self.left_out: dict[str, str] = {}
        # Set by `shut()`: background work stops, queries running are interrupted.
        self.closing = threading.Event()
        self._cursors: set[duckdb.DuckDBPyConnection] = set()
        self._cursors_lock = threading.Lock()
        self._scanned = 0.0
        self._udf = False
        self._loading = False
        self._defer = False
        self._columns: dict[str, frozenset[str]] = {}  # each readable Parquet file's columns
        # Parquet files indexed without their token-level values: (src, file's columns).
        self._untokened: list[tuple[int, frozenset[str]]] = []
        # Cleared while some are: the pages that show token-level values wait for it.
        self.tokens_ready = threading.Event()
        self.tokens_ready.set()
        # Cache files to write: (path, src) of files indexed but not yet kept.
        self._unkept: list[tuple[Path, int]] = []
        self._keep_lock = threading.Lock()
        self._con.execute(
            "CREATE TABLE idx (id VARCHAR, step BIGINT, split VARCHAR, grp VARCHAR, prompt VARCHAR, "
            "reward DOUBLE, advantage DOUBLE, policy_version BIGINT, stop_reason VARCHAR, rlen BIGINT, "
            "tok BOOLEAN, rn BIGINT, src INTEGER)"
        )
        # The text index (`_text`): the words of each block of a Parquet file's rows. A search
        # uses it for the files in `text_indexed` and reads every row of the others.
        self._con.execute("CREATE TABLE words (src INTEGER, blk INTEGER, w VARCHAR)")
        self.text_indexed: set[int] = set()
        self._text_lock = threading.Lock()  # guards the indexing thread's state
        self._text_running = threading.Lock()  # one text indexing at a time
        self._text_thread: threading.Thread | None = None
        self._text_again = False  # files came while a text indexing ran: it runs once more

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

    @contextlib.contextmanager
    def cursor(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A cursor of its own for work beside the pages' queries, which `shut()` interrupts."""
        cursor = self._con.cursor()
        with self._cursors_lock:
            self._cursors.add(cursor)
        try:
            yield cursor
        finally:
            with self._cursors_lock:
                self._cursors.discard(cursor)
            cursor.close()

    def _interrupt(self) -> None:
        with self._cursors_lock:
            running = list(self._cursors)
        for con in (*running, self._con):
            with contextlib.suppress(duckdb.Error):
                con.interrupt()

    def shut(self, threads: Sequence[threading.Thread], timeout: float) -> bool:
        """Stop for good, at exit: start no more background work, interrupt every query, and wait
        up to `timeout` seconds until no thread is inside DuckDB: `threads` (the caller's) and the
        text indexing ended, and no page's query running (the lock is then kept: none starts).
        True once so. A thread inside DuckDB when the interpreter exits aborts the process (its
        C++ code does not let Python's ending of the thread unwind through it).

        It interrupts again while it waits: a query may start between a check and an interrupt."""
        deadline = time.monotonic() + timeout
        self.closing.set()
        while time.monotonic() < deadline:
            self._interrupt()
            alive = [t for t in (*threads, self._text_thread) if t is not None and t.is_alive()]
            if alive:
                alive[0].join(0.05)
            elif self._lock.acquire(timeout=0.05):
                return True
        return False

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
        for f in files:
            columns = parquet_columns(self._con, f)
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
        self._con.execute("CREATE OR REPLACE TEMP TABLE new_files (filename VARCHAR, src INTEGER)")
        self._con.executemany(
            "INSERT INTO new_files VALUES (?, ?)", [(f, first + every.index(f)) for f in files]
        )
        tokens, count = _token_values(have)
        if self._defer:
            tokens, count = "NULL::BOOLEAN", "NULL::BIGINT"
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
        partial = self._leave_out_incomplete(first)
        if self._defer:
            self.tokens_ready.clear()
            self._untokened += [(first + every.index(f), self._columns[f]) for f in rest]
        for f in rest:
            path = kept[f]
            # A file with records left out is read again at each start, so each start says so.
            if path is not None and f not in partial:
                self._unkept.append((path, first + every.index(f)))
        if not self._loading:
            self.keep()

    def _leave_out_incomplete(self, first: int) -> set[str]:
        """Take out of the index the records just read without an id, a step or a split (a file
        another tool wrote: ParquetSink never writes them), each file's count kept in `left_out`;
        the files they came from."""
        incomplete = f"src >= {int(first)} AND (id IS NULL OR step IS NULL OR split IS NULL)"
        rows = self._con.execute(f"SELECT src, count(*) FROM idx WHERE {incomplete} GROUP BY src").fetchall()
        if not rows:
            return set()
        self._con.execute(f"DELETE FROM idx WHERE {incomplete}")
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
                "SELECT count(*) FROM idx WHERE rlen IS NULL AND src IN (SELECT unnest($s))", {"s": srcs}
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
                        f"UPDATE idx SET tok = coalesce(t.tok, false), rlen = coalesce(idx.rlen, t.n) "
                        f"FROM (SELECT file_row_number AS rn, {tokens} AS tok, {count} AS n "
                        f"FROM read_parquet($file, file_row_number = true)) t "
                        f"WHERE idx.src = {int(src)} AND idx.rn = t.rn",
                        {"file": self.files[src]},
                    )
        with self._lock:
            if not self._untokened:
                self.tokens_ready.set()

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
        with self.cursor() as cursor:
            for path, src in pending:
                if self.closing.is_set():
                    return
                self._keep(cursor, path, src)

    def _keep(self, con: duckdb.DuckDBPyConnection, path: Path, src: int) -> None:
        """Write one file's index rows."""
        _write_rows(con, f"SELECT * EXCLUDE (src) FROM idx WHERE src = {int(src)}", path)

    def index_text_soon(self) -> None:
        """Index the words of the files that have no text index yet, on a thread of its own."""
        with self._text_lock:
            if self._text_thread is not None and self._text_thread.is_alive():
                self._text_again = True
                return
            self._text_again = False
            self._text_thread = threading.Thread(
                target=self._index_text_until_done, name="asynctrace-view-text", daemon=True
            )
            self._text_thread.start()

    def _index_text_until_done(self) -> None:
        while not self.closing.is_set():
            self.index_text()
            with self._text_lock:
                if not self._text_again:
                    self._text_thread = None
                    return
                self._text_again = False

    def index_text(self) -> None:
        """Index the words of every Parquet file that has none yet: read from the cache when kept
        there, else from the file (and kept). It runs through a cursor of its own, so pages are
        answered meanwhile; a file's words are used once all of them are in."""
        if self.kind != "parquet":
            return
        with self._text_running:
            with self._lock:
                todo = [
                    (src, f)
                    for src, f in enumerate(self.files)
                    if src not in self.text_indexed and f not in self.skipped
                ]
            if not todo:
                return
            with self.cursor() as cursor:
                for src, file in todo:
                    if self.closing.is_set():
                        return
                    try:
                        self._index_words(cursor, src, file)
                    except duckdb.Error:
                        continue  # a file that went away: searched whole, which says it is gone
                    with self._lock:
                        self.text_indexed.add(src)

    def _index_words(self, con: duckdb.DuckDBPyConnection, src: int, file: str) -> None:
        """Put one file's words in table `words`, from the cache or from the file."""
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
            _write_rows(con, f"SELECT blk, w FROM words WHERE src = {int(src)}", path)

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
            "INSERT INTO idx "
            + self._index_select(
                f"(SELECT * FROM records WHERE src >= {int(first)})",
                "tokens IS NOT NULL",
                "mask_count(tokens->'loss_mask'->>'b64')",
                "NULL",
            )
        )
