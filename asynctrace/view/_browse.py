"""The questions of the viewer's browsing pages (overview, step, group, prompt history, record),
answered from the index (`_index`).

Answers come from the index's typed values; texts are read from the files, for the rows a page
shows only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import duckdb
import orjson

from ._held import SidecarsRepaired
from ._index import Index
from ._model import HISTORY_DIFFS, HISTORY_VERSIONS, TRUNCATED, Completion, GroupRow, StepRow, split_order
from ._turns import prompt_length, split_messages, uses_tools

__all__ = ["Browse", "frequent_sql", "load_json", "overview_sql", "read_rows"]

_TRUNCATED_SQL = "(" + ", ".join(f"'{s}'" for s in TRUNCATED) + ")"
# Seconds a page waits for the token-level values a first open reads after the overview.
_TOKENS_DEADLINE = 60.0


def _highlights(rows: list[Any]) -> set[str]:
    """Ids of the best completion of each of the latest HISTORY_DIFFS + 1 steps, and the best and
    the worst of each of the latest HISTORY_VERSIONS policy versions: what a prompt's history
    shows (index rows: id, step, ..., reward at 5, policy_version at 7)."""

    def reward(r: Any) -> float:
        return -math.inf if r[5] is None else float(r[5])

    def latest(position: int, count: int) -> dict[Any, list[Any]]:
        by: dict[Any, list[Any]] = {}
        for r in rows:
            by.setdefault(r[position], []).append(r)
        # A version that is not known sorts oldest, as the page orders it.
        kept = sorted(by, key=lambda k: (k is not None, k), reverse=True)[:count]
        return {k: by[k] for k in kept}

    picked: set[str] = set()
    for items in latest(1, HISTORY_DIFFS + 1).values():
        picked.add(max(items, key=reward)[0])
    for items in latest(7, HISTORY_VERSIONS).values():
        picked.add(max(items, key=reward)[0])
        picked.add(min(items, key=reward)[0])
    return picked


def overview_sql(relation: str) -> str:
    """The overview's query (see `Browse.overview`) over `relation`, rows with the index's columns."""
    return f"""
    WITH s AS (
        SELECT split, step, count(*) AS samples, avg(reward) AS reward_mean,
            stddev_pop(reward) AS reward_std,
            avg(CASE WHEN stop_reason IS NOT NULL
                THEN (stop_reason IN {_TRUNCATED_SQL})::INT END) AS truncated,
            avg(rlen) AS length_mean, avg(step - policy_version) AS lag_mean,
            max(step - policy_version) AS lag_max
        FROM {relation} GROUP BY split, step),
    g AS (
        SELECT split, step, stddev_pop(reward) AS spread
        FROM {relation} WHERE grp IS NOT NULL AND reward IS NOT NULL GROUP BY split, step, grp),
    gs AS (
        SELECT split, step, count(*) AS groups, count(*) FILTER (WHERE spread = 0) AS zero,
            avg(spread) AS mean_spread
        FROM g GROUP BY split, step)
    SELECT s.split, s.step, samples, reward_mean, reward_std, coalesce(groups, 0),
        coalesce(zero, 0), mean_spread, truncated, length_mean, lag_mean, lag_max
    FROM s LEFT JOIN gs USING (split, step) ORDER BY s.split, s.step
    """


def frequent_sql(relation: str) -> str:
    """The query of the 50 prompt ids seen at the most steps (see `Browse.frequent_prompts`)."""
    return (
        f"SELECT prompt, count(DISTINCT step) AS steps, count(*) FROM {relation} "
        "WHERE prompt IS NOT NULL GROUP BY prompt ORDER BY steps DESC, prompt LIMIT 50"
    )


def load_json(raw: Any, default: Any) -> Any:
    if raw is None:
        return default
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return default


def _messages(raw: Any) -> list[Any]:
    """A record's messages: a list, whatever a damaged or foreign file holds (anything else is
    one message the pages show as it is)."""
    value = load_json(raw, [])
    return value if isinstance(value, list) else [value]


def _metadata(raw: Any) -> dict[str, Any]:
    value = load_json(raw, {})
    return value if isinstance(value, dict) else {"metadata": value}


def read_rows(
    con: duckdb.DuckDBPyConnection,
    kind: str,
    files: Sequence[str],
    picks: Sequence[tuple[str, int, int | None]],
    columns: str = "messages, metadata",
    where: str = "true",
) -> list[Any]:
    """(id, *columns) of the records `picks` names (id, src, row number in its file), those that
    match `where` only, from an archive of this kind and these files.

    Parquet rows are read by their row number in their file: DuckDB then skips to them, where a
    filter on the id would read that column of every file the rows are in."""
    if not picks:
        return []
    if kind == "jsonl":
        return con.execute(
            f"SELECT id, {columns} FROM records WHERE id IN (SELECT unnest($ids)) AND ({where})",
            {"ids": [p[0] for p in picks]},
        ).fetchall()
    by_file: dict[int, list[int]] = {}
    for _, src, row in picks:
        by_file.setdefault(src, []).append(int(row if row is not None else -1))
    parts, params = [], {}
    for i, (src, rows) in enumerate(sorted(by_file.items())):
        params[f"f{i}"] = files[src]
        parts.append(
            f"SELECT id, {columns} FROM read_parquet($f{i}, file_row_number = true) "
            f"WHERE file_row_number IN ({', '.join(str(r) for r in sorted(set(rows)))}) AND ({where})"
        )
    return con.execute(" UNION ALL ".join(parts), params).fetchall()


class Browse(Index):
    """An archive (see `Index` for what it may be) and the questions its browsing pages ask of it.

    Each question is answered under the index's lock, after picking up the files that appeared."""

    def __init__(
        self, source: str | os.PathLike[str], *, cache: str | os.PathLike[str] | None = None
    ) -> None:
        super().__init__(source, cache=cache)
        # The overview page's answers (overview, frequent prompts), until new files are indexed.
        self._cache: dict[Any, Any] = {}

    def _indexed(self) -> None:
        self._cache.clear()

    def _await_tokens(self) -> None:
        """Wait (outside the lock) for the token-level values a first open reads after the overview."""
        if not self.tokens_ready.wait(_TOKENS_DEADLINE):
            raise TimeoutError("the archive's token-level fields are still being read: try again in a moment")

    def _rescan_seconds(self) -> float:
        """How often, at most, pages list the archive's directory for new files (`Archive` says)."""
        raise NotImplementedError

    @contextmanager
    def _query(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """The connection, for one page's queries at a time, after picking up new files. A query
        that fails while some sidecars were not read whole yet (a first open's: see `build`)
        has them read whole: a file whose sidecar is damaged past its footer is then read itself,
        and `SidecarsRepaired` says that the same question asked again is answered from it."""
        with self._lock:
            self._scan(every=self._rescan_seconds())
            try:
                yield self._con
            except duckdb.Error as exc:
                if self.repair():
                    raise SidecarsRepaired(str(exc)) from exc
                raise

    def _rows(
        self,
        con: duckdb.DuckDBPyConnection,
        picks: Sequence[tuple[str, int, int | None]],
        columns: str = "messages, metadata",
        where: str = "true",
    ) -> list[Any]:
        return read_rows(con, self.kind, self.files, picks, columns, where)

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
            rows = con.execute(overview_sql("idx")).fetchall()
            out = [StepRow(*r) for r in rows]
            self._cache["overview"] = out
            return list(out)

    def splits(self) -> list[str]:
        """The archive's splits, train first."""
        return split_order([r.split for r in self.overview()])

    def neighbours(self, split: str, step: int) -> tuple[int | None, int | None]:
        """The steps of `split` just before and just after `step` (None at either end)."""
        steps = [r.step for r in self.overview() if r.split == split]
        return max((s for s in steps if s < step), default=None), min(
            (s for s in steps if s > step), default=None
        )

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
                    count(*) FILTER (WHERE stop_reason IN {_TRUNCATED_SQL}), min(id), avg(advantage)
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

    def with_tools(self, split: str, step: int) -> set[str]:
        """The groups of a step where some completion called a tool or got a tool's result (as
        `_turns.uses_tools` reads its messages). Reads the messages of the step's records whose
        text names a tool at all: asked only when a page filters by it."""
        with self._query() as con:
            found = con.execute(
                "SELECT id, src, rn, grp FROM idx WHERE split = $split AND step = $step AND grp IS NOT NULL",
                {"split": split, "step": step},
            ).fetchall()
            rows = self._rows(
                con,
                [(r[0], r[1], r[2]) for r in found],
                "messages",
                "contains(messages, '\"tool') OR contains(messages, '\"function_call\"')",
            )
        group_of = {r[0]: r[3] for r in found}
        return {group_of[r[0]] for r in rows if uses_tools(_messages(r[1]))}

    def names(self, name: str) -> tuple[bool, list[str], list[tuple[str, int]]]:
        """What `name` is the id of: a record (whether), a prompt (the splits it occurs in, train
        first), groups (each split and step where one has that id)."""
        with self._query() as con:
            record = con.execute(
                f"SELECT count(*) FROM idx WHERE {self.located(con, [name])} AND id = $n", {"n": name}
            ).fetchone()
            prompts = con.execute(
                f"SELECT DISTINCT split FROM {self.prompt_relation([name])} WHERE prompt = $n", {"n": name}
            ).fetchall()
            groups = con.execute(
                "SELECT DISTINCT split, step FROM idx WHERE grp = $n ORDER BY split, step", {"n": name}
            ).fetchall()
        order = {s: i for i, s in enumerate(split_order([g[0] for g in groups]))}
        return (
            bool(record and record[0]),
            split_order([r[0] for r in prompts]),
            sorted(((s, int(n)) for s, n in groups), key=lambda g: (order[g[0]], g[1])),
        )

    def prompts_of(
        self, ids: Sequence[str], *, split: str | None = None, step: int | None = None
    ) -> dict[str, str]:
        """The prompt text of each of these records (found in the index first, then read). With
        `split` and `step`, those of that step only: a sidecar's ids are then read in that step's
        row groups only, where otherwise every id of the archive is (a second at 10M records)."""
        if not ids:
            return {}
        at, params = "true", dict[str, Any]({"ids": list(ids)})
        if split is not None and step is not None:
            at, params = "split = $split AND step = $step", {**params, "split": split, "step": step}
        with self._query() as con:
            found = con.execute(
                f"SELECT id, src, rn FROM idx WHERE {self.located(con, ids)} AND {at} "
                "AND id IN (SELECT unnest($ids))",
                params,
            ).fetchall()
            rows = self._rows(con, found, "messages")
        return {r[0]: split_messages(_messages(r[1]))[0] for r in rows}

    def _completions(
        self,
        where: str,
        params: dict[str, Any],
        order: str,
        *,
        metadata: bool = False,
        shown: Callable[[list[Any]], set[str]] | None = None,
        texts_read: dict[str, str] | None = None,
        ids: Sequence[str] | None = None,
        table: str = "idx",
        prompts: Sequence[str] | None = None,
    ) -> list[Completion]:
        """The index rows matching `where`, with the texts (and with `metadata`, the metadata) of
        those `shown` picks, every one by default; the others have `loaded` False. `texts_read`
        gives the messages, by id, where the caller has read them. `ids`: the rows are some of
        these records' (found by their places first, see `located`). `table`: the relation of
        index rows to query, `idx` by default; `prompts`: the rows are some of these prompt
        ids' (read by prompt, only in their files where known: `prompt_relation`)."""
        self._await_tokens()
        with self._query() as con:
            if prompts is not None:
                table = self.prompt_relation(prompts)
            if ids is not None:
                where = f"{self.located(con, ids)} AND ({where})"
            index = con.execute(
                "SELECT id, step, split, grp, prompt, reward, advantage, policy_version, stop_reason, "
                f"rlen, tok, src, rn FROM {table} WHERE {where} ORDER BY {order}",
                params,
            ).fetchall()
            if not index:
                return []
            wanted = shown(index) if shown is not None else {r[0] for r in index}
            if texts_read is not None:  # read already (a search by text): not read again
                texts = {i: (i, texts_read[i], None) for i in wanted if i in texts_read}
            else:
                picks = [(r[0], r[11], r[12]) for r in index if r[0] in wanted]
                columns = "messages, " + ("metadata" if metadata else "NULL")
                texts = {r[0]: r for r in self._rows(con, picks, columns)}
        out = []
        # A row whose texts were not read has no messages: its texts are those of none, made once
        # (a prompt's history has thousands such rows: 20 ms a page at 10M records).
        unread = split_messages([])
        for r in index:
            _, raw_messages, raw_metadata = texts.get(r[0], (r[0], None, None))
            messages = _messages(raw_messages)
            prompt, text = split_messages(messages) if messages else unread
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
                    metadata=_metadata(raw_metadata),
                    loaded=r[0] in texts,
                    prompt_turns=prompt_length(messages),
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
        found = self._completions("id = $id", {"id": record_id}, "id", metadata=True, ids=[record_id])
        return found[0] if found else None

    def prompt_history(self, prompt: str, split: str) -> tuple[list[Completion], list[str]]:
        """Every completion of one prompt id in `split` (by policy version, then step, best reward
        first), and the splits the prompt occurs in. Texts are read for what the page shows only
        (`_highlights`): a prompt's completions lie in every file of the run, and each text read
        costs a block of its file."""
        every = self._completions(
            "prompt = $prompt",
            {"prompt": prompt},
            "policy_version DESC NULLS LAST, step DESC, reward DESC NULLS LAST, id",
            shown=lambda rows: _highlights([r for r in rows if r[2] == split]),
            prompts=[prompt],
        )
        return [c for c in every if c.split == split], sorted({c.split for c in every})

    def frequent_prompts(self, limit: int = 10) -> list[tuple[str, int, int]]:
        """The prompt ids seen at the most steps: (prompt, steps, samples)."""
        with self._query() as con:
            if "frequent" not in self._cache:
                self._cache["frequent"] = con.execute(frequent_sql("idx")).fetchall()
            return list(self._cache["frequent"][:limit])

    def prompt_counts(self, prompts: Sequence[str]) -> dict[str, tuple[int, int]]:
        """(steps, samples) of each of these prompt ids that the archive holds."""
        with self._query() as con:
            rows = con.execute(
                f"SELECT prompt, count(DISTINCT step), count(*) FROM {self.prompt_relation(prompts)} "
                "WHERE prompt IN (SELECT unnest($p)) GROUP BY prompt",
                {"p": list(prompts)},
            ).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows}
