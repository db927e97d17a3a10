"""``asynctrace recover``: deliver what a spool holds to the sinks its runs had, outside any trainer.

Each (project, run) with unacknowledged records is replayed by a `TraceSession` opened on the
spool (so retries, acknowledgements, dead letters and accounting are exactly a session's),
optionally into another project or run. Its sinks are made again from the setup the killed
session left in the spool (`_durable/setup.py`): every sink it had, each `Selected` tier with its
own selection; a spool without one (or written before) goes to Trackio. A setup is data: its
sinks are made from the registry of the kinds asynctrace ships (`sinks/_kinds.py`), the user's
own only from factories passed in code, and a session whose setup names a sink recover will not
make keeps its records in the spool. Replayed records carry their original ids, and the sinks
skip those already stored, so running recover twice, or after a session that replayed part of
the spool, writes nothing twice. Parquet journals the killed sinks left are turned into files.

Recover holds the directory's lock from start to end, its sessions sharing it, so a second
recover or a trainer started meanwhile is refused (`SpoolError`, exit status 2) rather than
taking the directory between two of its sessions.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO, TypeGuard

import anyio

from ._durable import segments as seg
from ._durable.directory import SpoolDir
from ._durable.setup import Setup, SetupFiles, read_setups, remove_setup
from ._durable.spool import Spool
from ._security import describe, logger, shown
from ._session import recovery_session
from ._stats import SessionStats
from .exceptions import SpoolError
from .sinks._base import Sink
from .sinks._kinds import KINDS
from .sinks._parquet import DamagedJournal, ParquetSink
from .sinks._selected import Selected
from .sinks._spec import Maker, SinkNote, rebuild_kind, rebuild_sinks

if sys.version_info < (3, 11):  # pragma: no cover - anyio brings the backport there
    from exceptiongroup import BaseExceptionGroup
if TYPE_CHECKING:
    from .ray._sinkspec import SinkSpec

__all__ = ["GroupResult", "RecoverReport", "SinkFactories", "recover"]

SinkFactories = Mapping[str, "Callable[..., Sink] | SinkSpec | None"]
"""`recover(sinks=...)`: by the name a setup gives a sink, what makes it (see `recover`)."""


@dataclass(slots=True)
class GroupResult:
    """What recovering one (project, run) of the spool did."""

    source: tuple[str, str]
    target: tuple[str, str]
    found: int
    stats: SessionStats
    sinks: list[str] = field(default_factory=list)  # the names of the sinks replayed into
    where: list[SinkNote] = field(default_factory=list)  # where each of them writes

    @property
    def duplicates(self) -> int:
        return self.stats.spool.duplicates_skipped if self.stats.spool is not None else 0


class HeldBack(NamedTuple):
    """Records of a (project, run) not replayed, because of what their session's setup says."""

    source: tuple[str, str]
    records: int
    why: str


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
    unmade: list[SinkNote] = field(default_factory=list)  # not made, by design: they get nothing
    held: list[HeldBack] = field(default_factory=list)  # not replayed: their records stay
    notes: list[SinkNote] = field(default_factory=list)  # about sinks made (credentials withheld)
    # What else keeps the recovery from being whole: an unreadable setup, an archive's journals
    # that could not be turned into files; (what, why).
    unfinished: list[tuple[str, str]] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)  # factories passed for sinks no setup names
    error: str | None = None  # why recover stopped before the end (the command line's)
    # Archives' journals with damaged lines (their records lost) and journals left as they were.
    damaged_journals: list[DamagedJournal] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        # Dead letters left untouched (no --dead-letters) are undelivered records too, and so
        # are records on corrupt lines: reporting them in the summary alone would let a script
        # that checks the exit status take a loss for a complete recovery.
        # Sinks that cannot be made outside the trainer (`unmade`) are told in the summary; the
        # status is about the records reaching the sinks that recover could make.
        delivered = all(g.stats.failed == 0 and g.stats.pending == 0 for g in self.groups)
        whole = not self.held and not self.unfinished and self.error is None
        lost = self.damaged or self.damaged_journals
        return delivered and whole and not self.left and not self.dead_letters_left and not lost

    @property
    def replayed(self) -> int:
        return sum(g.stats.replayed for g in self.groups)

    def lines(self) -> list[str]:
        """The human-readable summary."""
        out = [f"asynctrace recover {self.directory}"]
        if not self.groups and not self.held and self.error is None:
            out.append("  nothing to replay")
        for g in self.groups:
            out += _group_lines(g)
        for h in self.held:
            where = "/".join(h.source)
            out.append(f"  {where}: {h.records} records not replayed, kept in the spool: {h.why}")
        for name, problem in self.problems:
            out.append(f"  skipped: {name}: {problem}")
        for what, why in self.unfinished:
            out.append(f"  {what}: {why}")
        for name, text in self.notes:
            out.append(f"  sink {shown(name)}: {text}")
        for name, why in self.unmade:
            out.append(f"  sink {shown(name)} cannot be made outside the trainer, so it gets nothing: {why}")
        if self.unused:
            out.append(f"  sinks passed that no setup names: {', '.join(shown(n) for n in self.unused)}")
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
        if self.error is not None:
            out.append(f"  stopped: {self.error}")
        return out


