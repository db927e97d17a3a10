"""Replay: deliver what a previous session left unacknowledged in a spool, ahead of new records."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio

from .._records.types import TraceRecord
from .._security import logger
from . import segments
from .spool import Spool

__all__ = ["ReplayPlan", "replay_backlog"]


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """Whose records to replay: the session's own (project, run), or another's for `recover`,
    which also retries dead letters and reports other runs itself (`quiet`)."""

    source: tuple[str, str]
    dead_letters: bool = False
    quiet: bool = False


async def replay_backlog(
    spool: Spool,
    scan: segments.DirScan,
    plan: ReplayPlan,
    replay: bool,
    admit: Callable[[Sequence[TraceRecord]], Awaitable[None]],
) -> None:
    """Report what `scan` found, then `admit` the records `plan` selects (only warn with
    ``replay=False``)."""
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
        return wanted and (f.project, f.run) == source

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
