"""Where the viewer's index rows are: the sinks' sidecars queried where they lie (`_sidecar`), and a
table for the files without them; views `idx` and `pidx` over both, and what happens when a
sidecar's pages turn out unreadable.

`_index` builds on it: it decides which file is read how.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import duckdb

from . import _prompt_index
from ._sidecar import Sidecars, by_prompt_sidecars
from ._sql import listed, quoted
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
        # Files whose by-prompt sidecar was checked (`prompt_view`): until then, and where it
        # fails, view `pidx` reads their index rows in row order.
        self._by_prompt_checked: set[int] = set()
        # Each prompt id's files (a bit a src) among the first `_located` files, where the
        # sidecars' summaries said (`locate_prompts`): a question by prompt reads only those.
        self._holders: dict[str, int] | None = None
        self._located = 0
        # The archive-wide by-prompt index (`_prompt_index`) where valid, with its files' numbers
        # in the index now (table `prompt_src`); checked at the first question by prompt.
        self.prompt_index: _prompt_index.PromptIndex | None = None
        self._prompt_srcs: set[int] = set()
        self._prompt_index_checked = False
        self._prompt_index_verified = False
        self._con.execute(
            "CREATE TABLE idx_rows (id VARCHAR, step BIGINT, split VARCHAR, grp VARCHAR, prompt VARCHAR, "
            "reward DOUBLE, advantage DOUBLE, policy_version BIGINT, stop_reason VARCHAR, rlen BIGINT, "
            "tok BOOLEAN, rn BIGINT, src INTEGER)"
        )
        self._con.execute("CREATE TABLE sidecar_src (filename VARCHAR, src INTEGER)")
        self._con.execute("CREATE TABLE prompt_src (f INTEGER, src INTEGER)")
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
                path = quoted(found.by_row)
                parts.append(
                    f"SELECT {SIDECAR_ROW}, {int(src)} AS src FROM read_parquet({path}) "
                    f"WHERE rn IN ({listed})"
                )
        return "(" + (" UNION ALL ".join(parts) or "SELECT * FROM idx_rows WHERE false") + ")"

    def add_sidecars(self, held: dict[int, Sidecars]) -> None:
        """Query these files' sidecars (src -> them) where they lie (the caller holds the lock)."""
        self.sidecars.update(held)
        self._sources([p for found in held.values() for p in dict.fromkeys(found)], held)
        self._views()

    def _sources(self, paths: list[str], held: dict[int, Sidecars]) -> None:
        """Name the file of each of these sidecar paths, one statement for all (a row each costs
        a millisecond: 0.2 s for 100 files)."""
        src_of = {p: src for src, found in held.items() for p in found}
        self._con.execute(
            "INSERT INTO sidecar_src SELECT unnest($paths), unnest($srcs)",
            {"paths": paths, "srcs": [src_of[p] for p in paths]},
        )

    def prompt_view(self, skip: set[int] | None = None) -> str:
        """View `pidx`, once the by-prompt sidecar of every file held (but those in `skip`) is
        checked: one that passes is queried by prompt from then on, and read whole if a query
        fails (`repair`) as any other (the caller holds the lock). Checked at the first question
        by prompt, not at the first open: the overview waits for no footer it does not read."""
        pending = [
            src for src in self.sidecars if src not in self._by_prompt_checked and src not in (skip or ())
        ]
        if not pending:
            return "pidx"
        self._by_prompt_checked.update(pending)
        found = by_prompt_sidecars(self._con, [self.files[src] for src in pending])
        swapped = {
            src: self.sidecars[src]._replace(by_prompt=found[self.files[src]])
            for src in pending
            if self.files[src] in found
        }
        if swapped:
            self.sidecars.update(swapped)
            self._sources([s.by_prompt for s in swapped.values()], swapped)
            self._views()
            self._unverified += list(swapped)
        return "pidx"

    def locate_prompts(self, holders: dict[str, int]) -> None:
        """Take where each prompt id is (bit i: file i of the index now; the caller holds the lock)."""
        self._holders, self._located = holders, len(self.files)

    def take_prompt_index(self) -> None:
        """Check the archive's by-prompt index (`_prompt_index`) and take it where it covers
        only files held through their sidecars, each of the size and rows it lists: a file gone,
        changed or read itself makes it stale, and it is ignored (the caller holds the lock)."""
        self._prompt_index_checked = True
        self.prompt_index, self._prompt_srcs = None, set()
        self._con.execute("DELETE FROM prompt_src")
        if not self.path.is_dir():
            return
        found = _prompt_index.read(self._con, self.path)
        if found is None or not found.covered:
            return
        src_of = {os.path.basename(self.files[src]): src for src in self.sidecars}
        srcs = [src_of.get(c.name) for c in found.covered]
        if any(src is None for src in srcs):
            return
        files = [self.files[src] for src in srcs if src is not None]
        try:
            rows = dict(
                self._con.execute(
                    "SELECT file_name, num_rows FROM parquet_file_metadata($f)", {"f": files}
                ).fetchall()
            )
            sizes = [os.stat(f).st_size for f in files]
        except (duckdb.Error, OSError):
            return
        for c, f, size in zip(found.covered, files, sizes, strict=True):
            if c.size != size or rows.get(f) != c.rows:
                return
        self._con.execute(
            "INSERT INTO prompt_src SELECT unnest($f), unnest($s)",
            {"f": list(range(len(srcs))), "s": srcs},
        )
        self.prompt_index, self._prompt_srcs = found, {s for s in srcs if s is not None}
        self._prompt_index_verified = False

    def prompt_relation(self, prompts: Sequence[str]) -> str:
        """The index rows a question about these prompt ids needs: the archive's by-prompt index
        (`_prompt_index`) for the files it covers, and for the others view `pidx` (see
        `prompt_view`), or where their files are known, only those files' by-prompt sidecars
        (with every file read, and every file that came since; the caller holds the lock)."""
        if not self._prompt_index_checked:
            self.take_prompt_index()
        covered = self._prompt_srcs
        view = self.prompt_view(skip=covered)
        if self._holders is None and self.prompt_index is None:
            return view
        bits = -1
        if self._holders is not None:
            bits = 0
            for prompt in prompts:
                bits |= self._holders.get(prompt, 0)
        paths = [
            found.by_prompt
            for src, found in sorted(self.sidecars.items())
            if src not in covered and (src >= self._located or bits >> src & 1)
        ]
        select = "SELECT * FROM idx_rows"
        if paths:
            select += _sidecar_rows(paths)
        if self.prompt_index is not None:
            # The prompt ids in the scan itself: DuckDB then skips every row group but theirs.
            wanted = ", ".join(map(quoted, prompts)) or "NULL"
            path = quoted(self.prompt_index.path)
            select += (
                f" UNION ALL SELECT {INDEX_ROW} FROM read_parquet({path}) JOIN prompt_src USING (f) "
                f"WHERE prompt IN ({wanted})"
            )
        return f"({select})"

    def _views(self) -> None:
        """(Re)make view `idx`, every record's index row, and `pidx`, the same rows where a
        query by prompt is cheaper (the sidecars ordered by prompt): table `idx_rows` and the
        sidecars where they lie (the caller holds the lock, or no one else has the connection)."""
        for view, order in (("idx", "by_row"), ("pidx", "by_prompt")):
            paths = [getattr(s, order) for s in self.sidecars.values()]
            select = "SELECT * FROM idx_rows"
            if paths:
                select += _sidecar_rows(paths)
            self._con.execute(f"CREATE OR REPLACE VIEW {view} AS {select}")

    def _verify(self, con: duckdb.DuckDBPyConnection, srcs: list[int]) -> None:
        """Read every value of these files' index sidecars (their footers were checked, not their
        pages): a file whose sidecar cannot be read whole is read itself instead (the caller holds
        the lock)."""
        damaged = []
        for src in dict.fromkeys(srcs):  # a file is listed again once its by-prompt one is checked
            found = self.sidecars.get(src)
            if found is None:
                continue
            for path in dict.fromkeys(found):
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
        return self._verify_prompt_index() or bool(pending)

    def _verify_prompt_index(self) -> bool:
        """Read every value of the archive's by-prompt index once (after a failed query): where it
        cannot be, it is no longer read, and the files' own by-prompt sidecars are. Whether it
        was read whole now (the caller holds the lock)."""
        if self.prompt_index is None or self._prompt_index_verified:
            return False
        self._prompt_index_verified = True
        try:
            self._con.execute(
                f"SELECT max(hash({SIDECAR_ROW}, f)) FROM read_parquet(?)", [self.prompt_index.path]
            ).fetchall()
        except duckdb.Error:
            if self.closing.is_set():
                return False
            self.prompt_index, self._prompt_srcs = None, set()
            self._con.execute("DELETE FROM prompt_src")
            _prompt_index.discard(self.path)
        return True


def _sidecar_rows(paths: Sequence[str]) -> str:
    """The index rows of these sidecars, as a query's `UNION ALL` part (each row's file numbered
    through table `sidecar_src`)."""
    return (
        f" UNION ALL SELECT {INDEX_ROW} FROM read_parquet({listed(paths)}, filename = true) "
        "JOIN sidecar_src USING (filename)"
    )
