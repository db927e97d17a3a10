"""The spool's books: its files and what they hold, and the lines a commit adds to resolve records.

Acknowledgement and sink lines make a file depend on the files whose records they resolve; tier
lines keep each `Selected` sink's running totals (see `Spool.tier`). From these, `Books.collect`
decides which files may go: see the spool's module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .._records.types import TraceRecord
from .._security import describe, logger
from . import segments as seg

__all__ = ["TIER_STEPS", "Books", "SpoolFile"]

# Steps a tier's written counts are kept for, per split (as a gate counts steps: COUNTER_WINDOW).
TIER_STEPS = 4096


@dataclass(slots=True)
class SpoolFile:
    """One file of the spool directory, as the spool keeps track of it."""

    index: int
    name: str
    path: Path
    kind: seg.FileKind
    size: int = 0
    live: int = 0  # records it holds that are not resolved yet
    deps: set[int] = field(default_factory=set)  # files its acknowledgements refer to
    session: str | None = None
    tiers: bool = False  # holds tier lines
    fd: int | None = None
    deleted: bool = False
    keep: bool = False  # unreadable header: never deleted by the spool


class Books:
    """A spool's file table and its tiers' running totals; the spool does the writing."""

    def __init__(self) -> None:
        self.files: dict[int, SpoolFile] = {}
        # Running totals of this session's tiers (see `Spool.tier`): written per (split, step), closed prefix.
        self._tier_written: dict[str, dict[tuple[str, int], int]] = {}
        self._tier_closed: dict[str, dict[str, int]] = {}

    def ack_lines(self, done: list[TraceRecord], active: SpoolFile | None) -> tuple[bytes, set[int]]:
        """Acknowledgement lines for `done`, and the files they refer to besides `active`."""
        ids: list[str] = []
        by_dead: dict[int, list[str]] = {}
        deps: set[int] = set()
        for r in done:
            where = r.spool_slot
            if where is None or where < 0:
                continue
            f = self.files.get(where)
            if f is None:
                continue
            if f.kind == seg.DEAD:
                by_dead.setdefault(where, []).append(r.id)
            else:
                ids.append(r.id)
            if active is None or where != active.index:
                deps.add(where)
        out = [seg.ack_line(ids)] if ids else []
        out += [seg.ack_line(v, self.files[k].name) for k, v in by_dead.items()]
        return b"".join(out), deps

    def sink_lines(
        self,
        partial: dict[str, list[TraceRecord]],
        done: list[TraceRecord],
        active: SpoolFile | None,
        deps: set[int],
    ) -> bytes:
        """Sink lines for what each sink dealt with, less what every sink is done with (an
        acknowledgement in this same commit says more)."""
        resolved = {id(r) for r in done}
        out = []
        for sink, records in partial.items():
            ids = []
            for r in records:
                where = r.spool_slot
                if where is None or where < 0 or id(r) in resolved:
                    continue
                f = self.files.get(where)
                if f is None or f.kind != seg.SEGMENT:
                    continue
                ids.append(r.id)
                if active is None or where != active.index:
                    deps.add(where)
            if ids:
                out.append(seg.sink_ack_line(ids, sink))
        return b"".join(out)

    def tier_update(
        self,
        sink: str,
        written: dict[tuple[str, int], int],
        closed: dict[str, int],
        absolute: bool,
        changed: tuple[set[tuple[str, int]], set[str]],
    ) -> None:
        """Add a tier's progress to its running totals, noting in `changed` what moved."""
        totals = self._tier_written.setdefault(sink, {})
        upto = self._tier_closed.setdefault(sink, {})
        for key, n in written.items():
            totals[key] = max(totals.get(key, 0), n) if absolute else totals.get(key, 0) + n
            changed[0].add(key)
        for split, last in closed.items():
            if upto.get(split, -1) < last:
                upto[split] = last
                changed[1].add(split)
        # A closed step's count is no longer needed: its later records are late anyway.
        for key in [k for k in totals if k[1] <= upto.get(k[0], -1)]:
            del totals[key]
            changed[0].discard(key)
        if len(totals) > TIER_STEPS:
            for split in {k[0] for k in totals}:
                steps = sorted(k[1] for k in totals if k[0] == split)
                for step in steps[: max(0, len(steps) - TIER_STEPS)]:
                    del totals[(split, step)]
                    changed[0].discard((split, step))

    def tier_lines(self, changed: dict[str, tuple[set[tuple[str, int]], set[str]]] | None) -> bytes:
        """Tier lines with the running totals of what changed (None: everything)."""
        out = []
        for sink in sorted(set(self._tier_written) | set(self._tier_closed)):
            totals, upto = self._tier_written.get(sink, {}), self._tier_closed.get(sink, {})
            keys, splits = (set(totals), set(upto)) if changed is None else changed.get(sink, (set(), set()))
            if not keys and not splits:
                continue
            written = [(sp, st, totals[(sp, st)]) for sp, st in sorted(keys) if (sp, st) in totals]
            out.append(seg.tier_line(sink, written, [(sp, upto[sp]) for sp in sorted(splits)]))
        return b"".join(out)

    def collect(self) -> None:
        """Delete every file with nothing unresolved whose acknowledged files are already gone."""
        holders = self._holders()
        changed = True
        while changed:
            changed = False
            for f in self.files.values():
                if f.deleted or f.keep or f.live > 0 or f.fd is not None:
                    continue
                if any(not self.files[d].deleted for d in f.deps if d in self.files):
                    continue
                if f.index in holders and any(
                    g.live > 0 and not g.deleted and g.session == f.session for g in self.files.values()
                ):
                    continue
                try:
                    f.path.unlink()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    logger.warning("asynctrace: cannot delete spool file %s: %s", f.path, describe(exc))
                    continue
                f.deleted = True
                changed = True

    def _holders(self) -> set[int]:
        """Each session's newest file with tier lines."""
        newest: dict[str | None, SpoolFile] = {}
        for f in self.files.values():
            if f.tiers and not f.deleted and f.kind == seg.SEGMENT:
                have = newest.get(f.session)
                if have is None or f.name > have.name:
                    newest[f.session] = f
        return {f.index for f in newest.values()}
