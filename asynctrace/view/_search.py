"""The viewer's search by text in Parquet files: read only the blocks the text index (`_text`)
says can hold the text, in the order of their first step, until the page is full.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import Any, NamedTuple

import duckdb

from ._text import BLOCK, candidates_sql, terms

__all__ = ["Hit", "find_text"]

# Rows a search by text reads in its first query, and at most in one (a whole file without a
# text index counts as a full query).
_SEARCH_FIRST_ROWS = 2 * BLOCK
_SEARCH_BATCH_ROWS = 32 * BLOCK


class Hit(NamedTuple):
    """A record a search by text found: its id, step and messages, and its place (the file's
    number in the archive, its row there), which saves the caller a look-up of the id."""

    id: str
    step: int
    messages: str
    src: int
    rn: int


def find_text(
    con: duckdb.DuckDBPyConnection,
    *,
    files: Sequence[str],
    skipped: Container[str],
    text_indexed: set[int],
    firsts: Mapping[tuple[int, int], int],
    text: str,
    pattern: str,
    where: str,
    params: dict[str, Any],
    limit: int,
) -> list[Hit]:
    """The first `limit` records, by step and id, matching `where` whose messages
    match `pattern` (the text, any case). Files with a text index are read only in the blocks
    that hold every term of the text, the others whole; blocks are read in the order of their
    first step, a batch at a time, until no block left can come before the hits found."""
    usable = [src for src, f in enumerate(files) if f not in skipped]
    found = terms(text)
    indexed = text_indexed.intersection(usable) if found else set()
    holding: set[tuple[int, int]] = set()
    if indexed:
        sql, terms_params = candidates_sql(found)
        holding = {(src, blk) for src, blk in con.execute(sql, terms_params).fetchall() if src in indexed}
    file_first: dict[int, int] = {}
    for (src, _), step in firsts.items():
        file_first[src] = min(step, file_first.get(src, step))
    # (first step, src, first block, last block): a block, or a whole file without a text index.
    parts = [(firsts.get(key, 0), key[0], key[1], key[1]) for key in holding]
    parts += [(file_first.get(src, 0), src, 0, -1) for src in usable if src not in indexed]
    parts.sort()
    hits: list[Hit] = []
    i, size = 0, _SEARCH_FIRST_ROWS
    while i < len(parts):
        if len(hits) >= limit and parts[i][0] > hits[limit - 1][1]:
            break  # every block left starts after the last hit kept
        # A text in most records fills the page from the first blocks; a rare one reads
        # batches twice as large each time.
        batch, rows = [], 0
        while i < len(parts) and rows < size:
            batch.append(parts[i])
            rows += BLOCK if parts[i][3] >= 0 else size
            i += 1
        size = min(2 * size, _SEARCH_BATCH_ROWS)
        hits.extend(_search(con, files, batch, pattern, where, params, limit))
        hits.sort(key=lambda h: (h[1], h[0]))
        del hits[limit:]
    return hits


def _search(
    con: duckdb.DuckDBPyConnection,
    files: Sequence[str],
    batch: list[tuple[int, int, int, int]],
    pattern: str,
    where: str,
    params: dict[str, Any],
    limit: int,
) -> list[Hit]:
    """The first `limit` matches in these blocks: one scan per run of
    neighbouring blocks, which DuckDB reads by row number."""
    runs: list[tuple[int, int, int]] = []  # (src, first row, last row), last -1: the whole file
    for _, src, first, last in sorted(batch, key=lambda p: (p[1], p[2])):
        if runs and runs[-1][0] == src and last >= 0 and runs[-1][2] == first * BLOCK - 1:
            runs[-1] = (src, runs[-1][1], (last + 1) * BLOCK - 1)
        else:
            runs.append((src, first * BLOCK, (last + 1) * BLOCK - 1 if last >= 0 else -1))
    selects: list[str] = []
    params_files: dict[str, str] = {}
    for k, (src, low, high) in enumerate(runs):
        params_files[f"f{k}"] = files[src]
        rows = f"file_row_number BETWEEN {low} AND {high} AND " if high >= 0 else ""
        selects.append(
            f"SELECT id, step, messages, {int(src)} AS src, file_row_number AS rn "
            f"FROM read_parquet($f{k}, file_row_number = true) "
            f"WHERE {rows}{where} AND regexp_matches(messages, $pattern)"
        )
    query = " UNION ALL ".join(selects) + f" ORDER BY step, id LIMIT {int(limit)}"
    return [Hit(*r) for r in con.execute(query, {"pattern": pattern, **params, **params_files}).fetchall()]
