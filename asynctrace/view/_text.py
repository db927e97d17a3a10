"""The viewer's text index: which words occur in which block of a file's rows.

A search by text (any case) is a regular expression over the messages of every record; this
index narrows it to the blocks of rows that can hold the text, so a search reads those only.

A *word* is a run of the characters in `_WORD_CHARS` (ASCII letters and digits, plus the two
non-ASCII letters that match an ASCII one in a case-insensitive expression: the long s and the
Kelvin sign), lowered, with the long s read as ``s``. Any other character separates words. A
text that matches the query holds, for each run of word characters in the query, a word that
contains it; one that starts (ends) where the run does when a separator comes before (after)
it in the query. Case-insensitive matching maps a word character only to word characters of the
same lowered form, and a separator only to separators, so the index never misses a match: it
only finds blocks, and the expression decides on each record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..sinks._parquet_sidecar import BLOCK as SIDECAR_BLOCK

__all__ = ["BLOCK", "Term", "candidates_sql", "terms", "words_sql"]

# Rows of a file per block: a block is the unit a search reads (the files' row groups hold about as
# many); the sink's sidecars are of blocks of as many rows.
BLOCK = SIDECAR_BLOCK
_WORD_CHARS = "0-9A-Za-z\u017f\u212a"
_WORD = re.compile(f"[{_WORD_CHARS}]+")


def _normal(sql: str) -> str:
    """A word's form in the index, as SQL."""
    return f"replace(lower({sql}), '\u017f', 's')"


def words_sql(relation: str) -> str:
    """The distinct (blk, w) pairs of `relation` (a file read with its ``file_row_number``).

    Messages are split at spaces first (cheap, and no word spans a space): the expression then
    runs over each block's distinct space-separated tokens only."""
    return f"""
        SELECT DISTINCT blk, {_normal("w")} AS w FROM (
            SELECT blk, unnest(regexp_extract_all(token, '[{_WORD_CHARS}]+')) AS w FROM (
                SELECT DISTINCT file_row_number // {BLOCK} AS blk,
                    unnest(string_split(messages, ' ')) AS token
                FROM {relation}))
        """


@dataclass(frozen=True, slots=True)
class Term:
    """One run of word characters of a query: the word holding it starts (`start`) or ends
    (`end`) where it does when a separator comes before or after it in the query."""

    word: str
    start: bool
    end: bool

    def condition(self, name: str) -> str:
        """SQL true for the index's words `w` that can hold this term (parameter `name`)."""
        if self.start and self.end:
            return f"w = ${name}"
        if self.start:
            return f"starts_with(w, ${name})"
        if self.end:
            return f"ends_with(w, ${name})"
        return f"contains(w, ${name})"


def terms(text: str) -> list[Term]:
    """The terms of a query; none when it has no word character (the index cannot narrow it)."""
    return [
        Term(m.group().lower().replace("\u017f", "s"), start=m.start() > 0, end=m.end() < len(text))
        for m in _WORD.finditer(text)
    ]


def candidates_sql(found: list[Term]) -> tuple[str, dict[str, Any]]:
    """SQL of the (src, blk) blocks of table `words` holding every term, and its parameters."""
    parts, params = [], {}
    for i, term in enumerate(found):
        parts.append(f"SELECT src, blk FROM words WHERE {term.condition(f't{i}')}")
        params[f"t{i}"] = term.word
    return " INTERSECT ".join(parts), params
