"""SQL string literals for the viewer's DuckDB queries: a path or a prompt id as a quoted value."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["listed", "quoted"]


def quoted(text: str) -> str:
    """`text` as one SQL string literal (its quotes doubled): never part of the query's syntax."""
    return "'" + text.replace("'", "''") + "'"


def listed(texts: Iterable[str]) -> str:
    """A DuckDB list literal of `texts`, each quoted."""
    return "[" + ", ".join(map(quoted, texts)) + "]"
