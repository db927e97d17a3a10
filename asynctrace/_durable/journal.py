"""What the engine tells the spool, and what the spool gives back at start.

`Journal` is the spool's one way into the engine: what the buffer, the ledger, the writer and the
callers tell it of records as they are admitted, dispatched and resolved. `replay_backlog`
delivers what a previous session left unacknowledged, ahead of new records, by a `ReplayPlan`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel

from .._records.types import TraceRecord
from .._security import logger
from . import segments

if TYPE_CHECKING:
    from .directory import SpoolDir
    from .spool import Spool

__all__ = ["Journal", "ReplayPlan", "replay_backlog"]

# Records encoded for the spool per event-loop turn (see `Journal.dispatching`).
SLICE = 32


class Journal:
    """Durability "enqueue" (`on_admit`) stages records as they are admitted and has callers
    commit them before returning; "writer" stages each batch as the writer takes it. Either
    way the spool is told of every record resolved or dropped."""

    __slots__ = ("on_admit", "spool")

    def __init__(self, spool: Spool, *, on_admit: bool) -> None:
        self.spool = spool
        self.on_admit = on_admit

    def admitted(self, records: Sequence[TraceRecord]) -> None:
        """Records entered the buffer or a held selection (only called with `on_admit`)."""
        self.spool.stage(records)

    def caller_done(self, *, blocking: bool) -> None:
        """A caller is about to return: with `on_admit`, what it staged is written first."""
        if self.on_admit and (blocking or self.spool.has_staged):
            # Blocking, even with nothing staged: another thread's commit may have taken this
            # caller's records and still be writing them; taking the commit lock waits for it.
            # Not blocking: that commit, or the writer's next one, writes these records first.
            self.spool.commit(blocking=blocking)

    async def dispatching(self, records: Sequence[TraceRecord]) -> None:
        """The writer took a batch of `records`: they are on disk before any sink sees them."""
        spool = self.spool
        if not self.on_admit:
            # Encoding a large batch takes milliseconds of Python: done in slices, so the
            # callers sharing this event loop get turns in between.
            for i in range(0, len(records), SLICE):
                spool.stage(records[i : i + SLICE], encode=True)
                await anyio.lowlevel.checkpoint()
        if spool.has_staged:
            spool.commit()

    def acknowledge(self) -> None:
        """Sinks finished with records: their resolutions are written, unless a commit is under
        way (a later one writes them; acknowledgements are not urgent)."""
        self.spool.commit(blocking=False)

    def dropped(self, records: Sequence[TraceRecord]) -> None:
        # A spooled record dropped since is done with; a replayed one stays for the next replay.
        done = [r for r in records if r.spool_slot is not None and not r.replayed]
        if done:
            self.spool.resolve(done)

    def sink_done(self, records: Sequence[TraceRecord], sink: str) -> None:
        """One sink dealt with records (wrote them, or its selection decided them) that not every
        sink has yet: a replay sends them only to the others."""
        mine = [r for r in records if r.spool_slot is not None]
        if mine:
            self.spool.sink_done(mine, sink)

    def tier(self, sink: str, written: Mapping[tuple[str, int], int], closed: Mapping[str, int]) -> None:
        """A `Selected` sink wrote `written` more records of these (split, step)s and has closed
        its steps up to `closed` per split: a replay's selection counts them (at most k a step)."""
        self.spool.tier(sink, written, closed)

    def resolved(
        self, ok: Sequence[TraceRecord], bad: Sequence[TraceRecord], errors: list[tuple[str, str]]
    ) -> None:
        if ok:
            self.spool.resolve(ok)
        if bad:
            error_text = "; ".join(f"{name}: {e}" for name, e in errors)
            self.spool.resolve(bad, error_text, [name for name, _ in errors])


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """Whose records to replay: the session's own (project, run), or another's for `recover`,
    which also retries dead letters and reports other runs itself (`quiet`)."""

    source: tuple[str, str]
    dead_letters: bool = False
    quiet: bool = False
    # Only the records these sessions spooled (recover replays each set of sinks on its own).
    sessions: frozenset[str] | None = None
    # The directory's lock, held by recover across all its sessions (see SpoolDir).
    held: SpoolDir | None = None


async def replay_backlog(
    spool: Spool,
    scan: segments.DirScan,
    plan: ReplayPlan,
    replay: bool,
    admit: Callable[[Sequence[TraceRecord]], Awaitable[None]],
    prime: Callable[[segments.TierState], None] | None = None,
) -> None:
    """Report what `scan` found, then `admit` the records `plan` selects (only warn with
    ``replay=False``); before them, `prime` is told what the `Selected` sinks had done."""
    for name, problem in scan.problems:
        logger.warning("asynctrace: spool file %s: %s", spool.directory / name, problem)
    source = plan.source
    others = {g: n for g, n in scan.groups().items() if g != source}
    if others and not plan.quiet:
        listed = ", ".join(f"{p}/{r} ({n})" for (p, r), n in sorted(others.items()))
        logger.warning(
            "asynctrace: the spool in %s holds unacknowledged records of other runs: %s; "
            "this session replays only its own; deliver them with `asynctrace recover %s`",
            spool.directory,
            listed,
            spool.directory,
        )
    if not replay:
        mine = scan.groups().get(source, 0)
        if mine:
            logger.warning(
                "asynctrace: replay=False leaves %d unacknowledged records in the spool in %s",
                mine,
                spool.directory,
            )
        return

    def selects(f: segments.FileScan) -> bool:
        wanted = f.kind == segments.SEGMENT or (plan.dead_letters and f.kind == segments.DEAD)
        mine = plan.sessions is None or f.session in plan.sessions
        return wanted and mine and (f.project, f.run) == source

    state = scan.tiers(source, plan.sessions)
    if state:
        if prime is not None:
            prime(state)
        # Carried on: this session's segments hold these totals too, should it be killed as well.
        for sink in set(state.written) | set(state.closed):
            spool.tier(sink, state.written.get(sink, {}), state.closed.get(sink, {}), absolute=True)
    backlog = spool.backlog(scan, selects)
    total = 0
    while True:
        records = await anyio.to_thread.run_sync(next, backlog, None)
        if records is None:
            break
        total += len(records)
        await admit(records)
    if total:
        logger.info("asynctrace: replaying %d unacknowledged records from %s", total, spool.directory)
