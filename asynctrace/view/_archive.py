"""The archive as the viewer reads it: DuckDB over the finished files, one small index in memory.

The index holds a few typed values of every record (step, split, group, prompt id, reward,
advantage, policy version, stop reason, response length) so that the overview and the rankings
never parse the metadata JSON again; texts and token arrays are read from the files, for the
rows a page shows only. Parquet files are complete once they have their name (a sink writes
them under a hidden one and renames them), so a file indexed once never changes: new files of
a running trainer are indexed as they appear.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import glob
import hashlib
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import orjson
from duckdb.func import SPECIAL

from .._records.groups import DEFAULT_GROUP_KEYS
from .._records.tokens import decode_token_fields
from .._select.watch import DEFAULT_WATCH_KEYS
from ._model import TRUNCATED, Completion, GroupRow, StepRow, Tokens, split_messages

__all__ = ["LENGTH_KEYS", "Archive"]

# Metadata keys of a completion's length in tokens, tried in order.
LENGTH_KEYS: tuple[str, ...] = ("response_len", "response_length")
_RESCAN_SECONDS = 2.0
# Bumped whenever the index's columns or their meaning change: older cached indexes are not read.
_INDEX_VERSION = 2
_TOKEN_COLUMNS = ("token_ids", "loss_mask", "logprobs", "advantages")
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


_TRUNCATED_SQL = "(" + ", ".join(f"'{s}'" for s in TRUNCATED) + ")"


def _highlights(rows: list[Any]) -> set[str]:
    """Ids of each step's best completion and each policy version's best and worst (index rows:
    id, step, ..., reward at 5, policy_version at 7)."""

    def reward(r: Any) -> float:
        return -math.inf if r[5] is None else float(r[5])

    picked: set[str] = set()
    for position in (1, 7):
        by: dict[Any, list[Any]] = {}
        for r in rows:
            by.setdefault(r[position], []).append(r)
        for items in by.values():
            picked.add(max(items, key=reward)[0])
            if position == 7:
                picked.add(min(items, key=reward)[0])
    return picked


def _mask_count(b64: str | None) -> int | None:
    """The tokens a JSONL record's encoded loss mask (int8 values) keeps in the loss."""
    if b64 is None:
        return None
    try:
        raw = base64.b64decode(b64, validate=True)
    except binascii.Error:
        return None
    return len(raw) - raw.count(0)


def _loads(raw: Any, default: Any) -> Any:
    if raw is None:
        return default
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return default