def _group_lines(g: GroupResult) -> list[str]:
    st = g.stats
    src = "/".join(g.source)
    dst = "/".join(g.target)
    where = src if src == dst else f"{src} -> {dst}"
    line = f"  {where}: {st.replayed} replayed, {st.written - g.duplicates} written"
    if g.duplicates:
        line += (
            f", {g.duplicates} already stored and skipped (the batch in flight when the writer was stopped)"
        )
    if st.failed:
        line += f", {st.failed} failed (kept as dead letters)"
    if st.pending:
        line += f", {st.pending} undelivered (kept in the spool)"
    out = [line + (f" (sinks: {', '.join(g.sinks)})" if g.sinks else "")]
    if g.where:
        out.append("    writes to: " + "; ".join(f"{name}: {where}" for name, where in g.where))
    if st.failed or st.pending:
        # The reason: the session's own warnings are quieted while recover runs (below).
        for name, sink in st.sinks.items():
            if sink.last_error and (sink.failed or st.pending):
                out.append(f"    {name} failed: {sink.last_error}")
    return out


def _tidy(directory: Path, held: SpoolDir) -> seg.DirScan:
    """Open and close the spool once: quarantines unreadable files, deletes acknowledged ones."""
    spool = Spool(directory, project="-", run="-", session="recover", durability="writer", within=held)
    scan = spool.open()
    spool.close()
    return scan


async def recover(
    directory: str | os.PathLike[str],
    *,
    project: str | None = None,
    run: str | None = None,
    dead_letters: bool = False,
    sinks: SinkFactories | None = None,
    progress: bool = True,
    stream: TextIO | None = None,
) -> RecoverReport:
    """Replay every unacknowledged record of the spool in `directory` into the sinks its runs had.

    `project` / `run` send them to another project or run than the one they were logged to;
    `dead_letters` also retries records whose sink had failed for good. `sinks` makes sinks by
    the name the setup gives them: your own sink's class (or any callable), called with the
    keyword arguments the setup holds for it (its `recovery_args()`); an
    `asynctrace.ray.SinkSpec`, built as given; or None, to leave that sink out. Raises
    `SpoolError` when the spool cannot be used (missing, unreadable, in use).
    """
    report = RecoverReport(Path(directory))
    await _recover_into(report, project, run, dead_letters, _makers(sinks), progress, stream)
    return report


def _makers(sinks: SinkFactories | None) -> dict[str, Maker | None]:
    """`recover`'s `sinks`, checked, as the makers `rebuild_sinks` calls."""
    if sinks is None:
        return {}
    if not isinstance(sinks, Mapping):
        raise TypeError(f"sinks must map sink names to factories, got {type(sinks).__name__}")
    out: dict[str, Maker | None] = {}
    for name, factory in sinks.items():
        if not isinstance(name, str):
            raise TypeError(f"sinks: a sink's name must be a str, got {shown(name)}")
        if factory is None:
            out[name] = None
        elif _is_sink_spec(factory):
            out[name] = _built(factory)
        elif callable(factory) and not isinstance(factory, Sink):
            out[name] = _called(factory)
        else:
            raise TypeError(
                f"sinks[{name!r}]: pass what makes the sink (its class, a callable or a SinkSpec), "
                f"not a {type(factory).__name__}: recover may make it once for each session it replays"
            )
    return out


def _is_sink_spec(value: object) -> TypeGuard[SinkSpec]:
    # Looked up, not imported: importing asynctrace.ray imports Ray, and a SinkSpec passed in
    # has its module loaded already.
    module = sys.modules.get("asynctrace.ray._sinkspec")
    return module is not None and isinstance(value, module.SinkSpec)


def _built(spec: SinkSpec) -> Maker:
    """A maker building `spec` as given (the setup's arguments unused)."""

    def make(_args: Mapping[str, Any]) -> Sink:
        return spec.build()

    return make


