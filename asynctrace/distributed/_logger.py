"""`DistributedTraceLogger`: one logger per rank, its modes and its per-rank stats.

The logger is a front (`_fronts/front.py`: checks, encoding, the rank's part of each step's
selection, its counts); what it adds is where a rank's ended steps go: to the writing rank
(`_reduction.py`, ``"global"``) or to the rank's own session (`_writing.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

import orjson

from .._checks import MAX_STEP, check_encoding, check_int, check_project_run, check_step, check_timeout
from .._engine.engine import selection_group_keys
from .._fronts.front import Front
from .._fronts.selection import Ended, PartSelection
from .._records.encode import as_list
from .._records.types import Sample, SampleLike
from .._runtime.finishing import FinishOnce
from .._runtime.lifecycle import close_grace
from .._security import generated_run_name, logger, shown
from .._select.base import Sampler
from .._select.groups import GroupSampler
from .._select.parts import merge_parts
from .._select.samplers import SamplerName, resolve_sampler
from .._select.watch import Watch, WatchCounter
from .._session import TraceSession
from .._stats import Counts, DropReason, SessionStats, SinkStats, SpoolStats
from .._sync import SyncTraceSession
from ..exceptions import SessionClosedError
from ._collective import Collective
from ._reduction import Reduction
from ._writing import GROUP_METRICS_SELECTED, Mode, RankSetup, open_writer

if TYPE_CHECKING:
    import torch

__all__ = ["DistributedTraceLogger", "Mode", "RankStats"]

_MODES: tuple[str, ...] = get_args(Mode)

_OPEN_STEPS_WARNING = 64


@dataclass(frozen=True, slots=True)
class RankStats(Counts):
    """One rank's accounting.

    On every rank, at every moment: ``submitted == handed_on + held + sum(dropped.values())``.
    `handed_on` samples went to the writing rank (``"global"``) or to this rank's own session.
    On the writing rank of ``"global"``:
    ``merged_received == merged_capped + merged_late + session.submitted`` once every reduction is
    written, and ``merged_received`` is the sum of every rank's `handed_on`. `merged_late` counts
    candidates for a step the writing rank had already written (a rank that had nothing of that
    step open when `flush` ended it logged some later).
    """

    rank: int
    world_size: int
    mode: str
    submitted: int = 0
    handed_on: int = 0
    held: int = 0
    dropped: Mapping[str, int] = field(default_factory=dict)
    reductions: int = 0
    bytes_sent: int = 0
    last_reduction_bytes: int = 0
    payload_bytes_sent: int = 0
    merged_received: int = 0
    merged_capped: int = 0
    merged_late: int = 0
    session: SessionStats | None = None

    PARTS: ClassVar[tuple[str, ...]] = ("handed_on", "held")


class DistributedTraceLogger:
    """Per-step trace sampling across the ranks of a torch.distributed job.

    Create it on every rank (creation is a collective: rank 0 chooses the run name) after
    ``torch.distributed.init_process_group``; without an initialised process group it behaves
    as a world of one. Call `log_samples` as samples are produced (local, no communication) and
    `end_step(step)` on every rank when a step is done; in ``"global"`` mode `end_step`, `flush`
    and `finish` are collectives and must be called by every rank of `group`, in the same order.

    The writing session is a `TraceSession` built from `project`, `run` and `session_kwargs`
    (any `TraceSession` keyword), or by ``session_factory(rank, run_name)``. In ``"global"`` and
    ``"per_rank"`` modes selection happens here, so the session gets no cap of its own, and the
    `watch` list too: a watched sample passes this rank's selection and the merge, within the
    step's ``max_per_step`` counted once over every rank (rank order, then arrival), and reaches
    the session marked watched, past every `Selected` sink's selection. In
    ``"per_rank_stream"`` mode `watch` is the session's own.
    """

    def __init__(
        self,
        project: str,
        run: str | None = None,
        *,
        mode: Mode = "global",
        max_traces_per_step: int | None = None,
        sampler: SamplerName | Sampler = "first",
        group: Any = None,
        dst: int | None = None,
        trackio_group: str | None = None,
        session_factory: Callable[[int, str], TraceSession] | None = None,
        on_invalid: Literal["raise", "skip"] = "raise",
        redact: Callable[[Sample], Sample] | None = None,
        device: torch.device | str | None = None,
        watch: Watch | None = None,
        **session_kwargs: Any,
    ) -> None:
        _check_arguments(locals())
        self.mode: Mode = mode
        self.project = project
        self.max_traces_per_step = max_traces_per_step
        self.sampler = resolve_sampler(sampler)
        self.on_invalid = on_invalid
        self.redact = redact
        self.watch = watch
        self.group = group
        self._ranks = ranks = Collective(group, dst, device)
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.dst, self.device = ranks.dst, ranks.device
        self.run = self._agree_on_run(run)
        self.run_name = f"{self.run}-rank{self.rank}" if mode != "global" else self.run
        self.trackio_group = (
            trackio_group if trackio_group is not None else (self.run if mode != "global" else None)
        )
        self.writes = mode != "global" or self.rank == ranks.dst_group_rank

        setup = RankSetup(
            mode=mode,
            project=project,
            run_name=self.run_name,
            rank=self.rank,
            trackio_group=self.trackio_group,
            max_traces_per_step=max_traces_per_step,
            sampler=self.sampler,
            on_invalid=on_invalid,
            redact=redact,
            watch=watch,
        )
        self._writer = open_writer(setup, ranks, self.writes, session_factory, session_kwargs)
        session = self._writer.session if self._writer is not None else None
        # What the rank validates for the writing session: a group every group sampler there
        # reads (the logger's, and its Selected tiers') can name. A rank that does not write
        # knows the tiers from the same sinks= (not those a session_factory builds on dst).
        sinks = session.sinks if session is not None else session_kwargs.get("sinks")
        selects = mode != "per_rank_stream"
        self._k = k = max_traces_per_step or 1
        # This rank's part of each step ("per_rank_stream" offers it nothing). The watch list,
        # where selection happens here: the rank passes the first max_per_step watched samples
        # of a step by its selection; the writing rank's counter takes the step's places over
        # every rank's (see `grant_watched`).
        self._front = Front(
            PartSelection(k, self.sampler, self.rank, watch=watch if selects else None),
            sampler=self.sampler,
            redact=redact,
            on_invalid=on_invalid,
            group_keys=selection_group_keys(self.sampler, sinks if isinstance(sinks, (list, tuple)) else ()),
            owner="logger",
            quiet=("capped", "closed"),
        )
        granted = WatchCounter(watch) if watch is not None and mode == "global" else None
        self._reduction = Reduction(ranks, k, self.sampler, granted, self._write)
        self._warned_open = False
        self._finish: FinishOnce[RankStats] = FinishOnce()
        self._finish_timeout = session.finish_timeout if session is not None else None

    def _agree_on_run(self, run: str | None) -> str:
        """Rank 0's run name, on every rank, so every rank writes to (or names its run after) the
        same run. A group sampler that drew its own seed (seed=None) takes rank 0's in the same
        broadcast, so every rank keys random groups alike, as one process would."""
        sampler = self.sampler
        own = sampler.run_seed if isinstance(sampler, GroupSampler) and sampler.seed is None else ""
        agreed, _, seed = self._ranks.agree(f"{run or generated_run_name()}\x00{own}").partition("\x00")
        if seed and own and isinstance(sampler, GroupSampler):
            sampler.run_seed = seed
        return agreed

    def __repr__(self) -> str:
        return (
            f"DistributedTraceLogger(mode={self.mode!r}, rank={self.rank}/{self.world_size}, "
            f"run={self.run_name!r})"
        )

    @property
    def session(self) -> SyncTraceSession | None:
        """This rank's writing session (for `log_metrics`, say); None on ranks that do not write."""
        return self._writer.sync if self._writer is not None else None

    # -- logging (local, any thread) ----------------------------------------------------------

    def log_samples(
        self,
        samples: SampleLike | Iterable[SampleLike],
        *,
        step: int,
        split: str = "train",
    ) -> int:
        """Offer samples of `step` to this rank's selection (``"global"``, ``"per_rank"``) or stream
        them into this rank's session (``"per_rank_stream"``). Never communicates.

        Returns how many were kept for now (held candidates can still be displaced by better
        ones before the step ends). A step that already ended takes no more samples: they are
        dropped as ``"late"``.
        """
        return self._log(samples, step, split, wait=True)

    def log_samples_nowait(
        self,
        samples: SampleLike | Iterable[SampleLike],
        *,
        step: int,
        split: str = "train",
    ) -> int:
        """As `log_samples`, but in ``"per_rank_stream"`` mode never waits for buffer room."""
        return self._log(samples, step, split, wait=False)

    def _log(self, samples: SampleLike | Iterable[SampleLike], step: int, split: str, wait: bool) -> int:
        check_step(step, split)
        if self._finish.finished:
            raise SessionClosedError("the logger is finished")
        if self.mode == "per_rank_stream":
            assert self._writer is not None  # every rank writes in this mode
            items = as_list(samples)  # once: `samples` may be a generator
            sync = self._writer.sync
            accepted = (sync.log_samples if wait else sync.log_samples_nowait)(items, step=step, split=split)
            self._front.streamed(len(items))
            return accepted
        accepted = self._front.admit(samples, step=step, split=split, refused=self._refused)
        selection = self._front.selection
        if selection is not None and selection.open_steps > _OPEN_STEPS_WARNING and not self._warned_open:
            self._warned_open = True
            logger.warning(
                "asynctrace: %d steps are open on rank %d; call end_step(step) when a step is done",
                selection.open_steps,
                self.rank,
            )
        return accepted

    def _refused(self) -> DropReason | None:
        # From the moment finish() starts, nothing is held any more: samples offered meanwhile
        # are counted as "closed" instead of being held forever.
        return None if self._finish.open else "closed"

    # -- ending steps ---------------------------------------------------------------------------

    def end_step(self, step: int, split: str | None = None, *, timeout: float | None = None) -> None:
        """End every open step up to `step` (of `split`, or of every split): its selection is final.

        ``"global"``: a collective; the selected candidates of every rank are gathered to the
        writing rank, which selects over the whole step and queues the result. ``"per_rank"``:
        the selection goes to this rank's session. ``"per_rank_stream"``: nothing to do (the
        session closes steps by itself). Samples logged later for an ended step count as ``"late"``.
        With the session's ``on_full="block"``, queueing the selection waits for room, at most
        `timeout` seconds (None: as long as it takes); what still does not fit is ``"queue_full"``.
        """
        timeout = check_timeout(timeout)
        check_int("step", step, minimum=0, maximum=MAX_STEP)
        if not self._finish.open:
            raise SessionClosedError("the logger is finished")
        # In "per_rank_stream" no step is ever open here: this hands nothing on.
        self._hand_on(self._front.take_ended(step, split), timeout)

    def _hand_on(self, ended: Ended, timeout: float | None) -> float | None:
        """Hand ended steps on; `timeout` bounds waiting for room in the session. Returns the
        deadline that applied (None without `timeout`)."""
        held = sum(opened.held for _, opened in ended)
        if self.mode == "global":
            try:
                frames = self._reduction.gather(ended)
            except BaseException:
                # This rank's candidates never reached the writing rank, or cannot be known to have.
                self._front.settle(held, 0, "aborted")
                raise
            self._front.settle(held, held)
            return self._reduction.write(frames, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        for (split, step), opened in ended:
            watched = [payload for _, payload in opened.watched]
            rows = opened.rows()
            # What a part kept is final for every sampler but one that decides when its step
            # closes (the group sampler holds candidates): the merge of one part decides it.
            if self.sampler.holds:
                chosen = merge_parts(self.sampler, split, step, self._k, [rows])
            else:
                chosen = [payload for _, payload in rows]
            self._front.settle(opened.held, len(watched) + len(chosen))
            # This rank's session is the step's only one: its watch counter's places are final.
            self._write(split, step, watched, deadline, watched=True)
            self._write(split, step, chosen, deadline)
        return deadline

    def _write(
        self,
        split: str,
        step: int,
        payloads: Sequence[bytes],
        deadline: float | None,
        *,
        watched: bool = False,
    ) -> None:
        if self._writer is not None:
            self._writer.write(split, step, payloads, deadline, watched=watched)

    # -- lifecycle ------------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """End every open step (a collective in ``"global"`` mode) and wait until this rank's session
        has written what it was given. Returns False when `timeout` passed first."""
        timeout = check_timeout(timeout)
        if self._finish.finished:
            return True
        deadline = self._hand_on(self._front.take_ended(None, None), timeout)
        if self._writer is None:
            return True
        return self._writer.sync.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def finish(self, timeout: float | None = None, *, collective: bool = True) -> RankStats:
        """End every open step, finish this rank's session within `timeout`, and return the final
        stats. Idempotent. In ``"global"`` mode this is a collective unless ``collective=False``,
        which drops what this rank still holds (as ``"aborted"``) instead of communicating: the
        context manager does that when it exits with an exception, so an error never hangs a rank.
        Samples logged while it runs are counted as ``"closed"``; if the reduction fails, the
        session is still finished before the error is raised. A finish() from another thread
        meanwhile waits for this one's outcome; one from a signal handler on the thread that is
        finishing returns the stats of the moment."""
        timeout = check_timeout(timeout)
        return self._finish.run(lambda: self._finish_once(timeout, collective), self.stats)

    def _finish_once(self, timeout: float | None, collective: bool) -> RankStats:
        budget = self._finish_timeout if timeout is None else float(timeout)
        deadline: float | None = None
        ended = self._front.take_ended(None, None)
        try:
            if self.mode != "global" or collective:
                deadline = self._hand_on(ended, budget)
            else:
                held = sum(opened.held for _, opened in ended)
                self._front.settle(held, 0, "aborted")
        finally:
            # Even when the reduction failed, the session is finished (what it holds is
            # written) and the stats are final; the error goes on to the caller.
            if self._writer is not None:
                assert budget is not None
                # What waiting for room left of the budget, but at least a short grace, as the
                # session gives its sinks: closing the runs is never skipped.
                left = budget if deadline is None else max(deadline - time.monotonic(), close_grace(budget))
                self._writer.sync.finish(left)
        return self.stats()

    def stats(self) -> RankStats:
        """A snapshot of this rank's accounting (and its session's, on ranks that write)."""
        if self._finish.finished:
            assert self._finish.final is not None
            return self._finish.final
        reduction = self._reduction
        with self._front.lock:
            tally = self._front.tally()
            return RankStats(
                rank=self.rank,
                world_size=self.world_size,
                mode=self.mode,
                submitted=tally.submitted,
                handed_on=tally.handed_on,
                held=tally.held,
                dropped=tally.dropped,
                reductions=reduction.reductions,
                bytes_sent=reduction.bytes_sent,
                last_reduction_bytes=reduction.last_bytes,
                payload_bytes_sent=reduction.payload_bytes,
                merged_received=reduction.merged_received,
                merged_capped=reduction.merged_capped,
                merged_late=reduction.merged_late,
                session=self._writer.sync.stats() if self._writer is not None else None,
            )

    def gather_stats(self) -> list[RankStats] | None:
        """Every rank's `stats()`, gathered to the writing rank (a collective in every mode);
        None on the other ranks. For checking a job's accounting in one place."""
        frames, _ = self._ranks.gather(orjson.dumps(asdict(self.stats())))  # not trace traffic
        return None if frames is None else [_rank_stats(orjson.loads(raw)) for raw in frames]

    def __enter__(self) -> DistributedTraceLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finish(collective=exc_type is None)