class Archive:
    """A Parquet archive directory (of `ParquetSink` files), a JSONL file, or a directory of JSONL files."""

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
        self._cache: dict[Any, Any] = {}
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

    def load(self, keep: bool = True) -> None:
        """Index every file there is now, answer the overview's questions once (then kept), and
        with `keep` write the cache (else the caller calls `keep()` when it likes: after
        the server says it is ready, as `asynctrace view` does)."""
        with self._lock:
            self._loading = True
            try:
                self._scan(force=True)
            finally:
                self._loading = False
        self.overview()
        self.frequent_prompts()
        if keep:
            self.keep()

    # -- loading -----------------------------------------------------------------------------

    def _listing(self) -> list[str]:
        if self.path.is_file():
            return [str(self.path)]
        pattern = "*.jsonl" if self.kind == "jsonl" else "*.parquet"
        # Hidden names are a sink's temporaries and journals: never read.
        return sorted(glob.glob(os.path.join(glob.escape(str(self.path)), pattern)))

    def _scan(self, force: bool = False) -> None:
        """Index the files that appeared since the last scan (at most one listing every 2 s)."""
        now = time.monotonic()
        if not force and self.files and now - self._scanned < _RESCAN_SECONDS:
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
        self._cache.clear()

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
        present = [c for c in _TOKEN_COLUMNS if c in have]
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

    @contextmanager
    def _query(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """The connection, for one page's queries at a time, after picking up new files."""
        with self._lock:
            self._scan()
            yield self._con

    def _rows(
        self,
        con: duckdb.DuckDBPyConnection,
        picks: Sequence[tuple[str, int, int | None]],
        columns: str = "messages, metadata",
    ) -> list[Any]:
        """(id, *columns) of the records `picks` names (id, src, row number in its file).

        Parquet rows are read by their row number in their file: DuckDB then skips to them, where
        a filter on the id would read that column of every file the rows are in."""
        if not picks:
            return []
        if self.kind == "jsonl":
            return con.execute(
                f"SELECT id, {columns} FROM records WHERE id IN (SELECT unnest($ids))",
                {"ids": [p[0] for p in picks]},
            ).fetchall()
        by_file: dict[int, list[int]] = {}
        for _, src, row in picks:
            by_file.setdefault(src, []).append(int(row if row is not None else -1))
        parts, params = [], {}
        for i, (src, rows) in enumerate(sorted(by_file.items())):
            params[f"f{i}"] = self.files[src]
            parts.append(
                f"SELECT id, {columns} FROM read_parquet($f{i}, file_row_number = true) "
                f"WHERE file_row_number IN ({', '.join(str(r) for r in sorted(set(rows)))})"
            )
        return con.execute(" UNION ALL ".join(parts), params).fetchall()

    # -- pages' questions --------------------------------------------------------------------

    def size(self) -> int:
        with self._query() as con:
            row = con.execute("SELECT count(*) FROM idx").fetchone()
        return int(row[0]) if row else 0

    def overview(self) -> list[StepRow]:
        """Every (split, step): samples, reward mean and spread, groups, zero-signal groups, truncation
        share, mean response length and policy-version lag (step - policy_version)."""
        with self._query() as con:
            if "overview" in self._cache:
                return list(self._cache["overview"])
            rows = con.execute(
                f"""
                WITH s AS (
                    SELECT split, step, count(*) AS samples, avg(reward) AS reward_mean,
                        stddev_pop(reward) AS reward_std,
                        avg(CASE WHEN stop_reason IS NOT NULL
                            THEN (stop_reason IN {_TRUNCATED_SQL})::INT END) AS truncated,
                        avg(rlen) AS length_mean, avg(step - policy_version) AS lag_mean,
                        max(step - policy_version) AS lag_max
                    FROM idx GROUP BY split, step),
                g AS (
                    SELECT split, step, stddev_pop(reward) AS spread
                    FROM idx WHERE grp IS NOT NULL AND reward IS NOT NULL GROUP BY split, step, grp),
                gs AS (
                    SELECT split, step, count(*) AS groups, count(*) FILTER (WHERE spread = 0) AS zero,
                        avg(spread) AS mean_spread
                    FROM g GROUP BY split, step)
                SELECT s.split, s.step, samples, reward_mean, reward_std, coalesce(groups, 0),
                    coalesce(zero, 0), mean_spread, truncated, length_mean, lag_mean, lag_max
                FROM s LEFT JOIN gs USING (split, step) ORDER BY s.split, s.step
                """
            ).fetchall()
            out = [StepRow(*r) for r in rows]
            self._cache["overview"] = out
            return list(out)

    def splits(self) -> list[str]:
        return sorted({r.split for r in self.overview()})

    def step_groups(self, split: str, step: int, order: str = "spread") -> list[GroupRow]:
        """A step's prompt groups, ranked: `spread`/`mean` (highest first), `-spread`/`-mean` (lowest)."""
        column, direction = order.lstrip("-"), "ASC" if order.startswith("-") else "DESC"
        if column not in ("spread", "mean"):
            raise ValueError(f"order: expected spread, -spread, mean or -mean, got {order!r}")
        key = "spread" if column == "spread" else "reward_mean"
        with self._query() as con:
            rows = con.execute(
                f"""
                SELECT grp, any_value(prompt), count(*), avg(reward), stddev_pop(reward),
                    count(*) FILTER (WHERE stop_reason IN {_TRUNCATED_SQL}), min(id)
                FROM idx WHERE split = $split AND step = $step AND grp IS NOT NULL GROUP BY grp
                """,
                {"split": split, "step": step},
            ).fetchall()
        groups = [GroupRow(*r) for r in rows]
        attr = {"spread": "spread", "reward_mean": "reward_mean"}[key]
        present = [g for g in groups if getattr(g, attr) is not None]
        absent = [g for g in groups if getattr(g, attr) is None]
        present.sort(key=lambda g: (getattr(g, attr), g.group), reverse=direction == "DESC")
        return present + sorted(absent, key=lambda g: g.group)

    def prompts_of(self, ids: Sequence[str]) -> dict[str, str]:
        """The prompt text of each of these records (found in the index first, then read)."""
        if not ids:
            return {}
        with self._query() as con:
            found = con.execute(
                "SELECT id, src, rn FROM idx WHERE id IN (SELECT unnest($ids))", {"ids": list(ids)}
            ).fetchall()
            rows = self._rows(con, found, "messages")
        return {r[0]: split_messages(_loads(r[1], []))[0] for r in rows}

    def _completions(
        self,
        where: str,
        params: dict[str, Any],
        order: str,
        *,
        metadata: bool = False,
        shown: Callable[[list[Any]], set[str]] | None = None,
    ) -> list[Completion]:
        """The index rows matching `where`, with the texts (and with `metadata`, the metadata) of
        those `shown` picks, every one by default; the others have `loaded` False."""
        with self._query() as con:
            index = con.execute(
                "SELECT id, step, split, grp, prompt, reward, advantage, policy_version, stop_reason, "
                f"rlen, tok, src, rn FROM idx WHERE {where} ORDER BY {order}",
                params,
            ).fetchall()
            if not index:
                return []
            wanted = shown(index) if shown is not None else {r[0] for r in index}
            picks = [(r[0], r[11], r[12]) for r in index if r[0] in wanted]
            columns = "messages, " + ("metadata" if metadata else "NULL")
            texts = {r[0]: r for r in self._rows(con, picks, columns)}
        out = []
        for r in index:
            _, raw_messages, raw_metadata = texts.get(r[0], (r[0], None, None))
            messages = _loads(raw_messages, [])
            prompt, text = split_messages(messages)
            out.append(
                Completion(
                    id=r[0],
                    step=r[1],
                    split=r[2],
                    group=r[3],
                    prompt_id=r[4],
                    reward=r[5],
                    advantage=r[6],
                    policy_version=r[7],
                    stop_reason=r[8],
                    length=r[9],
                    has_tokens=bool(r[10]),
                    prompt=prompt,
                    text=text,
                    messages=messages,
                    metadata=_loads(raw_metadata, {}),
                    loaded=r[0] in texts,
                )
            )
        return out

    def group(self, split: str, step: int, group: str) -> list[Completion]:
        """A group's completions, best reward first."""
        return self._completions(
            "split = $split AND step = $step AND grp = $group",
            {"split": split, "step": step, "group": group},
            "reward DESC NULLS LAST, id",
        )

    def record(self, record_id: str) -> Completion | None:
        found = self._completions("id = $id", {"id": record_id}, "id", metadata=True)
        return found[0] if found else None

    def prompt_history(self, prompt: str, split: str) -> tuple[list[Completion], list[str]]:
        """Every completion of one prompt id in `split` (by policy version, then step, best reward
        first), and the splits the prompt occurs in. Texts are read for each step's best and each
        policy version's best and worst only: a prompt's completions lie in every file of the run,
        and each text read costs."""
        every = self._completions(
            "prompt = $prompt",
            {"prompt": prompt},
            "policy_version DESC NULLS LAST, step DESC, reward DESC NULLS LAST, id",
            shown=lambda rows: _highlights([r for r in rows if r[2] == split]),
        )
        return [c for c in every if c.split == split], sorted({c.split for c in every})

    def frequent_prompts(self, limit: int = 10) -> list[tuple[str, int, int]]:
        """The prompt ids seen at the most steps: (prompt, steps, samples)."""
        with self._query() as con:
            if "frequent" not in self._cache:
                self._cache["frequent"] = con.execute(
                    """
                    SELECT prompt, count(DISTINCT step) AS steps, count(*) FROM idx
                    WHERE prompt IS NOT NULL GROUP BY prompt ORDER BY steps DESC, prompt LIMIT 50
                    """
                ).fetchall()
            return list(self._cache["frequent"][:limit])

    def prompt_counts(self, prompts: Sequence[str]) -> dict[str, tuple[int, int]]:
        """(steps, samples) of each of these prompt ids that the archive holds."""
        with self._query() as con:
            rows = con.execute(
                "SELECT prompt, count(DISTINCT step), count(*) FROM idx "
                "WHERE prompt IN (SELECT unnest($p)) GROUP BY prompt",
                {"p": list(prompts)},
            ).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows}

    def tokens(self, record_id: str) -> Tokens | None:
        """The record's token-level fields; None when it has none (or no such record)."""
        with self._query() as con:
            found = con.execute(
                "SELECT id, src, rn FROM idx WHERE id = $id AND tok", {"id": record_id}
            ).fetchall()
            if not found:
                return None
            if self.kind == "jsonl":
                raw = self._rows(con, found, "tokens")
                held = decode_token_fields(_loads(raw[0][1] if raw else None, {}))
                return Tokens(*(held.get(n) for n in _TOKEN_COLUMNS))
            columns = self._token_columns(self.files[found[0][1]])
            rows = self._rows(con, found, ", ".join(columns))
        if not rows:
            return None
        values = dict(zip(columns, rows[0][1:], strict=True))
        return Tokens(*(values.get(n) for n in _TOKEN_COLUMNS))

    def _token_columns(self, file: str) -> list[str]:
        """The token-level columns `file` has (an older file may lack some): NULL stands for the others."""
        names = {r[0] for r in self._con.execute("SELECT name FROM parquet_schema(?)", [file]).fetchall()}
        return [c if c in names else f"NULL AS {c}" for c in _TOKEN_COLUMNS]

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
        with self._query() as con:
            files = [f for f in self.files if f not in self.skipped]
            if self.kind == "jsonl":
                relation, extra = "records", {}
            elif files:
                relation, extra = "read_parquet($files, union_by_name = true)", {"files": files}
            else:
                return []
            # The typed conditions are columns of the files too: one pass over them finds the hits.
            # A case-insensitive regular expression of the literal text: twice as fast as lower().
            hits = con.execute(
                f"SELECT id FROM {relation} WHERE {where} AND regexp_matches(messages, $pattern) "
                f"ORDER BY step, id LIMIT {int(limit)}",
                {"pattern": "(?i)" + re.escape(text), **params, **extra},
            ).fetchall()
        if not hits:
            return []
        return self._completions("id IN (SELECT unnest($hits))", {"hits": [h[0] for h in hits]}, "step, id")
