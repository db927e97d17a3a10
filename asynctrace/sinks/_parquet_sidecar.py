"""ParquetSink's sidecars: for each named file, what `asynctrace view` would otherwise compute from
it at its first open, written once by the sink so that the viewer reads it instead.

Small Parquet files in the hidden folder `SIDECAR_FOLDER` beside the archive's files, named
after the file (``<name>.<kind>.parquet``, `KINDS`): ``index``, the typed values of each record
(what the viewer's index holds, by row number, in row groups of `INDEX_ROWS` rows so that a
query for a step reads only its own); ``byprompt``, the same rows ordered by prompt id (a prompt's
history reads a row group a file, where the row order would read every row); and ``words``, the
words of each block of rows (the viewer's text index). Each carries, in its footer's key-value
metadata under `SIDECAR_KEY`, the version, its file's size and row count and the rows a block of
words spans, so that a reader can tell a sidecar of another file (or of another version) apart.
The index sidecar's footer also carries the file's summary under `SUMMARY_KEY` (each step's
overview figures and each prompt id's counts, `_parquet_summary`): a first open reads one footer
a file for the overview. The viewer queries the sidecars where they lie.

A sidecar is data only, and optional: the viewer checks it (`asynctrace.view._sidecar`) and falls
back to reading the file where it is missing, damaged or of another file. Writing one never fails
the sink: what cannot be written (or represented exactly: a group or prompt id that is neither a
string nor an integer, a length that is not an integer) is left out.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson

from .._records.groups import DEFAULT_GROUP_KEYS
from .._records.tokens import TOKEN_FIELDS
from .._security import logger
from .._select.watch import DEFAULT_WATCH_KEYS
from ._parquet_rows import pyarrow
from ._parquet_summary import SUMMARY_KEY, summary_note

__all__ = [
    "BLOCK",
    "INDEX_ROWS",
    "KINDS",
    "LENGTH_KEYS",
    "SIDECAR_FOLDER",
    "SIDECAR_KEY",
    "SIDECAR_VERSION",
    "WORD_CHARS",
    "index_path",
    "remove_leftovers",
    "sidecar_path",
    "words_path",
    "write_sidecar",
    "write_sidecar_apart",
]

SIDECAR_FOLDER = ".asynctrace-index"
SIDECAR_KEY = b"asynctrace.sidecar"
# Bumped whenever a sidecar's columns or their meaning change: readers skip other versions.
# Version 3: the summary moved into the index sidecar's footer (version 2 had ``steps`` and
# ``counts`` sidecars).
SIDECAR_VERSION = 3
# Rows of a file per block of the text index (the viewer's `_text.BLOCK` is this).
BLOCK = 4096
# Rows per row group of both index sidecars: the unit a query by step (by prompt, in the
# ``byprompt`` one) reads. Smaller groups read less for a step that spans two files (the first
# open reads those again): with 16,384 rows they read 2.7M rows for 0.4M at 10M records.
INDEX_ROWS = BLOCK
# The sidecars of a file, by kind (the name's part before ``.parquet``).
KINDS: tuple[str, ...] = ("index", "byprompt", "words")
# The kinds whose temporaries a killed maker may have left: these, and those of version 2.
_MADE_KINDS: tuple[str, ...] = (*KINDS, "steps", "counts")
# The characters of a word (the viewer's `_text` says why these).
WORD_CHARS = "0-9A-Za-z\u017f\u212a"
# Metadata keys of a completion's length in tokens, tried in order.
LENGTH_KEYS: tuple[str, ...] = ("response_len", "response_length")
# The token-level columns whose presence marks a record as having token fields.
_TOKEN_COLUMNS = ("token_ids", "loss_mask", "logprobs", "advantages")
# The columns a sidecar is made from (every ParquetSink file has them).
_NEEDED = frozenset(
    ("id", "step", "split", "messages", "metadata", "reward", "advantage", "policy_version", "stop_reason")
)


class _Inexact(Exception):
    """A value the viewer would read otherwise than a sidecar can hold: no sidecar is written."""


def sidecar_path(file: Path, kind: str) -> Path:
    """Where the sidecar of this kind (`KINDS`) of the archive file `file` is."""
    return file.parent / SIDECAR_FOLDER / f"{file.name}.{kind}.parquet"


def index_path(file: Path) -> Path:
    """Where the index sidecar of the archive file `file` is."""
    return sidecar_path(file, "index")


def words_path(file: Path) -> Path:
    """Where the words sidecar of the archive file `file` is."""
    return sidecar_path(file, "words")


def _text(value: Any) -> str | None:
    """A metadata value as the viewer's JSON extraction reads it: a string or integer only."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    raise _Inexact


