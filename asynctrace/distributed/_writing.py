"""Where a rank's samples are written: its `TraceSession`, made from the logger's settings or by
a `session_factory` (each checked against the mode), opened, and given what the rank hands on.

In ``"global"`` mode only the writing rank has one, and every rank learns whether it opened;
in the other modes each rank has its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from .._records.types import Sample
from .._security import scrub
from .._select.base import Sampler
from .._select.watch import Watch
from .._session import TraceSession, log_watched
from .._sync import SyncTraceSession, log_payloads
from ..sinks import TrackioSink
from ._collective import Collective

__all__ = ["GROUP_METRICS_SELECTED", "Mode", "RankSetup", "RankWriter", "open_writer"]

Mode = Literal["global", "per_rank", "per_rank_stream"]
"""A `DistributedTraceLogger`'s mode: one selection over every rank, or a run per rank
(docs/distributed.md)."""

# Group metrics count every sample of a step before the cap; a session that is handed only the
# step's selection would report the selection's groups as the step's.
GROUP_METRICS_SELECTED = (
    "in mode {mode!r} the writing session sees only each step's selection, so its group metrics "
    "(group_key=) would count the selected groups as the step's: use mode='per_rank_stream' for them"
)


@dataclass(frozen=True, slots=True)
class RankSetup:
    """The logger's settings that its writing session depends on, checked already."""

    mode: Mode
    project: str
    run_name: str
    rank: int
    trackio_group: str | None
    max_traces_per_step: int | None
    sampler: Sampler
    on_invalid: Literal["raise", "skip"]
    redact: Callable[[Sample], Sample] | None
    watch: Watch | None


class RankWriter:
    """A rank's writing session, opened, and how what the rank hands on goes into it."""

    def __init__(self, session: TraceSession, sync: SyncTraceSession) -> None:
        self.session = session
        self.sync = sync
        self._blocking = session.on_full == "block"

    def write(
        self,
        split: str,
        step: int,
        payloads: Sequence[bytes],
        deadline: float | None,
        *,
        watched: bool = False,
    ) -> None:
        """Queue a step's selected (or, with `watched`, watched) payloads; under ``on_full="block"``
        wait for room until the `time.monotonic()` `deadline`."""
        if not payloads:
            return
        if watched:
            # Past every selection of the session, never waiting for room (as in one process).
            log_watched(self.session, [orjson.loads(p) for p in payloads], step=step, split=split)
            return
        # This runs on the caller's thread, never on the session's loop thread.
        log_payloads(self.sync, payloads, step=step, split=split, blocking=self._blocking, deadline=deadline)


def open_writer(
    setup: RankSetup,
    ranks: Collective,
    writes: bool,
    factory: Callable[[int, str], TraceSession] | None,
    kwargs: dict[str, Any],
) -> RankWriter | None:
    """This rank's writing session, opened (None where the rank does not write). In ``"global"``
    mode every rank learns whether the writing rank's opened, so a failure there raises on every
    rank instead of leaving the others to wait in their first collective."""
    writer: RankWriter | None = None
    error: Exception | None = None
    if writes:
        try:
            session = make_session(setup, factory, kwargs)
            writer = RankWriter(session, session.start())
        except Exception as exc:
            if setup.mode != "global":
                raise
            error = exc
    if setup.mode == "global":
        failure = "" if error is None else scrub(f"{type(error).__name__}: {error}")
        told = ranks.told_by_writer(failure)
        if error is not None:
            raise error
        if told:
            raise RuntimeError(f"the writing rank ({ranks.dst}) could not open its session: {told}")
    return writer


def make_session(
    setup: RankSetup, factory: Callable[[int, str], TraceSession] | None, kwargs: dict[str, Any]
) -> TraceSession:
    """The rank's writing session, from `factory` or from the logger's own settings."""
    if factory is not None:
        session = factory(setup.rank, setup.run_name)
        if not isinstance(session, TraceSession):
            raise ValueError(f"session_factory must return a TraceSession, got {type(session).__name__}")
        _check_factory_session(setup, session)
        return session
    if kwargs.get("sinks") is None:
        init_kwargs = {"group": setup.trackio_group} if setup.trackio_group else None
        kwargs["sinks"] = [TrackioSink(init_kwargs=init_kwargs)]
    if setup.mode == "per_rank_stream":
        kwargs.update(
            max_traces_per_step=setup.max_traces_per_step,
            sampler=setup.sampler,
            on_invalid=setup.on_invalid,
            redact=setup.redact,
            watch=setup.watch,
        )
    else:
        # Selection is done by the logger; the session only writes what was selected (it
        # validated once already, so whatever it still rejects is counted, not raised).
        kwargs.pop("max_open_steps", None)
        kwargs["on_invalid"] = "skip"
    return TraceSession(setup.project, setup.run_name, **kwargs)


def _check_factory_session(setup: RankSetup, session: TraceSession) -> None:
    """Refuse a factory's session where one of the logger's settings would go unapplied."""
    mode = setup.mode
    if mode != "per_rank_stream" and session.max_traces_per_step is not None:
        raise ValueError(
            f"in mode {mode!r} the logger selects per step; the session from "
            "session_factory must have max_traces_per_step=None"
        )
    if mode != "per_rank_stream" and session.watch is not None:
        raise ValueError(
            f"in mode {mode!r} the logger applies the watch list on every rank; give "
            "watch= to DistributedTraceLogger, not to the session from session_factory"
        )
    if mode == "per_rank_stream" and setup.watch is not None:
        raise ValueError(
            "in mode 'per_rank_stream' the watch list is the session's: give watch= to the "
            "session from session_factory"
        )
    if mode == "per_rank_stream":
        # The rank's session takes every sample itself: the logger's own settings would
        # never be applied (a redact never run would leave secrets in the traces).
        given = [
            name
            for name, value in (
                ("redact", setup.redact),
                ("on_invalid", None if setup.on_invalid == "raise" else setup.on_invalid),
                ("max_traces_per_step", setup.max_traces_per_step),
            )
            if value is not None
        ]
        if given:
            raise ValueError(
                f"in mode 'per_rank_stream' the session applies {', '.join(given)}: give "
                "them to the session from session_factory, not to DistributedTraceLogger"
            )
    elif session.group_key is not None:
        raise ValueError(GROUP_METRICS_SELECTED.format(mode=mode))
    elif session.on_invalid != "skip":
        # The logger validated every sample on its rank; the session counts what it still
        # rejects (a sample over its max_queue_bytes) instead of raising it out of end_step.
        raise ValueError(
            f"in mode {mode!r} the logger validates on every rank and the session counts "
            "what it still rejects as dropped: build the session from session_factory with "
            "on_invalid='skip'"
        )
