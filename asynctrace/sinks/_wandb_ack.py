"""Which of a `WandbSink`'s rows W&B has persisted, and which wait on the trainer.

Persisted means in the run's `.wandb` file, read back by `LogTail`. Whether rows wait on the
trainer (they joined its open W&B step) and whether `wandb-core` is still there are questions put
to the run on the sink's `Serial`, never on the event loop (W&B's `Run.step` alone can block for
30 s); the first is awaited with a deadline.

When the file cannot be read (`LogTail.broken`), or W&B wrote past the rows' step without them
(a format the reader does not recognise), the sink can confirm nothing any more: it says so once,
reports it as `degraded`, and every row it has not confirmed counts as failed, never written.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import anyio

from .._records.types import TraceRecord
from .._runtime.abandon import run_sync_daemon
from .._security import logger
from ..exceptions import PermanentSinkError
from ._guard import Serial
from ._wandb_txlog import LogTail

__all__ = ["TESTED_WANDB", "Acks", "Book", "Log", "OpenStep", "table_file"]


#: The wandb release the `.wandb` reader was tested with (it checks the format itself).
TESTED_WANDB = "0.31.0"

# While rows wait for the `.wandb` file: how often the file is read, how often the run is asked
# whether its service is still there, and how long one answer is waited for.
_POLL_FIRST = 0.01
_POLL_MAX = 0.1
_ASK_EVERY = 1.0
_ASK_WAIT = 1.0


@dataclass(slots=True)
class Log:
    """One of the sink's `run.log` calls of a table key."""

    #: The table file W&B stored its rows in (as the run's history names it); None until known
    #: (or when W&B did not say: the sink can confirm nothing then).
    file: str | None = None
    #: The W&B step its rows went into, or a later one (read after the log); None until known.
    step: int | None = None


class Book:
    """Each row the sink logged: which of its logs of which table key carried it.

    A retry after an attempt that was given up on (its timeout) but did land in the end adds
    nothing twice: rows in `logged` are not logged again.
    """

    def __init__(self) -> None:
        self.logged: dict[str, tuple[str, int]] = {}  # row id -> (table key, its log's number: 1, 2, ...)
        self.logs: dict[str, list[Log]] = {}

    def add(self, name: str, ids: Sequence[str]) -> Log:
        """Note a log of `name` that carried the rows `ids`."""
        logs = self.logs.setdefault(name, [])
        log = Log()
        logs.append(log)
        for row in ids:
            self.logged[row] = (name, len(logs))
        return log

    def need(self, records: Sequence[TraceRecord]) -> dict[str, int]:
        """Per table key, the last of the sink's logs that carried one of `records`."""
        need: dict[str, int] = {}
        for r in records:
            name, n = self.logged[r.id]
            if n > need.get(name, 0):
                need[name] = n
        return need

    def steps(self, records: Sequence[TraceRecord]) -> list[int]:
        """The W&B steps known for the logs that carried `records`."""
        out = []
        for r in records:
            logged = self.logged.get(r.id)
            step = self.logs[logged[0]][logged[1] - 1].step if logged is not None else None
            if step is not None:
                out.append(step)
        return out

    def in_log(self, tail: LogTail, name: str, n: int) -> bool:
        """Whether the `.wandb` file holds the sink's `n`-th log of `name`: its history record,
        or a later one of the same key (logs of one step that W&B merged keep the last
        increment, which lists the earlier ones). A log whose file is not known counts by none:
        the key's increments in the file could be an earlier session's or another sink's."""
        return any(log.file is not None and log.file in tail.files for log in self.logs[name][n - 1 :])


def table_file(table: object, files_dir: Path, name: str) -> str | None:
    """The file W&B stored the increment of `table` just logged under `name` in, as the run's
    history names it (relative to the run's files directory); None when the table does not say.

    `run.log` moves each increment's file into the run's files directory and keeps its path on
    the table (W&B's `Media._path`): one attribute read, where listing the key's files would
    take longer with every increment. Only a path to one of the key's table files there counts;
    it is compared with the history's, never opened."""
    path = getattr(table, "_path", None)
    if not isinstance(path, str):
        return None
    rel = os.path.relpath(path, files_dir).replace(os.sep, "/")
    return rel if rel.startswith(f"media/table/{name}_") and rel.endswith(".table.json") else None


class _Answer(NamedTuple):
    asked: float  # time.monotonic() when the question was put
    step: int | None  # the run's open W&B step; None when W&B did not say


class OpenStep:
    """The trainer's open W&B step, asked of the run on the sink's `Serial` (W&B's `Run.step`, a
    request to wandb-core that can block for 30 s): one question out at a time, each caller
    waiting for an answer with a deadline. A question stuck on a stalled service goes on in its
    thread; a later caller waits for its answer (or a newer one) until its own deadline, and never
    puts a second."""

    def __init__(self, io: Serial, ask: Callable[[], int | None]) -> None:
        self._io = io
        self._ask = ask
        self._answer: _Answer | None = None
        self._asking = False

    async def now(self, within: float = _ASK_WAIT) -> int | None:
        """The open step as asked after this call began; None without an answer in `within` s."""
        since = time.monotonic()
        with anyio.move_on_after(within):
            while True:
                answer = self._answer
                if answer is not None and answer.asked >= since:
                    return answer.step
                if self._asking:
                    await anyio.sleep(_POLL_FIRST)
                    continue
                self._asking = True
                try:
                    await self._io.run(self._put)
                except anyio.get_cancelled_exc_class():
                    raise  # the question goes on in its thread, which clears `_asking`
                except Exception:  # the sink closed, or too many of its calls are stuck
                    self._asking = False
                    return None
        return None

    def _put(self) -> None:
        try:
            asked = time.monotonic()
            self._answer = _Answer(asked, self._ask())
        finally:
            self._asking = False


