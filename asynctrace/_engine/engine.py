"""The engine behind one session: the parts a sample goes through, built from the session's
settings, and the steps that start, flush and finish them.

`TraceSession` holds one `Engine` and forwards to it; nothing here calls back into the session.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Sequence

import anyio
import anyio.abc

from .._durable.journal import Journal, ReplayPlan, replay_backlog
from .._durable.segments import DirScan
from .._durable.spool import Spool
from .._records.groups import GroupKey
from .._runtime.lifecycle import Lifecycle
from .._security import logger
from .._select.gate import Gate
from .._select.watch import WatchCounter
from .._stats import SessionStats
from ..sinks._base import Sink
from ..sinks._selected import Selected
from ..sinks._spec import describe_sinks
from .buffer import Buffer, Room
from .encoder import Encoder
from .finish import after_drain, close_sinks, flush_until, report_finish
from .group_metrics import GroupMetrics
from .intake import Intake
from .settings import Settings
from .writer import Writer

__all__ = ["Engine", "selection_group_keys"]


class Engine:
    """Intake → buffer (gate, queue, ledger) → writer lanes → sinks, with the spool beside them.

    `plan` names whose records a spool's backlog replays (default: the session's own run).
    """

    def __init__(self, settings: Settings, life: Lifecycle, plan: ReplayPlan | None = None) -> None:
        s = self.settings = settings
        self.sinks: list[Sink] = s.sink_list
        # Described before binding: a sink's own arguments, not the session's run it binds to.
        setup = describe_sinks(self.sinks) if s.spool_dir is not None else None
        self.sink_names = _bind_sinks(self.sinks, s.project, s.run_name)
        sampler = s.sampler_in_use
        k = s.max_traces_per_step
        opened, idle = s.max_open_steps, s.step_timeout
        self.groups = (
            GroupMetrics(s.group_key, max_open_steps=opened, step_timeout=idle)
            if s.group_key is not None
            else None
        )
        gate = Gate(k, sampler, max_open_steps=opened, step_timeout=idle) if k is not None else None
        id_prefix = uuid.uuid4().hex[:12]
        self.spool = (
            Spool(
                s.spool_dir,
                project=s.project,
                run=s.run_name,
                session=id_prefix,
                durability=s.durability,
                setup=setup,
                within=plan.held if plan is not None else None,
            )
            if s.spool_dir is not None
            else None
        )
        self.buffer = Buffer(
            queue_size=s.queue_size,
            max_bytes=s.max_queue_bytes,
            on_full=s.on_full,
            batch_size=s.batch_size,
            gate=gate,
            sink_names=self.sink_names,
            clock=time.monotonic,
            journal=Journal(self.spool, on_admit=s.durability == "enqueue")
            if self.spool is not None
            else None,
            degraded=lambda: [sink.degraded for sink in self.sinks],
        )
        encoder = Encoder(
            trace_key=s.trace_key,
            redact=s.redact,
            skip_invalid=s.on_invalid == "skip",
            max_bytes=s.max_queue_bytes,
            score_needed_by=type(sampler).__name__ if gate is not None and sampler.needs_score else None,
            # With a cap, encode only what it would keep; a redact callable may change a
            # score, so then everything is encoded first.
            precheck=gate is not None and s.redact is None,
            keeps=self.buffer.keeps,
            id_prefix=id_prefix,
            group_key=getattr(sampler, "group_key", None),
            group_keys=selection_group_keys(sampler if gate is not None else None, self.sinks),
            counts_skipped=sampler.counts_skipped,
        )
        self.intake = Intake(
            self.buffer,
            encoder,
            life,
            batch_size=s.batch_size,
            wake_writer=self._wake_writer,
            watch=WatchCounter(s.watch) if s.watch is not None else None,
            groups=self.groups,
        )
        if s.watch is not None and k is None and not any(isinstance(sink, Selected) for sink in self.sinks):
            logger.warning(
                "asynctrace: watch= changes nothing in this session: it passes watched samples by "
                "max_traces_per_step and by Selected sinks' selections, and there are none"
            )
        self.life = life
        self.plan = plan or ReplayPlan((s.project, s.run_name))
        self.writer: Writer | None = None
        self._scan: DirScan | None = None

    def _wake_writer(self) -> None:
        if self.writer is not None:
            self.writer.wake()

    def locks(self) -> list[threading.Lock]:
        """The locks a signal handler must not wait for (see `Lifecycle.locks`)."""
        return [self.buffer.lock] + ([self.spool.io_lock] if self.spool is not None else [])

    def spooled(self) -> int | None:
        return None if self.spool is None else self.spool.unresolved()

    async def start(self) -> anyio.abc.TaskGroup:
        """Open the spool, start the writer in the session's task group, and return the group."""
        s, spool = self.settings, self.spool
        scan = await anyio.to_thread.run_sync(spool.open) if spool is not None else None
        try:
            self.writer = Writer(
                self.buffer,
                self.sinks,
                retry=s.retry_policy,
                flush_interval=s.flush_interval,
                step_timeout=self.buffer.gate.step_timeout if self.buffer.gate else None,
                on_room=self.buffer.room.notify,
                max_open_steps=s.max_open_steps,
                sink_step_timeout=s.step_timeout,
                health_interval=s.health_interval,
                groups=self.groups,
            )
            tg = await self.life.open(self.writer.run)
        except BaseException:
            if spool is not None:
                spool.close()
            raise
        self._scan = scan
        return tg

    async def replay(self) -> None:
        """Deliver what a killed session left in the spool, ahead of anything new."""
        if self.spool is not None and self._scan is not None:
            prime = self.writer.prime_tiers if self.writer is not None else None
            await replay_backlog(
                self.spool, self._scan, self.plan, self.settings.replay, self.intake.replay, prime
            )

    def after_fork(self) -> None:
        """In a forked child: the locks may have been held by a thread the child does not have."""
        self.buffer.lock = threading.Lock()
        self.buffer.room = Room()

    async def flush(self, deadline: float | None) -> bool:
        """Close every open step and wait until everything queued is resolved (False at `deadline`)."""
        if self.groups is not None:
            self.intake.push_items(self.groups.close_all())
        return await flush_until(self.buffer, self.writer, self.intake.wake, deadline)

    async def finish(self) -> tuple[SessionStats, bool]:
        """Drain by the lifecycle's deadline, stop the writer, spill to the spool and close every
        sink; returns the final stats and whether the drain completed."""
        life = self.life
        self.buffer.close()
        drained = False
        with anyio.CancelScope() as life.drain_scope:
            drained = await self.flush(life.deadline)
            if drained and self.writer is not None and self.writer.final_health():
                # The health once more, counting everything the drain delivered.
                await self.flush(life.deadline)
        life.drain_scope = None
        assert self.writer is not None
        left = await after_drain(life, self.writer, self.intake.waits.until_queued, self.spool, self.buffer)
        closed = await close_sinks(self.sinks, self.sink_names, left)
        if self.spool is not None and closed:
            # Otherwise `recover` still needs the sinks, to finish what a close left undone.
            self.spool.forget_setup()
        stats = self.stats()
        report_finish(stats, self.spool, drained, life.budget)
        return stats, drained

    def stats(self) -> SessionStats:
        """A consistent snapshot of the accounting (and of the spool, if there is one)."""
        snapshot = self.buffer.snapshot()
        spool = self.spool
        if spool is None:
            return snapshot
        duplicates = sum(int(getattr(sink, "duplicates_skipped", 0)) for sink in self.sinks)
        return dataclasses.replace(snapshot, spool=spool.stats(duplicates))


def selection_group_keys(sampler: object, sinks: Sequence[Sink]) -> list[GroupKey]:
    """The keys the session's group samplers (its cap's, its `Selected` tiers') read groups by: a
    sample none of them can name a group of is invalid (also where a front validates for it)."""
    samplers = [sampler]
    for sink in sinks:
        while isinstance(sink, Selected):  # a tier may wrap another
            samplers.append(sink.sampler)
            sink = sink.sink
    keys: list[GroupKey] = []
    for each in samplers:
        key = getattr(each, "group_key", None)
        if key is not None and key not in keys:
            keys.append(key)
    return keys


def _bind_sinks(sinks: Sequence[Sink], project: str, run: str) -> list[str]:
    """Bind every sink to the run; returns their names, numbered where two share one."""
    names: list[str] = []
    for sink in sinks:
        base = getattr(sink, "name", type(sink).__name__) or type(sink).__name__
        name, i = base, 2
        while name in names:
            name, i = f"{base}#{i}", i + 1
        names.append(name)
        sink.bind(project, run)
    return names
