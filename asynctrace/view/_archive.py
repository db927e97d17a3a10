"""The archive as the viewer reads it: the browsing pages' questions (`_browse`), and its opening,
its token arrays and a search, answered from the index (`_index`).

Answers come from the index's typed values; texts and token arrays are read from the files, for
the rows a page shows only.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import Any

import duckdb

from .._records.tokens import TOKEN_FIELDS, token_bytes
from ..sinks._parquet_sidecar import remove_leftovers
from . import _prompt_index
from ._browse import Browse, load_json
from ._model import Completion
from ._partials import FileSummary
from ._search import find_text
from ._sidecar import index_sidecars
from ._summary import MAX_PROMPTS, Summary, merge_summaries, path_for, read, write
from ._text import BLOCK

__all__ = ["Archive"]

# Pages list the archive's directory for new files at most this often.
_RESCAN_SECONDS = 2.0


def _token_arrays(held: Any) -> dict[str, Any]:
    """A JSONL record's encoded token fields as numpy arrays; a field that is not one, or whose
    value is damaged, is left out."""
    import numpy  # here, not at the start: the first open's summary does not wait for it

    out: dict[str, Any] = {}
    if not isinstance(held, dict):
        return out
    for name, value in held.items():
        dtype = TOKEN_FIELDS.get(name) if isinstance(name, str) else None
        if dtype is None or not isinstance(value, dict):
            continue
        try:
            out[name] = numpy.frombuffer(token_bytes(name, value), dtype=numpy.dtype(dtype).newbyteorder("<"))
        except ValueError:
            continue
    return out


def _parquet_token_arrays(fetched: dict[str, Any]) -> dict[str, Any]:
    """A Parquet row's token columns (as DuckDB fetched them) as numpy arrays; a column the file
    lacks, or one whose values are damaged, is left out."""
    import numpy

    out: dict[str, Any] = {}
    for name, dtype in TOKEN_FIELDS.items():
        column = fetched.get(name)
        if column is None or not len(column) or column[0] is numpy.ma.masked or column[0] is None:
            continue
        # A file of another writer may hold nulls in a list, or values of another type.
        try:
            held = numpy.ma.filled(column[0], numpy.nan if dtype == "float32" else -1)
            out[name] = numpy.asarray(held).astype(dtype)
        except (TypeError, ValueError):
            continue
    return out


class Archive(Browse):
    """An archive and every question the viewer asks of it: the browsing pages' (`Browse`), its
    opening (the overview kept between starts), the token page's and a search's."""

    def __init__(
        self, source: str | os.PathLike[str], *, cache: str | os.PathLike[str] | None = None
    ) -> None:
        super().__init__(source, cache=cache)
        # The summary read before the index (`read_summary`, `sidecar_summary`), with its files.
        self._known: tuple[list[str], Summary] | None = None

    def _rescan_seconds(self) -> float:
        return _RESCAN_SECONDS

    def load(self, keep: bool = True) -> None:
        """Index every file there is now, answer the overview's questions once (then kept), and
        with `keep` write the cache and index the texts. Without it the token-level values wait
        too (unless the overview needs them): the caller then calls `complete_tokens()`, `keep()`
        and `index_text()` when it likes, after the server says it is ready, as `asynctrace
        view` does."""
        self.build(defer_tokens=not keep)
        if self.lengths_need_tokens():
            self.complete_tokens()
        self._seed()
        try:
            self.overview()
            self.frequent_prompts()
        except duckdb.Error:  # a sidecar damaged past its footer: its file is read now (`repair`)
            self.overview()
            self.frequent_prompts()
        if keep:
            self.index_ids()
            self.keep()
            self.keep_summary()
            self.index_text()

    def _seed(self) -> None:
        """Take the overview's answers from the summary read before the index (kept, or the
        sidecars'), where the index holds exactly the files it was made of: at 10M records they
        are seconds to answer again."""
        known, self._known = self._known, None
        with self._lock:
            if known is None or known[0] != self.files or self.left_out or "overview" in self._cache:
                return
            self._cache["overview"] = list(known[1].overview)
            self._cache["frequent"] = list(known[1].frequent)
            if known[1].holders is not None:
                self.locate_prompts(known[1].holders)

    def keep_summary(self) -> None:
        """Keep the overview's answers in the cache for the next start of these same files (`_summary`)."""
        if self.cache is None or self.kind != "parquet" or self.left_out:
            return  # with records left out, each start reads their files again, and says so
        with self._lock:
            if len(self.sidecars) == len(self.files):
                return  # each start merges the sidecars' summaries: as fast as reading a kept one
        with self._lock:
            names = [self._cached(f) for f in self.files]
        if not names or any(n is None for n in names):
            return
        path = path_for(self.cache, sorted(n.name for n in names if n is not None))
        if path.is_file():
            return  # kept by a former start of these same files: its answers are these (seconds at 10M)
        rows, frequent = self.overview(), self.frequent_prompts(50)
        with self._lock:
            if "overview" not in self._cache or [self._cached(f) for f in self.files] != names:
                return  # files came meanwhile: the next start lists others and reads the index anyway
            count = self._con.execute("SELECT count(DISTINCT prompt) FROM idx").fetchone()
            prompts = None
            if count is not None and count[0] <= MAX_PROMPTS:
                counted = self._con.execute(
                    "SELECT prompt, count(DISTINCT step), count(*) FROM idx "
                    "WHERE prompt IS NOT NULL GROUP BY prompt"
                ).fetchall()
                prompts = {p: (steps, n) for p, steps, n in counted}
            skipped = {os.path.basename(f): why for f, why in self.skipped.items()}
        write(path, Summary(rows, frequent, prompts, skipped))

    def read_summary(self) -> Summary | None:
        """The overview's answers kept for exactly the files the archive holds now, if any."""
        if self.cache is None or self.kind != "parquet":
            return None
        files = self._listing()
        names = [self._cached(f) for f in files]
        if not names or any(n is None for n in names):
            return None
        summary = read(path_for(self.cache, sorted(n.name for n in names if n is not None)))
        if summary is not None:
            self._known = (files, summary)
        return summary

    def sidecar_summary(self) -> Summary | None:
        """The overview's answers from the sinks' sidecars (`_sidecar`) when every file of the
        archive has valid ones: the summary in each index sidecar's footer (its steps' figures,
        its prompts' counts), merged (`merge_summaries`) before the index is read, with no pass
        over the records. None otherwise."""
        if self.kind != "parquet":
            return None
        files = self._listing()
        summaries: dict[str, FileSummary] = {}
        with self.cursor() as cursor:
            sidecars = index_sidecars(cursor, files, summaries)
            if not files or len(sidecars) != len(files):
                return None
            try:
                summary = merge_summaries(cursor, [(sidecars[f], summaries[f]) for f in files])
            except duckdb.Error:
                return None  # a sidecar damaged past its footer: the index says, once read
        self._known = (files, summary)
        self.checked_sidecars = sidecars
        return summary

    def index_prompts(self) -> None:
        """Write the archive's by-prompt index (`_prompt_index`) where none valid covers every
        file held through its sidecars, in the background after a first open: at the lowest
        priority, one thread, and its own connection (which `shut()` interrupts). A folder the
        viewer cannot write in keeps none: questions by prompt then read each file's sidecar."""
        if self.kind != "parquet" or not self.path.is_dir() or self.closing.is_set():
            return
        with self._lock:
            self.take_prompt_index()
            self.prompt_view()  # every held file's by-prompt sidecar checked
            held = [(src, s.by_prompt) for src, s in sorted(self.sidecars.items()) if s.by_prompt != s.by_row]
            if len(held) < 2 or {src for src, _ in held} <= self._prompt_srcs:
                return
            files = [self.files[src] for src, _ in held]
            try:
                rows = dict(
                    self._con.execute(
                        "SELECT file_name, num_rows FROM parquet_file_metadata($f)", {"f": files}
                    ).fetchall()
                )
            except duckdb.Error:
                return
        remove_leftovers(self.path)  # a builder killed before: its temporary
        with contextlib.suppress(OSError):  # lowest priority for this thread (Linux: a thread's own)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        con = duckdb.connect(
            config={"threads": 1, "memory_limit": "512MB", "temp_directory": self._scratch.name}
        )
        with self._cursors_lock:
            self._cursors.add(con)
        try:
            built = _prompt_index.build(
                con, self.path, [(f, path, int(rows[f])) for f, (_, path) in zip(files, held, strict=True)]
            )
        except (duckdb.Error, OSError, KeyError):
            built = False  # interrupted at exit, a folder not ours to write, a file gone
        finally:
            with self._cursors_lock:
                self._cursors.discard(con)
            con.close()
        if built:
            with self._lock:
                self._prompt_index_checked = False  # taken at the next question by prompt

    def tokens(self, record_id: str) -> dict[str, Any] | None:
        """The record's token-level fields, each a 1-D numpy array of the dtype it is kept in (a
        field its file lacks, or a damaged one, is left out); None when it has none (or no such
        record). A Parquet row's lists come as arrays, never as Python numbers."""
        self._await_tokens()
        with self._query() as con:
            found = con.execute(
                f"SELECT id, src, rn FROM idx WHERE {self.located(con, [record_id])} AND id = $id AND tok",
                {"id": record_id},
            ).fetchall()
            if not found:
                return None
            if self.kind == "jsonl":
                raw = self._rows(con, found, "tokens")
                return _token_arrays(load_json(raw[0][1] if raw else None, {}))
            _, src, row = found[0]
            columns = self._token_columns(self.files[src])
            fetched = con.execute(
                f"SELECT {', '.join(columns)} FROM read_parquet($file, file_row_number = true) "
                f"WHERE file_row_number = {int(row)}",
                {"file": self.files[src]},
            ).fetchnumpy()
        return _parquet_token_arrays(fetched)

    def _token_columns(self, file: str) -> list[str]:
        """The token-level columns `file` has (an older file may lack some): NULL stands for the others."""
        names = {r[0] for r in self._con.execute("SELECT name FROM parquet_schema(?)", [file]).fetchall()}
        return [c if c in names else f"NULL AS {c}" for c in TOKEN_FIELDS]

    def find(
        self,
        *,
        text: str | None = None,
        low: float | None = None,
        high: float | None = None,
        split: str | None = None,
        limit: int = 100,
    ) -> list[Completion]:
        """Records whose messages contain `text` (any case) and whose reward is within [low, high]."""
        conditions: list[str] = []
        params: dict[str, Any] = {}
        if low is not None:
            conditions.append("reward >= $low")
            params["low"] = low
        if high is not None:
            conditions.append("reward <= $high")
            params["high"] = high
        if split:
            conditions.append("split = $split")
            params["split"] = split
        where = " AND ".join(conditions) or "true"
        if not text:
            return self._completions(where, params, f"step, id LIMIT {int(limit)}")
        pattern = "(?i)" + re.escape(text)
        if self.kind == "jsonl":
            with self._query() as con:
                # A case-insensitive regular expression of the literal text: twice as fast as lower().
                found = con.execute(
                    f"SELECT id, messages FROM records WHERE {where} "
                    f"AND regexp_matches(messages, $pattern) ORDER BY step, id LIMIT {int(limit)}",
                    {"pattern": pattern, **params},
                ).fetchall()
            if not found:
                return []
            return self._completions(
                "id IN (SELECT unnest($hits))",
                {"hits": [r[0] for r in found]},
                "step, id",
                texts_read={r[0]: r[1] for r in found},
                ids=[r[0] for r in found],
            )
        with self._query() as con:
            hits = find_text(
                con,
                files=self.files,
                skipped=self.skipped,
                text_indexed=self.text_indexed,
                firsts=self._block_steps(con),
                text=text,
                pattern=pattern,
                where=where,
                params=params,
                limit=limit,
            )
        if not hits:
            return []
        # The search read each hit's place: the index rows are found by it, without looking the
        # ids up first (`located`); the ids pick the hits among the other rows at those places.
        places: dict[int, set[int]] = {}
        for h in hits:
            places.setdefault(h.src, set()).add(h.rn)
        with self._lock:
            relation = self.at_places(places)
        return self._completions(
            "id IN (SELECT unnest($hits))",
            {"hits": [h.id for h in hits]},
            "step, id",
            texts_read={h.id: h.messages for h in hits},
            table=relation,
        )

    def warm_blocks(self) -> None:
        """Answer `_block_steps` through a cursor of its own (a pass over every record's step: a
        few hundred ms at 10M records), so that the first search does not wait for it."""
        if self.kind != "parquet":
            return
        with self._lock:
            upto = len(self.files)
        try:
            with self.cursor() as cursor:
                rows = cursor.execute(
                    f"SELECT src, rn // {BLOCK}, min(step) FROM idx "
                    f"WHERE rn IS NOT NULL AND src < {int(upto)} GROUP BY ALL"
                ).fetchall()
        except duckdb.Error:
            with self._lock:
                self.repair()  # a sidecar damaged past its footer: the first search asks again
            return
        with self._lock:
            if len(self.files) == upto and "blocks" not in self._cache:
                self._cache["blocks"] = {(src, block): step for src, block, step in rows}

    def _block_steps(self, con: duckdb.DuckDBPyConnection) -> dict[tuple[int, int], int]:
        """The first step of each block of each Parquet file: (src, block) -> step (kept until new files)."""
        if "blocks" not in self._cache:
            rows = con.execute(
                f"SELECT src, rn // {BLOCK}, min(step) FROM idx WHERE rn IS NOT NULL GROUP BY ALL"
            ).fetchall()
            self._cache["blocks"] = {(src, block): step for src, block, step in rows}
        blocks: dict[tuple[int, int], int] = self._cache["blocks"]
        return blocks
