"""`DistributedTraceLogger`: one logger per rank, its modes and its per-rank stats."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

import orjson

from .._checks import MAX_STEP, check_encoding, check_int, check_project_run, check_step, check_timeout
from .._engine.engine import selection_group_keys
from .._engine.ledger import Ledger
from .._records.encode import as_list, encode_samples
from .._records.types import Sample, SampleLike
from .._runtime.lifecycle import close_grace
from .._security import generated_run_name, logger, scrub, shown
from .._select.base import Sampler
from .._select.groups import GroupSampler
from .._select.parts import PartSteps, merge_parts
from .._select.samplers import SamplerName, resolve_sampler
from .._select.watch import Watch, WatchCounter
from .._session import TraceSession, log_watched
from .._stats import Counts, SessionStats, SinkStats, SpoolStats
from .._sync import SyncTraceSession, log_payloads
from ..exceptions import SessionClosedError
from ..sinks import TrackioSink
from ._collective import Collective, Ended
from ._reduction import Reduction

if TYPE_CHECKING:
    import torch

__all__ = ["DistributedTraceLogger", "Mode", "RankStats"]

Mode = Literal["global", "per_rank", "per_rank_stream"]
"""A `DistributedTraceLogger`'s mode: one selection over every rank, or a run per rank
(docs/distributed.md)."""
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
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {shown(mode)}")
        check_int("max_traces_per_step", max_traces_per_step, allow_none=True)
        if mode in ("global", "per_rank") and max_traces_per_step is None:
            raise ValueError(
                f"mode {mode!r} selects max_traces_per_step samples per step; give one "
                "(or use mode='per_rank_stream' to write every sample)"
            )
        check_encoding(on_invalid, redact)
        if watch is not None and not isinstance(watch, Watch):
            raise ValueError(f"watch must be an asynctrace.Watch, got {type(watch).__name__}")
        if session_factory is not None and session_kwargs:
            raise ValueError("give either session_factory or session keywords, not both")
        if mode != "per_rank_stream" and session_kwargs.get("group_key") is not None:
            raise ValueError(_GROUP_METRICS_SELECTED.format(mode=mode))
        # Checked on every rank, not only where a session is made: a name no sink could store
        # fails here, before any collective call.
        check_project_run(project, run)

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

        # Rank 0's name wins, so every rank writes to (or names its run after) the same run. A
        # group sampler that drew its own seed (seed=None) takes rank 0's in the same broadcast,
        # so every rank keys random groups alike, as one process would.
        own = (
            self.sampler.run_seed
            if isinstance(self.sampler, GroupSampler) and self.sampler.seed is None
            else ""
        )
        self.run, _, seed = ranks.agree(f"{run or generated_run_name()}\x00{own}").partition("\x00")
        if seed and own and isinstance(self.sampler, GroupSampler):
            self.sampler.run_seed = seed
        self.run_name = f"{self.run}-rank{self.rank}" if mode != "global" else self.run
        self.trackio_group = (
            trackio_group if trackio_group is not None else (self.run if mode != "global" else None)
        )
        self.writes = mode != "global" or self.rank == ranks.dst_group_rank

        self._lock = threading.Lock()
        # This rank's part of each step ("per_rank_stream" offers it nothing).
        self._steps = PartSteps(self.sampler, max_traces_per_step or 1, self.rank)
        # The engine's ledger counts submitted and dropped samples, and warns once per reason;
        # what this rank handed on (to the writing rank, or to its own session) is `written`.
        self._ledger = Ledger((), None, owner="logger", quiet=("capped", "closed"))
        # The watch list, where selection happens here: this rank's counter passes the first
        # max_per_step watched samples of a step by its selection; the writing rank's second
        # one takes the step's places over every rank's (see `grant_watched`).
        selects = watch is not None and mode != "per_rank_stream"
        self._watch = WatchCounter(watch) if selects and watch is not None else None
        granted = WatchCounter(watch) if selects and watch is not None and mode == "global" else None
        self._reduction = Reduction(ranks, self._steps, self.sampler, granted, self._write, self._abort)
        self._warned_open = False
        # Set (under `_lock`) when finish() starts: from then on nothing is held any more, so
        # samples offered meanwhile are counted as "closed" instead of being held forever.
        self._closing = False
        self._final: RankStats | None = None

        session, self._sync = self._open_session(session_factory, session_kwargs)
        self._session = session
        # What the rank validates for the writing session: a group every group sampler there
        # reads (the logger's, and its Selected tiers') can name. A rank that does not write
        # knows the tiers from the same sinks= (not those a session_factory builds on dst).
        sinks = session.sinks if session is not None else session_kwargs.get("sinks")
        self._group_keys = tuple(
            selection_group_keys(self.sampler, sinks if isinstance(sinks, (list, tuple)) else ())
        )
        self._blocking = session is not None and session.on_full == "block"
        self._finish_timeout = session.finish_timeout if session is not None else None

    # -- set-up ---------------------------------------------------------------------------------

    def _open_session(
        self, factory: Callable[[int, str], TraceSession] | None, kwargs: dict[str, Any]
    ) -> tuple[TraceSession | None, SyncTraceSession | None]:
        """This rank's writing session, opened; in ``"global"`` mode every rank learns whether the
        writing rank's opened, so a failure there raises on every rank instead of leaving the
        others to wait in their first collective."""
        session: TraceSession | None = None
        sync: SyncTraceSession | None = None
        error: Exception | None = None
        if self.writes:
            try:
                session = _make_session(self, factory, kwargs)
                sync = session.start()
            except Exception as exc:
                if self.mode != "global":
                    raise
                error = exc
        if self.mode == "global":
            failure = "" if error is None else scrub(f"{type(error).__name__}: {error}")
            told = self._ranks.told_by_writer(failure)
            if error is not None:
                raise error
            if told:
                raise RuntimeError(f"the writing rank ({self.dst}) could not open its session: {told}")
        return session, sync

    def __repr__(self) -> str:
        return (
            f"DistributedTraceLogger(mode={self.mode!r}, rank={self.rank}/{self.world_size}, "
            f"run={self.run_name!r})"
        )

    @property
    def session(self) -> SyncTraceSession | None:
        """This rank's writing session (for `log_metrics`, say); None on ranks that do not write."""
        return self._sync

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
        if self._final is not None:
            raise SessionClosedError("the logger is finished")
        items = as_list(samples)  # once: `samples` may be a generator
        if self.mode == "per_rank_stream":
            assert self._sync is not None
            log = self._sync.log_samples if wait else self._sync.log_samples_nowait
            accepted = log(items, step=step, split=split)
            with self._lock:
                self._ledger.submitted += len(items)
                self._ledger.written += len(items)
            return accepted
        skipped: list[int] = []
        encoded, invalid = encode_samples(
            items,
            redact=self.redact,
            skip_invalid=self.on_invalid == "skip",
            score_needed_by=type(self.sampler).__name__ if self.sampler.needs_score else None,
            group_keys=self._group_keys,
            skipped=skipped,
        )
        watched: set[int] = set()
        if self._watch is not None and encoded:
            # Validated first, then the watch list: an invalid sample takes no watched place.
            left_out = set(skipped)
            valid = [obj for i, obj in enumerate(items) if i not in left_out]
            watched = set(self._watch.split(valid, split, step)[0])
        with self._lock:
            ledger = self._ledger
            ledger.submitted += len(items)
            ledger.drop("invalid", invalid)
            if self._closing:
                ledger.drop("closed", len(encoded))
                accepted, unheld = 0, True
            else:
                accepted, cut, late = self._steps.offer(split, step, encoded, watched=watched)
                ledger.drop("capped", cut)
                ledger.drop("late", late)
                unheld = late > 0
            if len(self._steps.open) > _OPEN_STEPS_WARNING and not self._warned_open:
                self._warned_open = True
                logger.warning(
                    "asynctrace: %d steps are open on rank %d; call end_step(step) when a step is done",
                    len(self._steps.open),
                    self.rank,
                )
        if watched and unheld and self._watch is not None:
            # The places taken for watched samples that are not held go back.
            self._watch.give_back(split, step, len(watched))
        return accepted

    # -- ending steps ---------------------------------------------------------------------------

    def _take_ended(self, step: int | None, split: str | None) -> Ended:
        """Remove and return the open steps that end now, counted as handed on from here."""
        with self._lock:
            out = self._steps.end(step, split)
            self._ledger.written += sum(opened.held for _, opened in out)
        return out

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
        if self._final is not None or self._closing:
            raise SessionClosedError("the logger is finished")
        # In "per_rank_stream" no step is ever open here: this hands nothing on.
        self._hand_on(self._take_ended(step, split), timeout)

    def _hand_on(self, ended: Ended, timeout: float | None) -> float | None:
        """Hand ended steps on; `timeout` bounds waiting for room in the session. Returns the
        deadline that applied (None without `timeout`)."""
        if self.mode == "global":
            return self._reduction.reduce(ended, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        for (split, step), opened in ended:
            # This rank's session is the step's only one: its watch counter's places are final.
            self._write(split, step, [payload for _, payload in opened.watched], deadline, watched=True)
            rows = opened.rows()
            # What a part kept is final for every sampler but one that decides when its step
            # closes (the group sampler holds candidates): the merge of one part decides it.
            chosen = (
                merge_parts(self.sampler, split, step, self._steps.k, [rows]) if self.sampler.holds else None
            )
            if chosen is None:
                chosen = [payload for _, payload in rows]
            elif len(chosen) < len(rows):
                with self._lock:
                    self._ledger.written -= len(rows) - len(chosen)
                    self._ledger.drop("capped", len(rows) - len(chosen))
            self._write(split, step, chosen, deadline)
        return deadline

    def _abort(self, ended: Ended) -> None:
        """Count samples taken out of their selections but never handed on as ``"aborted"``."""
        with self._lock:
            n = sum(opened.held for _, opened in ended)
            self._ledger.written -= n
            self._ledger.drop("aborted", n)

    def _write(
        self,
        split: str,
        step: int,
        payloads: Sequence[bytes],
        deadline: float | None,
        *,
        watched: bool = False,
    ) -> None:
        if not payloads or self._sync is None:
            return
        if watched:
            assert self._session is not None
            # Past every selection of the session, never waiting for room (as in one process).
            log_watched(self._session, [orjson.loads(p) for p in payloads], step=step, split=split)
            return
        # This runs on the caller's thread, never on the session's loop thread.
        log_payloads(self._sync, payloads, step=step, split=split, blocking=self._blocking, deadline=deadline)

    # -- lifecycle ------------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """End every open step (a collective in ``"global"`` mode) and wait until this rank's session
        has written what it was given. Returns False when `timeout` passed first."""
        timeout = check_timeout(timeout)
        if self._final is not None:
            return True
        deadline = self._hand_on(self._take_ended(None, None), timeout)
        if self._sync is None:
            return True
        return self._sync.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def finish(self, timeout: float | None = None, *, collective: bool = True) -> RankStats:
        """End every open step, finish this rank's session within `timeout`, and return the final
        stats. Idempotent. In ``"global"`` mode this is a collective unless ``collective=False``,
        which drops what this rank still holds (as ``"aborted"``) instead of communicating: the
        context manager does that when it exits with an exception, so an error never hangs a rank.
        Samples logged while it runs are counted as ``"closed"``; if the reduction fails, the
        session is still finished before the error is raised."""
        timeout = check_timeout(timeout)
        if self._final is not None:
            return self._final
        budget = self._finish_timeout if timeout is None else float(timeout)
        deadline: float | None = None
        with self._lock:
            # From here on a concurrent log_samples() is counted as "closed", never held.
            self._closing = True
        ended = self._take_ended(None, None)
        try:
            if self.mode != "global" or collective:
                deadline = self._hand_on(ended, budget)
            else:
                self._abort(ended)
        finally:
            # Even when the reduction failed, the session is finished (what it holds is
            # written) and the stats are final; the error goes on to the caller.
            if self._sync is not None:
                assert budget is not None
                # What waiting for room left of the budget, but at least a short grace, as the
                # session gives its sinks: closing the runs is never skipped.
                left = budget if deadline is None else max(deadline - time.monotonic(), close_grace(budget))
                self._sync.finish(left)
            self._final = self.stats()
        return self._final

    def stats(self) -> RankStats:
        """A snapshot of this rank's accounting (and its session's, on ranks that write)."""
        if self._final is not None:
            return self._final
        reduction = self._reduction
        with self._lock:
            return RankStats(
                rank=self.rank,
                world_size=self.world_size,
                mode=self.mode,
                submitted=self._ledger.submitted,
                handed_on=self._ledger.written,
                held=self._steps.held,
                dropped=dict(self._ledger.dropped),
                reductions=reduction.reductions,
                bytes_sent=reduction.bytes_sent,
                last_reduction_bytes=reduction.last_bytes,
                payload_bytes_sent=reduction.payload_bytes,
                merged_received=reduction.merged_received,
                merged_capped=reduction.merged_capped,
                merged_late=reduction.merged_late,
                session=self._sync.stats() if self._sync is not None else None,
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


# Group metrics count every sample of a step before the cap; a session that is handed only the
# step's selection would report the selection's groups as the step's.
_GROUP_METRICS_SELECTED = (
    "in mode {mode!r} the writing session sees only each step's selection, so its group metrics "
    "(group_key=) would count the selected groups as the step's: use mode='per_rank_stream' for them"
)


def _make_session(
    owner: DistributedTraceLogger, factory: Callable[[int, str], TraceSession] | None, kwargs: dict[str, Any]
) -> TraceSession:
    """The rank's writing session, from `factory` or from the logger's own settings."""
    if factory is not None:
        session = factory(owner.rank, owner.run_name)
        if not isinstance(session, TraceSession):
            raise ValueError(f"session_factory must return a TraceSession, got {type(session).__name__}")
        if owner.mode != "per_rank_stream" and session.max_traces_per_step is not None:
            raise ValueError(
                f"in mode {owner.mode!r} the logger selects per step; the session from "
                "session_factory must have max_traces_per_step=None"
            )
        if owner.mode != "per_rank_stream" and session.watch is not None:
            raise ValueError(
                f"in mode {owner.mode!r} the logger applies the watch list on every rank; give "
                "watch= to DistributedTraceLogger, not to the session from session_factory"
            )
        if owner.mode == "per_rank_stream" and owner.watch is not None:
            raise ValueError(
                "in mode 'per_rank_stream' the watch list is the session's: give watch= to the "
                "session from session_factory"
            )
        if owner.mode == "per_rank_stream":
            # The rank's session takes every sample itself: the logger's own settings would
            # never be applied (a redact never run would leave secrets in the traces).
            given = [
                name
                for name, value in (
                    ("redact", owner.redact),
                    ("on_invalid", None if owner.on_invalid == "raise" else owner.on_invalid),
                    ("max_traces_per_step", owner.max_traces_per_step),
                )
                if value is not None
            ]
            if given:
                raise ValueError(
                    f"in mode 'per_rank_stream' the session applies {', '.join(given)}: give "
                    "them to the session from session_factory, not to DistributedTraceLogger"
                )
        elif session.group_key is not None:
            raise ValueError(_GROUP_METRICS_SELECTED.format(mode=owner.mode))
        elif session.on_invalid != "skip":
            # The logger validated every sample on its rank; the session counts what it still
            # rejects (a sample over its max_queue_bytes) instead of raising it out of end_step.
            raise ValueError(
                f"in mode {owner.mode!r} the logger validates on every rank and the session counts "
                "what it still rejects as dropped: build the session from session_factory with "
                "on_invalid='skip'"
            )
        return session
    if kwargs.get("sinks") is None:
        init_kwargs = {"group": owner.trackio_group} if owner.trackio_group else None
        kwargs["sinks"] = [TrackioSink(init_kwargs=init_kwargs)]
    if owner.mode == "per_rank_stream":
        kwargs.update(
            max_traces_per_step=owner.max_traces_per_step,
            sampler=owner.sampler,
            on_invalid=owner.on_invalid,
            redact=owner.redact,
            watch=owner.watch,
        )
    else:
        # Selection is done by the logger; the session only writes what was selected (it
        # validated once already, so whatever it still rejects is counted, not raised).
        kwargs.pop("max_open_steps", None)
        kwargs["on_invalid"] = "skip"
    return TraceSession(owner.project, owner.run_name, **kwargs)


def _rank_stats(data: dict[str, Any]) -> RankStats:
    """A `RankStats` again, from its `asdict` form as JSON, with the nested snapshots rebuilt."""
    session = data.pop("session")
    if session is not None:
        session["sinks"] = {name: SinkStats(**sink) for name, sink in session["sinks"].items()}
        if session["spool"] is not None:
            session["spool"] = SpoolStats(**session["spool"])
        session = SessionStats(**session)
    return RankStats(session=session, **data)