def _check_arguments(a: dict[str, Any]) -> None:
    """Check `DistributedTraceLogger`'s arguments (its `locals()`), each with a clear error naming it."""
    mode = a["mode"]
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {shown(mode)}")
    check_int("max_traces_per_step", a["max_traces_per_step"], allow_none=True)
    if mode in ("global", "per_rank") and a["max_traces_per_step"] is None:
        raise ValueError(
            f"mode {mode!r} selects max_traces_per_step samples per step; give one "
            "(or use mode='per_rank_stream' to write every sample)"
        )
    check_encoding(a["on_invalid"], a["redact"])
    watch = a["watch"]
    if watch is not None and not isinstance(watch, Watch):
        raise ValueError(f"watch must be an asynctrace.Watch, got {type(watch).__name__}")
    session_kwargs = a["session_kwargs"]
    if a["session_factory"] is not None and session_kwargs:
        raise ValueError("give either session_factory or session keywords, not both")
    if mode != "per_rank_stream" and session_kwargs.get("group_key") is not None:
        raise ValueError(GROUP_METRICS_SELECTED.format(mode=mode))
    # Checked on every rank, not only where a session is made: a name no sink could store
    # fails here, before any collective call.
    check_project_run(a["project"], a["run"])


def _rank_stats(data: dict[str, Any]) -> RankStats:
    """A `RankStats` again, from its `asdict` form as JSON, with the nested snapshots rebuilt."""
    session = data.pop("session")
    if session is not None:
        session["sinks"] = {name: SinkStats(**sink) for name, sink in session["sinks"].items()}
        if session["spool"] is not None:
            session["spool"] = SpoolStats(**session["spool"])
        session = SessionStats(**session)
    return RankStats(session=session, **data)