class Acks:
    """A `WandbSink`'s acknowledgements: rows count once the `.wandb` file holds them."""

    def __init__(self, io: Serial, open_step: Callable[[], int | None], probe: Callable[[], bool]) -> None:
        """`open_step` reads the run's open W&B step (None: no answer); `probe` returns whether
        the run is still open, and raises when its service process is gone. Both run on `io`."""
        self.book = Book()
        self.tail: LogTail | None = None
        self.open_step = OpenStep(io, open_step)
        self._io = io
        self._probe = probe
        self._gave_up: str | None = None
        self._warned = False
        # The highest open step W&B reported: steps only increase, so rows of an earlier step
        # no longer wait on the trainer, and need no question to say so.
        self._current: int | None = None

    @property
    def unreadable(self) -> str | None:
        """Why the sink cannot confirm rows any more, or None (read from any thread)."""
        if self._gave_up is not None:
            return self._gave_up
        return self.tail.broken if self.tail is not None else None

    def give_up(self, why: str) -> None:
        """The sink cannot confirm rows from now on."""
        if self._gave_up is None:
            self._gave_up = why

    def check(self) -> str | None:
        """Why the sink cannot confirm rows any more, or None; the first time, a warning says
        what becomes of them and what to do."""
        why = self.unreadable
        if why is not None and not self._warned:
            self._warned = True
            wandb = sys.modules.get("wandb")
            logger.warning(
                "asynctrace: WandbSink cannot read W&B's .wandb transaction log (%s), so it cannot "
                "tell that rows were persisted: they count as failed, never written, and it hands "
                "W&B no more rows. This is wandb %s; the reader was tested with wandb %s. "
                "WandbSink(wait_for_log=False) counts rows once handed to W&B instead",
                why,
                getattr(wandb, "__version__", "?"),
                TESTED_WANDB,
            )
        return why

    def refuse(self) -> None:
        """Raise `PermanentSinkError` once the sink cannot confirm rows."""
        why = self.check()
        if why is not None:
            raise PermanentSinkError(f"W&B's transaction log cannot be read: {why}")

    async def persisted(self, records: Sequence[TraceRecord]) -> None:
        """Return once the run's `.wandb` file holds every row of `records`.

        The wait has no deadline of its own: the session's `attempt_timeout` (a write) or its
        finish (a confirmation) cancels it, and a retry waits again for the same rows (logged
        once). A service process that is gone, or a log the sink cannot read, raises
        `PermanentSinkError`: those rows count as failed.
        """
        tail = self.tail
        assert tail is not None  # only a sink that reads the log waits for it
        need = self.book.need(records)
        pause = _POLL_FIRST
        ask_at = time.monotonic() + _ASK_EVERY
        while True:
            # False: the poll read its most and more was there (a long wait's backlog): no pause.
            caught_up = await run_sync_daemon(tail.poll)
            # Read before the files: a history record's items are noted before its step.
            passed, ended = tail.last_step, tail.finished
            need = {name: n for name, n in need.items() if not self.book.in_log(tail, name, n)}
            if not need:
                return
            self.refuse()
            steps = [self.book.logs[name][n - 1].step for name, n in need.items()]
            if ended or any(step is not None and passed > step for step in steps):
                # W&B wrote the rows' step (or the run's end) and the reader found no trace of
                # them: a format it does not recognise. Nothing it reads can be trusted now.
                where = "the run's end" if ended else f"W&B step {passed}"
                self.give_up(f"{tail.path.name} holds {where} but not the rows logged before it")
                self.refuse()
            if time.monotonic() >= ask_at:
                # Rows in the trainer's open step wait for it, not for the service: no reason to
                # probe it then (each probe is a record in the log).
                if not await self.held_back(records):
                    await self._still_there()
                ask_at = time.monotonic() + _ASK_EVERY
            if caught_up:
                await anyio.sleep(pause)
                pause = min(pause * 2, _POLL_MAX)

    async def held_back(self, records: Sequence[TraceRecord]) -> bool:
        """True while the W&B step the rows of `records` went into is still the trainer's open
        one: W&B writes them only when the trainer logs its next step (or finishes the run).
        Unknown (no answer in time, a finished run) is False: a flush waits for them then."""
        steps = self.book.steps(records)
        if not steps or (self.tail is not None and self.tail.finished):
            return False
        if self._current is not None and max(steps) < self._current:
            return False
        current = await self.open_step.now()
        if current is None:
            return False
        self._current = max(current, self._current if self._current is not None else current)
        return max(steps) >= current

    async def _still_there(self) -> None:
        """Raise `PermanentSinkError` when the run's service process is gone: it never writes
        the rows it had not written. A run finished meanwhile (the trainer's `run.finish()`)
        is not: its log is read on, to its end."""
        try:
            await self._io.run(self._probe)
        except PermanentSinkError:
            raise
        except Exception:  # a hiccup, or too many of the sink's calls are stuck: asked again later
            return