def _called(factory: Callable[..., Sink]) -> Maker:
    """A maker calling `factory` with the setup's arguments."""

    def make(args: Mapping[str, Any]) -> Sink:
        return factory(**args)

    return make


async def _recover_into(
    report: RecoverReport,
    project: str | None,
    run: str | None,
    dead_letters: bool,
    makers: dict[str, Maker | None],
    progress: bool,
    stream: TextIO | None,
) -> None:
    """`recover`, filling `report` as it goes (so the command line can print what was done
    before an error)."""
    path = report.directory
    if not path.is_dir():
        raise SpoolError(f"no spool directory at {path}")
    held = SpoolDir(path)
    held.lock()
    try:
        started = time.perf_counter()
        scan = await anyio.to_thread.run_sync(_tidy, path, held)
        report.problems = scan.problems
        report.damaged = sum(1 for f in scan.files if f.damaged)
        found = await anyio.to_thread.run_sync(read_setups, path)
        named = {name for setup in found.setups.values() for name in _names(setup)}
        unread = dict(found.unreadable)  # those whose session has no records left go below
        for part in _partitions(scan, found, dead_letters):
            target = (project or part.source[0], run or part.source[1])
            sinks: list[Sink] | None = None  # a spool without its setup: Trackio, as before
            where = [SinkNote("trackio", KINDS["trackio"].where({}))]
            if part.unreadable is not None:
                report.held.append(HeldBack(part.source, part.records, part.unreadable))
                for session in part.sessions:
                    unread.pop(session, None)
                continue
            if part.setup is not None:
                made = rebuild_sinks(part.setup.sinks, makers)
                report.unmade += [u for u in made.unmade if u not in report.unmade]
                report.notes += [n for n in made.notes if n not in report.notes]
                if made.refused:
                    why = "; ".join(f"sink {shown(name)}: {text}" for name, text in made.refused)
                    report.held.append(HeldBack(part.source, part.records, why))
                    continue
                # None of them can be made (a test's in-memory sink): Trackio, as without a setup.
                sinks = made.sinks or None
                where = made.where if sinks is not None else where
            result = await _replay_group(
                path,
                part.source,
                target,
                part.records,
                dead_letters,
                progress,
                stream,
                sinks,
                part.sessions,
                held,
            )
            result.where = where
            report.groups.append(result)
            # Its Parquet sinks turned the killed sinks' journals into files at open: what they
            # could not take whole is told, as what the journals' last pass finds is.
            _note_damage(report, sinks or [])
        report.unused = sorted(set(makers) - named)
        # Nothing of its session to replay, but what else its sinks needed (a Parquet journal
        # turned into a file) is unknown: the file stays, and the recovery is not whole.
        report.unfinished += [(problem, "left in place") for problem in unread.values()]
        report.seconds = time.perf_counter() - started
        final = await anyio.to_thread.run_sync(seg.scan_dir, path)
        report.dead_letters_left = final.pending(seg.DEAD)
        report.left = final.pending(seg.SEGMENT)
        await anyio.to_thread.run_sync(_finish_setups, path, found.setups, final, report)
    finally:
        held.unlock()


def _names(setup: Setup) -> Iterator[str]:
    for spec in setup.sinks:
        if isinstance(spec, dict) and isinstance(spec.get("name"), str):
            yield spec["name"]


class _Part(NamedTuple):
    """The records of one (project, run) that one set of sinks gets."""

    source: tuple[str, str]
    sessions: frozenset[str]
    setup: Setup | None
    records: int
    unreadable: str | None  # the problem of the sessions' setup file, when it cannot be read


def _partitions(scan: seg.DirScan, found: SetupFiles, dead_letters: bool) -> list[_Part]:
    """The records of each (project, run) split by the sinks their sessions had, so each part is
    replayed into its own sinks (or, when a session's setup is unreadable, kept)."""
    kinds = (seg.SEGMENT, seg.DEAD) if dead_letters else (seg.SEGMENT,)
    # Sessions without a setup (older spools) form one part of their run: Trackio, as before.
    parts: dict[
        tuple[tuple[str, str], bytes | None], tuple[set[str], Setup | None, list[int], str | None]
    ] = {}
    for f in scan.files:
        if f.kind not in kinds or not f.usable or not f.unresolved:
            continue
        assert f.project is not None and f.run is not None
        session = f.session or ""
        setup = found.setups.get(session)
        unreadable = found.unreadable.get(session)
        kind = setup.key if setup is not None else (session.encode() if unreadable is not None else None)
        sessions, _, count, _ = parts.setdefault(((f.project, f.run), kind), (set(), setup, [0], unreadable))
        sessions.add(session)
        count[0] += len(f.unresolved)
    ordered = sorted(parts.items(), key=lambda p: (p[0][0], p[0][1] or b""))
    return [
        _Part(key[0], frozenset(sessions), setup, count[0], unreadable)
        for key, (sessions, setup, count, unreadable) in ordered
    ]