def _first(meta: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        found = _text(meta.get(key))
        if found is not None:
            return found
    return None


def _length(meta: dict[str, Any]) -> int | None:
    for key in LENGTH_KEYS:
        value = meta.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Inexact
        return value
    return None


def _index_table(pa: Any, table: Any, first: int) -> Any:
    """The index sidecar's rows of `table`, rows of a file from row number `first` on."""
    import pyarrow.compute as pc

    n = table.num_rows
    groups: list[str | None] = []
    prompts: list[str | None] = []
    lengths: list[int | None] = []
    loads = orjson.loads
    for raw in table.column("metadata").to_pylist():
        try:
            meta = loads(raw) if raw is not None else None
        except orjson.JSONDecodeError:
            meta = None
        if not isinstance(meta, dict):
            meta = {}
        groups.append(_first(meta, DEFAULT_GROUP_KEYS))
        prompts.append(_first(meta, DEFAULT_WATCH_KEYS))
        lengths.append(_length(meta))
    names = set(table.column_names)
    has_tokens = pa.array([False] * n)
    for name in _TOKEN_COLUMNS:
        if name in names:
            has_tokens = pc.or_(has_tokens, pc.is_valid(table.column(name)))
    counted = pa.nulls(n, pa.int64())
    if "loss_mask" in names:
        counted = _list_sums(pa, table.column("loss_mask"))
    elif "token_ids" in names:
        counted = pc.cast(pc.list_value_length(table.column("token_ids")), pa.int64())
    length = pc.coalesce(pa.array(lengths, pa.int64()), counted)
    return pa.table(
        {
            "rn": pa.array(range(first, first + n), pa.int64()),
            "id": table.column("id"),
            "step": pc.cast(table.column("step"), pa.int64()),
            "split": table.column("split"),
            "grp": pa.array(groups, pa.string()),
            "prompt": pa.array(prompts, pa.string()),
            "reward": table.column("reward"),
            "advantage": table.column("advantage"),
            "policy_version": table.column("policy_version"),
            "stop_reason": table.column("stop_reason"),
            "rlen": length,
            "tok": has_tokens,
        }
    )


def _list_sums(pa: Any, column: Any) -> Any:
    """Each row's sum of a list column (null for a null or empty list, as DuckDB's list_sum),
    from running sums over the values: no Python loop over tokens."""
    import pyarrow.compute as pc

    lists = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    values = pc.fill_null(pc.cast(lists.values, pa.int64()), 0)
    running = pa.concat_arrays([pa.array([0], pa.int64()), pc.cumulative_sum(values)])
    offsets = lists.offsets
    ends = pc.take(running, offsets.slice(1))
    starts = pc.take(running, offsets.slice(0, len(offsets) - 1))
    sums = pc.subtract(ends, starts)
    keep = pc.and_(pc.is_valid(lists), pc.greater(pc.list_value_length(lists), 0))
    return pc.if_else(keep, sums, pa.scalar(None, pa.int64()))


def _words_table(pa: Any, messages: Any, first: int) -> Any:
    """The distinct (blk, w) pairs of messages of a file from row number `first` on: the
    viewer's `_text.words_sql`."""
    import pyarrow.compute as pc

    messages = messages.combine_chunks() if hasattr(messages, "combine_chunks") else messages
    # Split at spaces first and keep each block's distinct pieces: the expression then runs
    # over far fewer strings (no word spans a space).
    pieces = pc.split_pattern(messages, " ")
    rows = pc.list_parent_indices(pieces)
    flat = pc.list_flatten(pieces)
    blocks = pc.cast(pc.divide(pc.add(rows, first), BLOCK), pa.int32())
    distinct = pa.table({"blk": blocks, "piece": flat}).group_by(["blk", "piece"]).aggregate([])
    split = pc.split_pattern_regex(distinct.column("piece"), f"[^{WORD_CHARS}]+")
    parents = pc.list_parent_indices(split)
    flat_words = pc.list_flatten(split)
    keep = pc.not_equal(flat_words, "")
    flat_words = pc.filter(flat_words, keep)
    blk = pc.filter(pc.take(distinct.column("blk"), parents), keep)
    lowered = pc.replace_substring(pc.utf8_lower(flat_words), "\u017f", "s")
    return pa.table({"blk": blk, "w": lowered}).group_by(["blk", "w"]).aggregate([])


def _write(
    pa: Any,
    table: Any,
    path: Path,
    note: dict[str, Any],
    rows: int | None = None,
    summary: dict[str, Any] | None = None,
) -> None:
    """Write `table` to `path` whole or not at all, with `note` (and `summary`, where given) in
    its footer (in row groups of `rows` rows, where given)."""
    footer = {SIDECAR_KEY: orjson.dumps(note)}
    if summary is not None:
        footer[SUMMARY_KEY] = orjson.dumps(summary)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        # No Arrow schema in the footer: it would hold the summary a second time, base64-encoded
        # (a third more footer for a first open to read); DuckDB reads the Parquet types alone.
        with pa.parquet.ParquetWriter(temporary, table.schema, compression="zstd", store_schema=False) as out:
            out.add_key_value_metadata(footer)
            out.write_table(table, row_group_size=rows)
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


def write_sidecar(file: Path) -> bool:
    """Write the sidecars of the named archive file `file`; False (and none written) where it
    cannot be read or a value cannot be held exactly. Errors are logged, never raised."""
    try:
        import pyarrow.compute as pc

        pa = pyarrow()
        names = set(pa.parquet.read_schema(file).names)
        if not names >= _NEEDED:
            return False
        columns = sorted(_NEEDED | (names & set(_TOKEN_COLUMNS)))
        # A row group at a time (a few MiB: see `_parquet_file`), so that what the trainer's
        # process holds does not grow with the file.
        parquet = pa.parquet.ParquetFile(file)
        indexes, words, rows = [], [], 0
        for group in range(parquet.num_row_groups):
            table = parquet.read_row_group(group, columns=columns)
            try:
                indexes.append(_index_table(pa, table, rows))
            except _Inexact:
                return False
            words.append(_words_table(pa, table.column("messages"), rows))
            rows += table.num_rows
            del table
        if not indexes:
            return False
        index = pa.concat_tables(indexes)
        # The viewer leaves out a record without an id, a step or a split (a sink never writes
        # one): rows it would not hold cannot be summed for it.
        if any(index.column(c).null_count for c in ("id", "step", "split")):
            return False
        note = {"version": SIDECAR_VERSION, "size": os.stat(file).st_size, "rows": rows, "block": BLOCK}
        # A block may span two row groups: its words are made distinct once more.
        every = pa.concat_tables(words).group_by(["blk", "w"]).aggregate([])
        by_prompt = index.take(pc.sort_indices(index, [("prompt", "ascending"), ("rn", "ascending")]))
        folder = file.parent / SIDECAR_FOLDER
        folder.mkdir(exist_ok=True)
        _write(pa, every, words_path(file), note)
        summary = summary_note(pa, index)
        _write(pa, by_prompt, sidecar_path(file, "byprompt"), note, INDEX_ROWS)
        # Last: a reader takes a file's sidecars only where its index sidecar is there and valid.
        _write(pa, index, index_path(file), note, INDEX_ROWS, summary)
        return True
    except Exception as exc:  # a sidecar only saves the viewer time: never the sink's failure
        logger.debug("ParquetSink: no sidecar for %s (%s: %s)", file, type(exc).__name__, exc)
        return False


# A temporary `_write` leaves when its process is killed: ``.<file>.<kind>.parquet.<pid>.tmp``.
_LEFTOVER = re.compile(r"\.(.+)\.(" + "|".join(_MADE_KINDS) + r")\.parquet\.([0-9]+)\.tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's (or no pid at all): left alone
    return True


def remove_leftovers(directory: Path) -> int:
    """Remove the temporaries that sidecar makers killed (SIGKILL: no `finally` ran) left in
    `directory`'s `SIDECAR_FOLDER`: only names of `_write`'s pattern, only regular files (not a
    link, nor a folder), only where no process of that id runs (a live maker's is its work in
    progress). How many were removed; what cannot be removed is left, silently."""
    if os.name != "posix":
        return 0  # os.kill(pid, 0) sends Ctrl-C on Windows
    folder = directory / SIDECAR_FOLDER
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return 0  # a link to a folder elsewhere is not the sink's
        names = os.listdir(folder)
    except OSError:
        return 0
    removed = 0
    for name in names:
        found = _LEFTOVER.fullmatch(name)
        if found is None or _alive(int(found.group(3))):
            continue
        path = folder / name
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            os.unlink(path)
            removed += 1
        except OSError:
            continue
    return removed


def write_sidecar_apart(file: Path, halt: threading.Event, env: dict[str, str]) -> bool:
    """`write_sidecar` in a process of its own (``python -m asynctrace.sinks._parquet_sidecar
    FILE``), so that the trainer's process neither imports pyarrow's compute kernels nor holds
    what they use; killed once `halt` is set (the sink closes). Whether it wrote them."""
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "asynctrace.sinks._parquet_sidecar", str(file)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=env,
        )
    except OSError as exc:
        logger.debug("ParquetSink: no sidecar for %s (%s)", file, exc)
        return False
    while True:
        try:
            return child.wait(timeout=0.1) == 0
        except subprocess.TimeoutExpired:
            if halt.is_set():
                child.kill()
                child.wait()
                # A killed child leaves its temporaries (named by its pid: see `_write`).
                for made in (sidecar_path(file, kind) for kind in KINDS):
                    with contextlib.suppress(OSError):
                        os.unlink(made.with_name(f".{made.name}.{child.pid}.tmp"))
                return False


def main() -> int:
    # Ctrl-C reaches the whole process group: the sink decides when this one ends.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    return 0 if write_sidecar(Path(sys.argv[1])) else 1


assert set(_TOKEN_COLUMNS) <= set(TOKEN_FIELDS)

if __name__ == "__main__":
    sys.exit(main())
