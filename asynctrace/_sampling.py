"""Caps and samplers: which samples of one (split, step) are kept, and when a step closes."""

from __future__ import annotations

import abc
import heapq
import logging
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ._record import TraceRecord
from ._security import shown

__all__ = [
    "FirstSampler",
    "ReservoirSampler",
    "Sampler",
    "StepSelection",
    "TopBottomSampler",
    "resolve_sampler",
]

logger = logging.getLogger("asynctrace")

# Steps a non-holding sampler keeps counting before the oldest is closed.
COUNTER_WINDOW = 4096

# Entry states.
HELD = 0  # kept by a sampler for an open step
EVICTED = 1  # pushed out by a better candidate: counted "capped"
RELEASED = 2  # handed on towards the buffer


class Entry:
    """A candidate sample inside a sampler. `record` is None while a reserved row is still being decoded."""

    __slots__ = ("record", "score", "seq", "state")

    def __init__(self, score: float | None, seq: int, record: TraceRecord | None = None) -> None:
        self.score = score
        self.seq = seq
        self.record = record
        self.state = HELD


class StepSelection(abc.ABC):
    """The selection state of one (split, step): O(k) entries at most."""

    @abc.abstractmethod
    def offer(self, entry: Entry) -> tuple[bool, Entry | None]:
        """Offer one candidate; returns (kept, evicted) where evicted is an earlier entry now dropped."""

    @abc.abstractmethod
    def held(self) -> list[Entry]:
        """Entries still held (for holding samplers), released when the step closes."""

    def keeps(self, scores: Sequence[float | None], first_seq: int) -> list[bool] | None:
        """Which of these candidates, offered in order after everything offered so far (with
        sequence numbers from `first_seq`), would still be kept; None when it cannot tell
        without offering them. Must not change the selection."""
        return None

    def withdraw(self, entries: Sequence[Entry]) -> None:
        """Give up the places of kept entries that will never be filled (a reserved row whose
        decoding failed), as if they had not been offered. The default keeps their places
        taken; the gate never releases or counts them again either way."""
        return None


class Sampler(abc.ABC):
    """Chooses at most `k` samples per (split, step). Subclass to write your own."""

    #: True when the sampler must see the whole step before it knows what to keep.
    holds: bool = True
    #: True when the sampler ranks by score, so every sample needs a finite one.
    needs_score: bool = False

    @abc.abstractmethod
    def new_step(self, split: str, step: int, k: int) -> StepSelection:
        """Start the selection for a new step."""


class _FirstSelection(StepSelection):
    __slots__ = ("_k", "_n")

    def __init__(self, k: int) -> None:
        self._k = k
        self._n = 0

    def offer(self, entry: Entry) -> tuple[bool, Entry | None]:
        if self._n < self._k:
            self._n += 1
            return True, None
        return False, None

    def keeps(self, scores: Sequence[float | None], first_seq: int) -> list[bool] | None:
        room = self._k - self._n
        return [i < room for i in range(len(scores))]

    def withdraw(self, entries: Sequence[Entry]) -> None:
        self._n -= len(entries)

    def held(self) -> list[Entry]:
        return []


class FirstSampler(Sampler):
    """Keeps the first `k` samples to arrive; they flow on at once."""

    holds = False

    def new_step(self, split: str, step: int, k: int) -> StepSelection:
        return _FirstSelection(k)


