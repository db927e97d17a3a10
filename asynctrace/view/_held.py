"""Where the viewer's index rows are: the sinks' sidecars queried where they lie (`_sidecar`), and a
table for the files without them; views `idx` and `pidx` over both, and what happens when a
sidecar's pages turn out unreadable.

`_index` builds on it: it decides which file is read how.
"""

from __future__ import annotations

import os

import duckdb

from ._sidecar import Sidecars
from ._words import TextIndex

__all__ = ["INDEX_ROW", "SIDECAR_ROW", "HeldIndex", "SidecarsRepaired"]

# The index's columns, in order (table `idx_rows`, and so every view over it).
INDEX_ROW = "id, step, split, grp, prompt, reward, advantage, policy_version, stop_reason, rlen, tok, rn, src"
# A sidecar's (without the file's number), every one read when a sidecar is read whole.
SIDECAR_ROW = "id, step, split, grp, prompt, reward, advantage, policy_version, stop_reason, rlen, tok, rn"


class SidecarsRepaired(duckdb.Error):
    """A query failed over sidecars not read whole yet; they have been read whole since, the
    file of any damaged one is read itself, and the same question asked again is answered."""


class HeldIndex(TextIndex):
    """A `TextIndex` with the index's rows: table `idx_rows` (files read, or their kept index)
    and the sidecars of the others, and views `idx` (every row) and `pidx` (the same rows, read
    by prompt where the sidecars are ordered so)."""

    def __init__(
        self, source: str | os.PathLike[str], *, cache: str | os.PathLike[str] | None = None
    ) -> None:
        super().__init__(source, cache=cache)
        # Files whose index is their sink's sidecars (`_sidecar`), queried where they lie: src ->
        # those sidecars. The rows of the others are copied into table `idx_rows`.
        self.sidecars: dict[int, Sidecars] = {}
        # Sidecars checked (`index_sidecars`) before the index is built, by file (`Archive`).
        self.checked_sidecars: dict[str, Sidecars] = {}
        # Files whose sidecars are queried before they were read whole (`repair`).
        self._unverified: list[int] = []
        self._con.execute(
            "CREATE TABLE idx_rows (id VARCHAR, step BIGINT, split VARCHAR, grp VARCHAR, prompt VARCHAR, "
            "reward DOUBLE, advantage DOUBLE, policy_version BIGINT, stop_reason VARCHAR, rlen BIGINT, "
            "tok BOOLEAN, rn BIGINT, src INTEGER)"
        )
        self._con.execute("CREATE TABLE sidecar_src (filename VARCHAR, src INTEGER)")
        self._views()

    def at_places(self, places: dict[int, set[int]]) -> str:
        """A relation of the index rows at these places (src -> row numbers), each file asked for
        its own rows: a sidecar's statistics then skip to them, where view `idx` would look in
        every file for every row number (the caller holds the lock)."""
        parts = []
        for src, rows in sorted(places.items()):
            listed = ", ".join(str(int(r)) for r in sorted(rows))
            found = self.sidecars.get(src)
            if found is None:
                parts.append(f"SELECT * FROM idx_rows WHERE src = {int(src)} AND rn IN ({listed})")
            else:
                path = "'" + found.by_row.replace("'", "''") + "'"
                parts.append(
                    f"SELECT {SIDECAR_ROW}, {int(src)} AS src FROM read_parquet({path}) "
                    f"WHERE rn IN ({listed})"
                )
        return "(" + (" UNION ALL ".join(parts) or "SELECT * FROM idx_rows WHERE false") + ")"

    def _views(self) -> None:
        """(Re)make view `idx`, every record's index row, and `pidx`, the same rows where a
        query by prompt is cheaper (the sidecars ordered by prompt): table `idx_rows` and the
        sidecars where they lie (the caller holds the lock, or no one else has the connection)."""
        for view, order in (("idx", "by_row"), ("pidx", "by_prompt")):
            paths = [getattr(s, order) for s in self.sidecars.values()]
            select = "SELECT * FROM idx_rows"
            if paths:
                listed = "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"
                select += (
                    f" UNION ALL SELECT {INDEX_ROW} FROM read_parquet({listed}, filename = true) "
                    "JOIN sidecar_src USING (filename)"
                )
            self._con.execute(f"CREATE OR REPLACE VIEW {view} AS {select}")

    def _verify(self, con: duckdb.DuckDBPyConnection, srcs: list[int]) -> None:
        """Read every value of these files' index sidecars (their footers were checked, not their
        pages): a file whose sidecar cannot be read whole is read itself instead (the caller holds
        the lock)."""
        damaged = []
        for src in srcs:
            found = self.sidecars.get(src)
            if found is None:
                continue
            for path in (found.by_row, found.by_prompt):
                if self.closing.is_set():
                    return
                try:
                    con.execute(f"SELECT max(hash({SIDECAR_ROW})) FROM read_parquet(?)", [path]).fetchall()
                except duckdb.Error:
                    if self.closing.is_set():
                        return  # interrupted at exit: says nothing of the sidecar
                    damaged.append(src)
                    break
        if damaged:
            self._read_instead(damaged)

    def _read_instead(self, srcs: list[int]) -> None:
        """Stop querying these files' sidecars; read the files themselves (`Index` says how)."""
        raise NotImplementedError

    def repair(self) -> bool:
        """Read whole the sidecars not read whole yet (see `build`); a file whose sidecar cannot
        be is read itself instead (the caller holds the lock). Whether there were any."""
        if self.closing.is_set():
            return False
        pending, self._unverified = self._unverified, []
        self._verify(self._con, pending)
        return bool(pending)
