"""``asynctrace recover``: deliver what a spool holds to Trackio, outside any trainer.

Each (project, run) with unacknowledged records is replayed by a `TraceSession` opened on the
spool (so retries, acknowledgements, dead letters and accounting are exactly a session's),
optionally into another project or run. Replayed records carry their original ids, and the
Trackio sink skips those already stored, so running recover twice, or after a session that
replayed part of the spool, writes nothing twice.
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
from ._durable.spool import Spool
from ._security import logger
from ._session import recovery_session
from ._stats import SessionStats
from .exceptions import SpoolError

__all__ = ["GroupResult", "RecoverReport", "recover"]


@dataclass(slots=True)
class GroupResult:
    """What recovering one (project, run) of the spool did."""

    source: tuple[str, str]
    target: tuple[str, str]
    found: int
    stats: SessionStats

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

    @property
    def ok(self) -> bool:
        # Dead letters left untouched (no --dead-letters) are undelivered records too, and so
        # are records on corrupt lines: reporting them in the summary alone would let a script
        # that checks the exit status take a loss for a complete recovery.
        delivered = all(g.stats.failed == 0 and g.stats.pending == 0 for g in self.groups)
        return delivered and not self.left and not self.dead_letters_left and not self.damaged

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
                    f", {g.duplicates} already in Trackio and skipped (the batch in flight when the "
                    "writer was stopped)"
                )
            if st.failed:
                line += f", {st.failed} failed (kept as dead letters)"
            if st.pending:
                line += f", {st.pending} undelivered (kept in the spool)"
            out.append(line)
            if st.failed or st.pending:
                # The reason: the session's own warnings are quieted while recover runs (below).
                for name, sink in st.sinks.items():
                    if sink.last_error and (sink.failed or st.pending):
                        out.append(f"    {name} failed: {sink.last_error}")
        for name, problem in self.problems:
            out.append(f"  skipped: {name}: {problem}")
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
    """Replay every unacknowledged record of the spool in `directory` into Trackio.

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
    groups = dict(scan.groups(seg.SEGMENT))
    if dead_letters:
        for key, n in scan.groups(seg.DEAD).items():
            groups[key] = groups.get(key, 0) + n
    for source, found in sorted(groups.items()):
        target = (project or source[0], run or source[1])
        report.groups.append(await _replay_group(path, source, target, found, dead_letters, progress, stream))
    report.seconds = time.perf_counter() - started
    final = await anyio.to_thread.run_sync(seg.scan_dir, path)
    report.dead_letters_left = final.pending(seg.DEAD)
    report.left = final.pending(seg.SEGMENT)
    return report


async def _replay_group(
    path: Path,
    source: tuple[str, str],
    target: tuple[str, str],
    found: int,
    dead_letters: bool,
    progress: bool,
    stream: TextIO | None,
) -> GroupResult:
    session = recovery_session(path, target, source, dead_letters=dead_letters)
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
    return GroupResult(source, target, found, session.stats())


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