def _finish_setups(
    directory: Path, setups: dict[str, Setup], final: seg.DirScan, report: RecoverReport
) -> None:
    """Turn the journals of the Parquet sinks each killed session had into files (their rows and
    damaged lines go to `report`), and remove the setups of sessions nothing is left of. An
    archive whose journals cannot all be turned into files goes to `report.unfinished` (or its
    `damaged_journals`), and keeps its setup, so that a later recover tries again."""
    left = {f.session for f in final.files if f.usable and f.unresolved}
    done: dict[str, bool] = {}  # archive directory -> its journals are files now
    for setup in setups.values():
        whole = True
        # Only its Parquet sinks are made: W&B's, MLflow's or Trackio's would be made for nothing.
        for inner in _parquet_sinks(rebuild_kind(setup.sinks, "parquet").sinks):
            if str(inner.directory) not in done:
                done[str(inner.directory)] = True
                try:
                    report.finalized += inner.finalize_journals()
                except Exception as exc:  # a journal it cannot read must not end the recovery
                    done[str(inner.directory)] = False
                    report.unfinished.append(
                        (str(inner.directory), f"its journals were not turned into files: {describe(exc)}")
                    )
                _note_damage(report, [inner])
                if any(j.error is not None for j in inner.damaged_journals):
                    done[str(inner.directory)] = False
            whole = whole and done[str(inner.directory)]
        if setup.session not in left and whole:
            remove_setup(directory, setup.session)


def _parquet_sinks(sinks: list[Sink]) -> Iterator[ParquetSink]:
    """The `ParquetSink`s among `sinks`, tiers' included."""
    for sink in sinks:
        inner = sink.sink if isinstance(sink, Selected) else sink
        if isinstance(inner, ParquetSink):
            yield inner


def _note_damage(report: RecoverReport, sinks: list[Sink]) -> None:
    """Add the journals the Parquet sinks among `sinks` could not take whole (once each)."""
    for sink in _parquet_sinks(sinks):
        report.damaged_journals += [j for j in sink.damaged_journals if j not in report.damaged_journals]


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
    held: SpoolDir,
) -> GroupResult:
    session = recovery_session(
        path, target, source, dead_letters=dead_letters, sinks=sinks, sessions=sessions, held=held
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
    except BaseExceptionGroup as group:
        # The task group wraps what the session raised: recover's callers (and its exit
        # status) see the error itself, a SpoolError first.
        raise _unwrapped(group) from None
    finally:
        if bar is not None:
            st = session.stats()
            bar.update(st.written + st.failed - bar.n)
            bar.close()
    return GroupResult(source, target, found, session.stats(), list(session.sink_names))


def _unwrapped(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error a task group's `group` stands for: its SpoolError if it holds one, else its
    only exception, else the group itself."""
    leaves: list[BaseException] = []
    todo: list[BaseException] = [group]
    while todo:
        exc = todo.pop()
        if isinstance(exc, BaseExceptionGroup):
            todo.extend(reversed(exc.exceptions))
        else:
            leaves.append(exc)
    spool = [e for e in leaves if isinstance(e, SpoolError)]
    if spool:
        return spool[0]
    return leaves[0] if len(leaves) == 1 else group


def main(
    directory: str | os.PathLike[str],
    *,
    project: str | None = None,
    run: str | None = None,
    dead_letters: bool = False,
    progress: bool = True,
) -> int:
    """The command: prints the summary, always; returns 0 when everything was delivered, 1 when
    some was not (corrupt spool lines, records a setup kept back, an error part-way included),
    2 when the spool cannot be used (missing, unreadable, in use)."""
    import click

    report = RecoverReport(Path(directory))
    status: int | None = None
    # The summary reports every skipped file and failure, so the session's own warnings
    # would only repeat it; errors still show.
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        anyio.run(_recover_into, report, project, run, dead_letters, {}, progress, None)
    except SpoolError as exc:
        report.error, status = str(exc), 2
    except Exception as exc:  # whatever it was, the summary says what was done before it
        report.error, status = f"recover stopped: {describe(exc)}", 1
    finally:
        logger.setLevel(level)
    for line in report.lines():
        click.echo(line)
    if report.error is not None:
        click.echo(f"asynctrace recover: {report.error}", err=True)
    return status if status is not None else 0 if report.ok else 1
