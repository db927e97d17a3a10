"""Where the viewer's index lives: the archive's files, one DuckDB connection (its database a
temporary file), its locks and cursors, where each file's index is kept between starts, and how it all stops.

`_words` (the text index) and `_index` (the typed values of every record) build on it.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import duckdb

from ._files import archive_runs

__all__ = ["Store", "sweep", "write_rows"]

# The folder of a process's index database: this, its process id, a dash, a random name.
_PREFIX = "asynctrace-view-"
# Bumped whenever the index's columns or their meaning change: older cached indexes are not read.
_INDEX_VERSION = 2


class Store:
    """An archive's files (a Parquet directory, a JSONL file or a JSONL directory) and the
    connection their index is queried through."""

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
        # The index lives in a database file of its own, not in memory: DuckDB compresses a file's
        # tables (an index of 1M records: 16 MB, against 117 MB as an in-memory table, which it
        # never compresses nor evicts) and keeps in memory only the blocks queries use, so the
        # server's memory does not grow with the archive. The file is this process's alone.
        sweep(tempfile.gettempdir())
        self._scratch = tempfile.TemporaryDirectory(prefix=f"{_PREFIX}{os.getpid()}-")
        self._con = duckdb.connect(os.path.join(self._scratch.name, "index.duckdb"))
        # Nothing in it outlives the process: no checkpoint at its end, where a failing one would
        # abort the interpreter; the connection is closed before the folder goes.
        self._con.execute("PRAGMA disable_checkpoint_on_shutdown")
        weakref.finalize(self, _drop, self._con, self._scratch)
        self._con.execute(f"SET threads = {max(1, min(8, os.cpu_count() or 1))}")
        # A sink's file never changes once named: its footer is read once, not at every page.
        self._con.execute("SET parquet_metadata_cache = true")
        self._lock = threading.Lock()
        self.files: list[str] = []
        # Files of the directory that are not of the archive's schema, with the reason.
        self.skipped: dict[str, str] = {}
        # Set by `shut()`: background work stops, queries running are interrupted.
        self.closing = threading.Event()
        self._cursors: set[duckdb.DuckDBPyConnection] = set()
        self._cursors_lock = threading.Lock()

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

    def _background(self) -> list[threading.Thread]:
        """The threads of this index's own background work (none here; `_words` has one)."""
        return []

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
            alive = [t for t in (*threads, *self._background()) if t.is_alive()]
            if alive:
                alive[0].join(0.05)
            elif self._lock.acquire(timeout=0.05):
                return True
        return False

    def _listing(self) -> list[str]:
        if self.path.is_file():
            return [str(self.path)]
        pattern = "*.jsonl" if self.kind == "jsonl" else "*.parquet"
        # Hidden names are a sink's temporaries and journals: never read.
        return sorted(glob.glob(os.path.join(glob.escape(str(self.path)), pattern)))

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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def sweep(root: str) -> None:
    """Remove the index folders in `root` of viewer processes that are gone: one killed (SIGTERM,
    SIGKILL) never removes its own. A folder whose process id is alive, whoever it now is, stays."""
    if os.name != "posix":
        return  # os.kill(pid, 0) sends Ctrl-C on Windows
    for path in glob.glob(os.path.join(glob.escape(root), _PREFIX + "*")):
        pid = os.path.basename(path)[len(_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _drop(con: duckdb.DuckDBPyConnection, scratch: tempfile.TemporaryDirectory[str]) -> None:
    with contextlib.suppress(duckdb.Error):
        con.close()
    scratch.cleanup()


def write_rows(con: duckdb.DuckDBPyConnection, query: str, path: Path) -> None:
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
