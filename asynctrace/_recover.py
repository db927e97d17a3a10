"""``asynctrace recover``: deliver what a spool holds to the sinks its run had, outside any trainer.

Each (project, run) with unacknowledged records is replayed by a `TraceSession` opened on the
spool (so retries, acknowledgements, dead letters and accounting are exactly a session's),
optionally into another project or run. Its sinks are made again from the setup the killed
session left in the spool (`_durable/setup.py`): every sink it had, each `Selected` tier with its
own selection; a spool without one (or written before) goes to Trackio. Replayed records carry
their original ids, and the sinks skip those already stored, so running recover twice, or after
a session that replayed part of the spool, writes nothing twice. Parquet journals the killed
sinks left are turned into files.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import anyio

from ._durable import segments as seg
from ._durable.setup import Setup, read_setups, remove_setup
from ._durable.spool import Spool
from ._security import logger
from ._session import recovery_session
from ._stats import SessionStats
from .exceptions import SpoolError
from .sinks._base import Sink
from .sinks._parquet import DamagedJournal, ParquetSink
from .sinks._selected import Selected
from .sinks._spec import rebuild_sinks

__all__ = ["GroupResult", "RecoverReport", "recover"]


@dataclass(slots=True)
class GroupResult:
    """What recovering one (project, run) of the spool did."""

    source: tuple[str, str]
    target: tuple[str, str]
    found: int
    stats: SessionStats
    sinks: list[str] = field(default_factory=list)  # the names of the sinks replayed into

    @property
    def duplicates(self) -> int:
        return self.stats.spool.duplicates_skipped if self.stats.spool is not None else 0


@dataclass(slots=True)
class RecoverReport:
    """The outcome of one `recover` call."""

    directory: Path
    groups: list[GroupResult] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)
    damaged: int = 0  # spool files that lost data (see FileScan.damaged): their records are gone
    dead_letters_left: int = 0
    left: int = 0  # unacknowledged records still in the spool afterwards
    seconds: float = 0.0
    finalized: int = 0  # rows of killed Parquet sinks' journals turned into files
    # Those journals' damaged lines (their records lost) and journals left as they were
    damaged_journals: list[DamagedJournal] = field(default_factory=list)
    unmade: list[tuple[str, str]] = field(default_factory=list)  # (sink, why) not made again

    @property
    def ok(self) -> bool:
        # Dead letters left untouched (no --dead-letters) are undelivered records too, and so
        # are records on corrupt lines: reporting them in the summary alone would let a script
        # that checks the exit status take a loss for a complete recovery.
        # Sinks that cannot be made outside the trainer (`unmade`) are told in the summary; the
        # status is about the records reaching the sinks that recover could make.
        delivered = all(g.stats.failed == 0 and g.stats.pending == 0 for g in self.groups)
        lost = self.damaged or self.damaged_journals
        return delivered and not self.left and not self.dead_letters_left and not lost

    @property
    def replayed(self) -> int:
        return sum(g.stats.replayed for g in self.groups)

    def lines(self) -> list[str]:
        """The human-readable summary."""
        out = [f"asynctrace recover {self.directory}"]
        if not self.groups:
            out.append("  nothing to replay")
        for g in self.groups:
            st = g.stats
            src = "/".join(g.source)
            dst = "/".join(g.target)
            where = src if src == dst else f"{src} -> {dst}"
            line = f"  {where}: {st.replayed} replayed, {st.written - g.duplicates} written"
            if g.duplicates:
                line += (
                    f", {g.duplicates} already stored and skipped (the batch in flight when the "
                    "writer was stopped)"
                )
            if st.failed:
                line += f", {st.failed} failed (kept as dead letters)"
            if st.pending:
                line += f", {st.pending} undelivered (kept in the spool)"
            out.append(line + (f" (sinks: {', '.join(g.sinks)})" if g.sinks else ""))
            if st.failed or st.pending:
                # The reason: the session's own warnings are quieted while recover runs (below).
                for name, sink in st.sinks.items():
                    if sink.last_error and (sink.failed or st.pending):
                        out.append(f"    {name} failed: {sink.last_error}")
        for name, problem in self.problems:
            out.append(f"  skipped: {name}: {problem}")
        for name, why in self.unmade:
            out.append(f"  sink {name!r} cannot be made outside the trainer, so it gets nothing: {why}")
        if self.finalized:
            out.append(f"  {self.finalized} rows of killed Parquet sinks' journals written as Parquet files")
        for journal in self.damaged_journals:
            if journal.error is not None:
                out.append(f"  skipped: {journal.path}: {journal.error} (the journal is left as it is)")
                continue
            lines = f"{journal.lines} damaged journal lines skipped (their records are lost)"
            if journal.lines == 1:
                lines = "1 damaged journal line skipped (its record is lost)"
            out.append(f"  {journal.path}: {lines}")
        if self.dead_letters_left:
            out.append(f"  {self.dead_letters_left} dead letters remain (retry them with --dead-letters)")
        if self.seconds > 0 and self.replayed:
            out.append(
                f"  {self.replayed} records in {self.seconds:.2f}s ({self.replayed / self.seconds:,.0f}/s)"
            )
        return out


def _tidy(directory: Path) -> seg.DirScan:
    """Open and close the spool once: quarantines unreadable files, deletes acknowledged ones."""
    spool = Spool(directory, project="-", run="-", session="recover", durability="writer")
    scan = spool.open()
    spool.close()
    return scan


async def recover(
    directory: str | os.PathLike[str],
    *,
    project: str | None = None,
    run: str | None = None,
    dead_letters: bool = False,
    progress: bool = True,
    stream: TextIO | None = None,
) -> RecoverReport:
    """Replay every unacknowledged record of the spool in `directory` into the sinks its runs had.

    `project` / `run` send them to another project or run than the one they were logged to;
    `dead_letters` also retries records whose sink had failed for good.
    """
    path = Path(directory)
    if not path.is_dir():
        raise SpoolError(f"no spool directory at {path}")
    report = RecoverReport(path)
    started = time.perf_counter()
    scan = await anyio.to_thread.run_sync(_tidy, path)
    report.problems = scan.problems
    report.damaged = sum(1 for f in scan.files if f.damaged)
    setups, unreadable = await anyio.to_thread.run_sync(read_setups, path)
    report.problems += unreadable
    for source, sessions, setup, found in _partitions(scan, setups, dead_letters):
        target = (project or source[0], run or source[1])
        sinks: list[Sink] | None = None  # a spool without its setup: Trackio, as before
        if setup is not None:
            made, unmade = rebuild_sinks(setup.sinks)
            report.unmade += [u for u in unmade if u not in report.unmade]
            # None of them can be made (a test's in-memory sink): Trackio, as without a setup.
            sinks = made or None
        report.groups.append(
            await _replay_group(path, source, target, found, dead_letters, progress, stream, sinks, sessions)
        )
    report.seconds = time.perf_counter() - started
    final = await anyio.to_thread.run_sync(seg.scan_dir, path)
    report.dead_letters_left = final.pending(seg.DEAD)
    report.left = final.pending(seg.SEGMENT)
    await anyio.to_thread.run_sync(_finish_setups, path, setups, final, report)
    return report


def _partitions(
    scan: seg.DirScan, setups: dict[str, Setup], dead_letters: bool
) -> list[tuple[tuple[str, str], frozenset[str] | None, Setup | None, int]]:
    """(source, sessions, setup, records): the records of each (project, run) split by the sinks
    their sessions had, so each part is replayed into its own sinks."""
    kinds = (seg.SEGMENT, seg.DEAD) if dead_letters else (seg.SEGMENT,)
    # Sessions without a setup (older spools) form one part of their run: Trackio, as before.
    parts: dict[tuple[tuple[str, str], bytes | None], tuple[set[str], Setup | None, list[int]]] = {}
    for f in scan.files:
        if f.kind not in kinds or not f.usable or not f.unresolved:
            continue
        assert f.project is not None and f.run is not None
        setup = setups.get(f.session or "")
        key = ((f.project, f.run), setup.key if setup is not None else None)
        sessions, _, count = parts.setdefault(key, (set(), setup, [0]))
        sessions.add(f.session or "")
        count[0] += len(f.unresolved)
    ordered = sorted(parts.items(), key=lambda p: (p[0][0], p[0][1] or b""))
    return [(key[0], frozenset(sessions), setup, count[0]) for key, (sessions, setup, count) in ordered]


def _finish_setups(
    directory: Path, setups: dict[str, Setup], final: seg.DirScan, report: RecoverReport
) -> None:
    """Turn the journals of the Parquet sinks each killed session had into files (their rows and
    damaged lines go to `report`), and remove the setups of sessions nothing is left of (a
    journal left as it was is something)."""
    left = {f.session for f in final.files if f.usable and f.unresolved}
    done: set[str] = set()
    for setup in setups.values():
        kept = False
        for sink in rebuild_sinks(setup.sinks)[0]:
            inner = sink.sink if isinstance(sink, Selected) else sink
            if isinstance(inner, ParquetSink) and str(inner.directory) not in done:
                done.add(str(inner.directory))
                report.finalized += inner.finalize_journals()
                report.damaged_journals += inner.damaged_journals
                kept = kept or any(j.error is not None for j in inner.damaged_journals)
        if setup.session not in left and not kept:
            remove_setup(directory, setup.session)


async def _replay_group(
    path: Path,
    source: tuple[str, str],
    target: tuple[str, str],
    found: int,
    dead_letters: bool,
    progress: bool,
    stream: TextIO | None,
    sinks: list[Sink] | None,
    sessions: frozenset[str] | None,
) -> GroupResult:
    session = recovery_session(
        path, target, source, dead_letters=dead_letters, sinks=sinks, sessions=sessions
    )
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=found, unit="rec", desc="/".join(source), file=stream, leave=True)
    done = anyio.Event()

    async def poll() -> None:
        while not done.is_set():
            if bar is not None:
                st = session.stats()
                bar.update(st.written + st.failed - bar.n)
            with anyio.move_on_after(0.2):
                await done.wait()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(poll)
            try:
                async with session:
                    await session.flush()
            finally:
                done.set()
    finally:
        if bar is not None:
            st = session.stats()
            bar.update(st.written + st.failed - bar.n)
            bar.close()
    return GroupResult(source, target, found, session.stats(), list(session.sink_names))


def main(
    directory: str | os.PathLike[str],
    *,
    project: str | None = None,
    run: str | None = None,
    dead_letters: bool = False,
    progress: bool = True,
) -> int:
    """The command: prints the summary; 0 when everything was delivered, 1 when some was not
    (corrupt spool lines included), 2 when the spool cannot be used."""
    import click

    # The summary reports every skipped file and failure, so the session's own warnings
    # would only repeat it; errors still show.
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        report = anyio.run(
            lambda: recover(directory, project=project, run=run, dead_letters=dead_letters, progress=progress)
        )
    except (SpoolError, ValueError) as exc:
        click.echo(f"asynctrace recover: {exc}", err=True)
        return 2
    finally:
        logger.setLevel(level)
    for line in report.lines():
        click.echo(line)
    return 0 if report.ok else 1