class _TopBottomSelection(StepSelection):
    # Two heaps: `top` keeps the ceil(k/2) highest scores (root = weakest of them), and
    # `bottom` keeps the floor(k/2) lowest of everything not in `top` (root = highest).
    # An entry leaving `top` can still belong to `bottom`, so it is passed down, and what
    # leaves `bottom` is dropped. Ties keep the earlier arrival.
    __slots__ = ("_bottom", "_n_bottom", "_n_top", "_top")

    def __init__(self, k: int) -> None:
        self._n_top = -(-k // 2)  # ceil(k/2) in ints: k / 2 overflows a float for a huge k
        self._n_bottom = k // 2
        self._top: list[tuple[float, int, Entry]] = []
        self._bottom: list[tuple[float, int, Entry]] = []

    def offer(self, entry: Entry) -> tuple[bool, Entry | None]:
        score = entry.score
        if score is None:  # the session rejects unscored samples before they get here
            raise ValueError("top_bottom needs a score")
        heapq.heappush(self._top, (score, -entry.seq, entry))
        if len(self._top) <= self._n_top:
            return True, None
        _, _, down = heapq.heappop(self._top)
        heapq.heappush(self._bottom, (-down.score, -down.seq, down))  # type: ignore[operator]
        if len(self._bottom) <= self._n_bottom:
            return True, None
        _, _, out = heapq.heappop(self._bottom)
        if out is entry:
            return False, None
        return True, out

    def held(self) -> list[Entry]:
        entries = [e for _, _, e in self._top] + [e for _, _, e in self._bottom]
        entries.sort(key=lambda e: -(e.score or 0.0))
        return entries

    def withdraw(self, entries: Sequence[Entry]) -> None:
        gone = {id(e) for e in entries}
        self._top = [t for t in self._top if id(t[2]) not in gone]
        self._bottom = [t for t in self._bottom if id(t[2]) not in gone]
        heapq.heapify(self._top)
        heapq.heapify(self._bottom)
        # A low score that `bottom` dropped is not recalled: top and bottom keep their own
        # best, and a place freed in either is open to the next candidates.

    def keeps(self, scores: Sequence[float | None], first_seq: int) -> list[bool] | None:
        n = len(scores)
        if len(self._top) + len(self._bottom) + n <= self._n_top + self._n_bottom:
            return [True] * n
        maybe: Sequence[int] = range(n)
        if len(self._top) == self._n_top and len(self._bottom) == self._n_bottom:
            # Both full: a score from the weakest kept high one down to the strongest kept low
            # one cannot enter (a tie loses to the earlier arrival), whatever else arrives, and
            # offering it would change nothing.
            hi = self._top[0][0] if self._top else math.inf
            lo = -self._bottom[0][0] if self._bottom else -math.inf
            maybe = [i for i, sc in enumerate(scores) if sc is not None and (sc > hi or sc < lo)]
            if not maybe:
                return [False] * n
        # Offer the rest to a copy: the same code decides, so the answer cannot drift from it.
        sim = _TopBottomSelection(0)
        sim._n_top, sim._n_bottom = self._n_top, self._n_bottom
        sim._top, sim._bottom = list(self._top), list(self._bottom)
        probes = {i: Entry(scores[i], first_seq + i) for i in maybe}
        for probe in probes.values():
            sim.offer(probe)
        kept = {id(e) for _, _, e in sim._top} | {id(e) for _, _, e in sim._bottom}
        return [i in probes and id(probes[i]) in kept for i in range(n)]


class TopBottomSampler(Sampler):
    """Keeps the ceil(k/2) highest and floor(k/2) lowest scores of the step."""

    needs_score = True

    def new_step(self, split: str, step: int, k: int) -> StepSelection:
        return _TopBottomSelection(k)


class _ReservoirSelection(StepSelection):
    __slots__ = ("_k", "_n", "_res", "_rng")

    def __init__(self, k: int, rng: random.Random) -> None:
        self._k = k
        self._n = 0
        self._res: list[Entry] = []
        self._rng = rng

    def offer(self, entry: Entry) -> tuple[bool, Entry | None]:
        self._n += 1
        if self._n <= self._k:
            self._res.append(entry)
            return True, None
        j = self._rng.randrange(self._n)
        if j < self._k:
            if len(self._res) < self._k:
                # A place `withdraw` freed goes to the next row algorithm R picks, not to the
                # next row: that one would be kept far more often than k/n.
                self._res.append(entry)
                return True, None
            out = self._res[j]
            self._res[j] = entry
            return True, out
        return False, None

    def held(self) -> list[Entry]:
        return sorted(self._res, key=lambda e: e.seq)

    def withdraw(self, entries: Sequence[Entry]) -> None:
        # Later rows then enter at the rate they would have had were the withdrawn rows never
        # offered. The rows those displaced are gone, so a step that ends before a later row
        # is picked for a freed place is left short of k.
        gone = {id(e) for e in entries}
        kept = [e for e in self._res if id(e) not in gone]
        self._n -= len(self._res) - len(kept)
        self._res = kept


class ReservoirSampler(Sampler):
    """A uniform random `k` of the step (algorithm R); seeded per (seed, split, step), so reproducible."""

    def __init__(self, seed: int | None = 0) -> None:
        self.seed = seed

    def new_step(self, split: str, step: int, k: int) -> StepSelection:
        # A string seed is hashed deterministically (sha512), unlike hash() of a tuple.
        rng = random.Random(f"{self.seed}:{split}:{step}" if self.seed is not None else None)
        return _ReservoirSelection(k, rng)


SamplerName = Literal["first", "top_bottom", "reservoir"]


def resolve_sampler(sampler: SamplerName | Sampler) -> Sampler:
    if isinstance(sampler, Sampler):
        return sampler
    if sampler == "first":
        return FirstSampler()
    if sampler == "top_bottom":
        return TopBottomSampler()
    if sampler == "reservoir":
        return ReservoirSampler()
    raise ValueError(
        f"sampler must be 'first', 'top_bottom', 'reservoir' or a Sampler instance, got {shown(sampler)}"
    )


@dataclass(slots=True)
class _OpenStep:
    selection: StepSelection
    last_seen: float


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
        self._open: dict[tuple[str, int], _OpenStep] = {}
        self._closed_upto: dict[str, int] = {}
        self._warned = False

    def is_closed(self, split: str, step: int) -> bool:
        """True when samples for this step are late."""
        closed_upto = self._closed_upto.get(split)
        return closed_upto is not None and step <= closed_upto

    def keeps(
        self, split: str, step: int, scores: Sequence[float | None], first_seq: int
    ) -> list[bool] | None:
        """Which candidates an offer made now would keep (see `StepSelection.keeps`); changes nothing.

        Within an open step a selection only gets harder to enter (a count fills up, a held
        set only improves), so a candidate refused here would be refused later too.
        """
        if self.is_closed(split, step):
            return [False] * len(scores)
        opened = self._open.get((split, step))
        if opened is not None:
            return opened.selection.keeps(scores, first_seq)
        if isinstance(self.sampler, (FirstSampler, TopBottomSampler)):
            return self.sampler.new_step(split, step, self.k).keeps(scores, first_seq)
        return None  # another sampler's new selection may cost something (a seeded RNG)

    def releasing(self, split: str, step: int) -> tuple[int, int]:
        """What an offer for (split, step) would release from the steps it closes, as (records,
        encoded bytes); changes nothing. Rows still being decoded count for nothing here: they
        go through the buffer's bound when they are filled."""
        if not self.sampler.holds:
            return 0, 0
        upto = step - self.max_open_steps - 1
        closed_upto = self._closed_upto.get(split)
        if upto < 0 or (closed_upto is not None and upto <= closed_upto):
            return 0, 0
        n = nbytes = 0
        for (sp, st), opened in self._open.items():
            if sp == split and st <= upto:
                for e in opened.selection.held():
                    if e.state != EVICTED and e.record is not None:
                        n += 1
                        nbytes += e.record.nbytes
        return n, nbytes

    def offer(self, split: str, step: int, entries: Iterable[Entry], now: float) -> GateResult:
        result = GateResult()
        entries = list(entries)
        closed_upto = self._closed_upto.get(split)
        if (closed_upto is not None and step <= closed_upto) or self._close_older(split, step, result):
            result.late = len(entries)
            for e in entries:
                e.state = EVICTED
            return result
        key = (split, step)
        opened = self._open.get(key)
        if opened is None:
            opened = self._open[key] = _OpenStep(self.sampler.new_step(split, step, self.k), now)
        opened.last_seen = now
        holds = self.sampler.holds
        for e in entries:
            kept, evicted = opened.selection.offer(e)
            if evicted is not None and evicted.state == HELD:
                evicted.state = EVICTED
                result.evicted.append(evicted)
            elif evicted is not None and evicted.state == RELEASED and not self._warned:
                # Already passed on (a sampler with holds=False keeps nothing back): it is
                # written all the same, so it must not be counted as capped too.
                self._warned = True
                logger.warning(
                    "asynctrace: sampler %s evicted a sample it had already let through "
                    "(holds=False); such samples are written anyway. A sampler that changes "
                    "its mind must set holds=True",
                    type(self.sampler).__name__,
                )
            if not kept:
                e.state = EVICTED
                result.capped += 1
            elif holds:
                result.held += 1
            else:
                e.state = RELEASED
                result.passed.append(e)
        return result

    def _close_older(self, split: str, step: int, result: GateResult) -> bool:
        """Close the steps an offer for `step` pushes out; True when `step` itself is one."""
        if self.sampler.holds:
            # Everything more than max_open_steps behind the newest step is closed, open or
            # not: a straggler for a step that far behind is late, and cannot open it again.
            upto = step - self.max_open_steps - 1
            closed_upto = self._closed_upto.get(split)
            if upto >= 0 and (closed_upto is None or upto > closed_upto):
                self._close(split, upto, result.released)
        elif len(self._open) >= COUNTER_WINDOW and (split, step) not in self._open:
            # A sampler that holds nothing needs only a counter per step, so stragglers many
            # steps behind are still capped exactly; the window just bounds the memory, per
            # split, so that a sparse split (eval) is never pushed out by a busy one (train).
            mine = [s for sp, s in self._open if sp == split]
            if len(mine) >= COUNTER_WINDOW:
                # The oldest of the split's counted steps and this one leaves the window. When
                # that is this step, its samples are late: counting it too would let stragglers
                # arriving in descending step order grow the window without bound.
                oldest = min(mine)
                self._close(split, min(oldest, step), result.released)
                return step < oldest
        return False

    def _close(self, split: str, upto: int, out: list[Entry]) -> None:
        """Close every open step of `split` up to `upto`; later samples for them are late."""
        for key in sorted(k for k in self._open if k[0] == split and k[1] <= upto):
            for e in self._open.pop(key).selection.held():
                if e.state != EVICTED:  # withdrawn (a selection that keeps their places)
                    e.state = RELEASED
                    out.append(e)
        self._closed_upto[split] = max(self._closed_upto.get(split, upto), upto)

    def withdraw(self, split: str, step: int, entries: Sequence[Entry]) -> None:
        """Give back the places of kept entries that will never be filled."""
        opened = self._open.get((split, step))
        if opened is not None and entries:
            opened.selection.withdraw(entries)

    def close_all(self, *, holding_only: bool = True) -> list[Entry]:
        """Close every open step (flush/finish). Samplers that hold nothing keep counting their caps."""
        out: list[Entry] = []
        if holding_only and not self.sampler.holds:
            return out
        for split in sorted({sp for sp, _ in self._open}):
            self._close(split, max(s for sp, s in self._open if sp == split), out)
        return out

    def close_idle(self, now: float) -> list[Entry]:
        """Close steps that saw no sample for `step_timeout` seconds."""
        out: list[Entry] = []
        if self.step_timeout is None or not self.sampler.holds:
            return out
        idle = [k for k, o in self._open.items() if now - o.last_seen >= self.step_timeout]
        for split, step in sorted(idle):
            if (split, step) in self._open:
                self._close(split, step, out)
        return out
