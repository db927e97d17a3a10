"""The gate: a cap and sampler applied per (split, step), holding a selection per open step and
closing steps by the session's rules."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from .._security import logger
from .base import EVICTED, HELD, RELEASED, Entry, Sampler, StepSelection
from .window import Step, StepWindow

__all__ = ["COUNTER_WINDOW", "Gate", "GateResult"]


# Steps a non-holding sampler keeps counting before the oldest is closed.
COUNTER_WINDOW = 4096


@dataclass(slots=True)
class GateResult:
    """What one offer did: entries to pass on now, and counts by outcome."""

    passed: list[Entry] = field(default_factory=list)
    capped: int = 0  # rejected at once
    late: int = 0
    evicted: list[Entry] = field(default_factory=list)  # earlier entries dropped as capped
    released: list[Entry] = field(default_factory=list)  # entries of steps this offer closed
    held: int = 0


class Gate:
    """Applies the per-(split, step) cap and sampler; not thread-safe (the pipeline holds its lock)."""

    def __init__(
        self,
        k: int,
        sampler: Sampler,
        *,
        max_open_steps: int,
        step_timeout: float | None,
    ) -> None:
        self.k = k
        self.sampler = sampler
        self.max_open_steps = max_open_steps
        self.step_timeout = step_timeout
        # The selection of each open step; which steps are open, closed or late is the window's.
        self._open: dict[Step, StepSelection] = {}
        self.window = StepWindow(max_open_steps, step_timeout)
        self._warned = False
        # A selection `keeps` started for a step not open yet (one at most).
        self._fresh: dict[tuple[str, int], StepSelection] = {}
        # Places of a step already used before a restart (a replay's tier): its selection has fewer.
        self.spent: dict[tuple[str, int], int] = {}

    def is_closed(self, split: str, step: int) -> bool:
        """True when samples for this step are late."""
        return self.window.is_late(split, step)

    def keeps(
        self,
        split: str,
        step: int,
        scores: Sequence[float | None],
        first_seq: int,
        groups: Sequence[Hashable | None] | None = None,
    ) -> list[bool] | None:
        """Which candidates an offer made now would keep (see `StepSelection.keeps`); changes nothing.

        Within an open step a selection only gets harder to enter (a count fills up, a held
        set only improves), so a candidate refused here would be refused later too.
        """
        if self.window.is_late(split, step):
            return [False] * len(scores)
        opened = self._open.get((split, step))
        if opened is not None:
            if groups is None:  # `_ask`, inline on the usual call
                return opened.keeps(scores, first_seq)
            return self._ask(opened, scores, first_seq, groups)
        if self.sampler.starts_cheaply:
            # The fresh selection is kept for the offer that opens the step, so a seeded
            # generator that drew ahead here is the one that decides there.
            fresh = self._fresh.get((split, step))
            if fresh is None:
                self._fresh.clear()
                fresh = self._fresh[(split, step)] = self.sampler.new_step(split, step, self.k)
            return self._ask(fresh, scores, first_seq, groups)
        return None  # another sampler's new selection may cost something

    @staticmethod
    def _ask(
        selection: StepSelection,
        scores: Sequence[float | None],
        first_seq: int,
        groups: Sequence[Hashable | None] | None,
    ) -> list[bool] | None:
        if groups is None:
            return selection.keeps(scores, first_seq)
        return selection.keeps(scores, first_seq, groups=groups)  # type: ignore[call-arg]

    def releasing(self, split: str, step: int) -> tuple[int, int]:
        """What an offer for (split, step) would release from the steps it closes, as (records,
        encoded bytes); changes nothing. Rows still being decoded count for nothing here: they
        go through the buffer's bound when they are filled."""
        if not self.sampler.holds:
            return 0, 0
        upto = self.window.behind(split, step)
        if upto is None:
            return 0, 0
        n = nbytes = 0
        for (sp, st), opened in self._open.items():
            if sp == split and st <= upto:
                for e in opened.held():
                    if e.state != EVICTED and e.record is not None:
                        n += 1
                        nbytes += e.record.nbytes
        return n, nbytes

    def offer(self, split: str, step: int, entries: Iterable[Entry], now: float) -> GateResult:
        result = GateResult()
        entries = list(entries)
        if self.window.is_late(split, step) or self._arrive(split, step, now, result):
            result.late = len(entries)
            for e in entries:
                e.state = EVICTED
            return result
        key = (split, step)
        opened = self._open.get(key)
        if opened is None:
            fresh = self._fresh.pop(key, None)
            k = self.k
            if self.spent and key in self.spent:
                fresh, k = None, max(0, k - self.spent.pop(key))
            opened = self._open[key] = fresh if fresh is not None else self.sampler.new_step(split, step, k)
        holds = self.sampler.holds
        flags, pushed_out = opened.offer_all(entries)
        for e, kept in zip(entries, flags, strict=True):
            if not kept:
                e.state = EVICTED
                result.capped += 1
            elif holds:
                result.held += 1
            else:
                e.state = RELEASED
                result.passed.append(e)
        for evicted in pushed_out:
            if evicted.state == HELD:
                evicted.state = EVICTED
                result.evicted.append(evicted)
            elif evicted.state == RELEASED and not self._warned:
                # Already passed on (a sampler with holds=False keeps nothing back): it is
                # written all the same, so it must not be counted as capped too.
                self._warned = True
                logger.warning(
                    "asynctrace: sampler %s evicted a sample it had already let through "
                    "(holds=False); such samples are written anyway. A sampler that changes "
                    "its mind must set holds=True",
                    type(self.sampler).__name__,
                )
        return result

    def _arrive(self, split: str, step: int, now: float, result: GateResult) -> bool:
        """Open `step` and close the steps its arrival closes; True when `step` itself is late."""
        window = self.window
        if self.sampler.holds:
            closed = window.arrive(split, step, now)
            if closed:
                self._release(closed, result.released, result.evicted)
            return False
        if len(self._open) >= COUNTER_WINDOW and (split, step) not in self._open:
            # A sampler that holds nothing needs only a counter per step, so stragglers many
            # steps behind are still capped exactly; the window just bounds the memory, per
            # split, so that a sparse split (eval) is never pushed out by a busy one (train).
            mine = [s for sp, s in self._open if sp == split]
            if len(mine) >= COUNTER_WINDOW:
                # The oldest of the split's counted steps and this one leaves the window. When
                # that is this step, its samples are late: counting it too would let stragglers
                # arriving in descending step order grow the window without bound.
                oldest = min(mine)
                self._release(window.close_upto(split, min(oldest, step)), result.released, result.evicted)
                if step < oldest:
                    return True
        window.touch(split, step, now)
        return False

    def _release(self, steps: list[Step], out: list[Entry], dropped: list[Entry] | None) -> None:
        """The selections of closed steps hand on what they hold (later samples for them are
        late); entries a selection drops only now go to `dropped` (counted "capped" by the caller)."""
        for key in steps:
            released, gone = self._open.pop(key).close()
            for e in released:
                if e.state != EVICTED:  # withdrawn (a selection that keeps their places)
                    e.state = RELEASED
                    out.append(e)
            for e in gone:
                if e.state == HELD:
                    e.state = EVICTED
                    if dropped is not None:
                        dropped.append(e)

    def skip(self, split: str, step: int, n: int) -> None:
        """`n` samples of (split, step) that `keeps` refused were passed over (see `StepSelection.skip`)."""
        selection = self._open.get((split, step))
        if selection is None:
            selection = self._fresh.get((split, step))
        if selection is not None and n:
            selection.skip(n)

    def withdraw(self, split: str, step: int, entries: Sequence[Entry]) -> None:
        """Give back the places of kept entries that will never be filled."""
        opened = self._open.get((split, step))
        if opened is not None and entries:
            opened.withdraw(entries)

    def close_all(self, *, holding_only: bool = True, dropped: list[Entry] | None = None) -> list[Entry]:
        """Close every open step (flush/finish); returns what they release, and appends to
        `dropped` what their selections drop only now. Samplers that hold nothing keep counting
        their caps."""
        out: list[Entry] = []
        if holding_only and not self.sampler.holds:
            return out
        self._release(self.window.close_all(), out, dropped)
        return out

    def close_idle(self, now: float, dropped: list[Entry] | None = None) -> list[Entry]:
        """Close steps that saw no sample for `step_timeout` seconds (see `close_all`)."""
        out: list[Entry] = []
        if self.sampler.holds:
            self._release(self.window.close_idle(now), out, dropped)
        return out
