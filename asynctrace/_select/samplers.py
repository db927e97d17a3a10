"""Caps and samplers: which samples of one (split, step) are kept, and when a step closes."""

from __future__ import annotations

import abc
import heapq
import logging
import math
import random
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

from .._records.types import TraceRecord

__all__ = [
    "FirstSampler",
    "ReservoirSampler",
    "Sampler",
    "StepSelection",
    "TopBottomSampler",
]

logger = logging.getLogger("asynctrace")

# Steps a non-holding sampler keeps counting before the oldest is closed.
COUNTER_WINDOW = 4096

# Entry states.
HELD = 0  # kept by a sampler for an open step
EVICTED = 1  # pushed out by a better candidate: counted "capped"
RELEASED = 2  # handed on towards the buffer


class Entry:
    """A candidate sample inside a sampler. `record` is None while a reserved row is still being decoded.

    `key` is what a sampler ranked the entry by besides its score (the reservoir's random key, a
    group's random key) and travels with it when selections of several processes are merged;
    `group` is the prompt group a group sampler put it in (see `_records.groups.group_of`). `gap` counts
    the samples the cap refused (through `StepSelection.keeps`) right before this one.
    """

    __slots__ = ("gap", "group", "key", "record", "score", "seq", "state")

    def __init__(
        self,
        score: float | None,
        seq: int,
        record: TraceRecord | None = None,
        *,
        key: float | None = None,
        group: Hashable | None = None,
    ) -> None:
        self.score = score
        self.seq = seq
        self.record = record
        self.state = HELD
        self.key = key
        self.group = group
        self.gap = 0


class StepSelection(abc.ABC):
    """The selection state of one (split, step): O(k) entries at most."""

    @abc.abstractmethod
    def offer(self, entry: Entry) -> tuple[bool, Entry | None]:
        """Offer one candidate; returns (kept, evicted) where evicted is an earlier entry now dropped."""

    @abc.abstractmethod
    def held(self) -> list[Entry]:
        """Entries still held (for holding samplers), released when the step closes."""

    def offer_all(self, entries: Sequence[Entry]) -> tuple[list[bool], list[Entry]]:
        """Offer one call's candidates in order; returns which of them are kept and the entries
        (earlier ones or of this call) they pushed out. A selection that judges a call's samples
        together (the group sampler) overrides this; the default offers them one by one."""
        kept: list[bool] = []
        evicted: list[Entry] = []
        for e in entries:
            took, out = self.offer(e)
            kept.append(took)
            if out is not None:
                evicted.append(out)
        return kept, evicted

    def keeps(self, scores: Sequence[float | None], first_seq: int) -> list[bool] | None:
        """Which of these candidates, offered in order after everything offered so far (with
        sequence numbers from `first_seq`), would still be kept; None when it cannot tell
        without offering them. Must not change the selection."""
        return None

    def skip(self, n: int) -> None:
        """`n` samples `keeps` refused were passed over here (an entry's `gap` counts those right
        before it). Only a selection that counts positions (the reservoir) needs them."""
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
    #: True when `new_step` costs little, so the session may ask a step not open yet which
    #: samples it would keep (`StepSelection.keeps`) and skip encoding the others.
    starts_cheaply: bool = False

    @abc.abstractmethod
    def new_step(self, split: str, step: int, k: int) -> StepSelection:
        """Start the selection for a new step."""

    def new_part_step(self, split: str, step: int, k: int, part: int) -> StepSelection:
        """Start the selection of one part (a process, a rank) of a step whose parts are merged
        later with `merge`. A sampler that draws random numbers gives each part its own stream
        (part 0's is `new_step`'s); the default is `new_step`."""
        return self.new_step(split, step, k)

    def merge(self, split: str, step: int, k: int, parts: Sequence[Sequence[Entry]]) -> list[Entry]:
        """The step's selection from the selections of its parts, exactly what one selection
        offered every part's samples (part after part, each in its own order) would keep.

        `parts` holds, per part in order, the entries that part's own selection kept (its
        `held()` for a holding sampler, what it passed otherwise) with their `score`, `key` and
        `group` as that selection set them, in the part's arrival order. Each part's selection
        must have kept every one of its samples the whole step's selection keeps: true of the
        built-in samplers, which keep the `k` best by an order their keys and scores carry
        (first arrivals, top and bottom scores, smallest random keys, best groups). Returns the
        chosen entries in merged arrival order; their `seq` is renumbered to that order.
        """
        merged = in_merged_order(parts)
        selection = self.new_step(split, step, k)
        kept, evicted = selection.offer_all(merged)
        gone = {id(e) for e in evicted}
        return [e for e, took in zip(merged, kept, strict=True) if took and id(e) not in gone]


def in_merged_order(parts: Sequence[Sequence[Entry]]) -> list[Entry]:
    """The parts' entries, part after part, each in its own arrival order, renumbered (`seq`)
    to that merged order and held anew."""
    merged = [e for part in parts for e in sorted(part, key=lambda e: e.seq)]
    for i, e in enumerate(merged):
        e.seq = i
        e.state = HELD
    return merged


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
    starts_cheaply = True

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
        if len(self._top) == self._n_top and len(self._bottom) == self._n_bottom:
            # Both full: a score from the weakest kept high one down to the strongest kept low
            # one cannot enter (a tie loses to the earlier arrival), whatever else arrives, and
            # offering it would change nothing. The rest are few once a step is under way: they
            # are offered (and encoded) without asking which of them push each other out again.
            hi = self._top[0][0] if self._top else math.inf
            lo = -self._bottom[0][0] if self._bottom else -math.inf
            if None not in scores:
                ranked = cast("Sequence[float]", scores)
                if max(ranked) <= hi and min(ranked) >= lo:
                    return [False] * n  # the usual call: two C-level passes, no per-sample Python
            return [sc is not None and (sc > hi or sc < lo) for sc in scores]
        # Filling: offer the call to copies of the two heaps, as `offer` would (ties cannot
        # happen: the sequence numbers differ), by (score, -seq) alone, so that only what
        # the call leaves held is encoded.
        n_top, n_bottom = self._n_top, self._n_bottom
        top = [t[:2] for t in self._top]
        bottom = [t[:2] for t in self._bottom]
        push, pop = heapq.heappush, heapq.heappop
        for i, score in enumerate(scores):
            if score is None:
                continue
            push(top, (score, -(first_seq + i)))
            if len(top) <= n_top:
                continue
            down = pop(top)
            push(bottom, (-down[0], down[1]))
            if len(bottom) > n_bottom:
                pop(bottom)
        held = {t[1] for t in top} | {t[1] for t in bottom}
        return [-(first_seq + i) in held for i in range(n)]


class TopBottomSampler(Sampler):
    """Keeps the ceil(k/2) highest and floor(k/2) lowest scores of the step."""

    needs_score = True
    starts_cheaply = True

    def new_step(self, split: str, step: int, k: int) -> StepSelection:
        return _TopBottomSelection(k)


class _ReservoirSelection(StepSelection):
    # Bottom-k sampling with skip-ahead (algorithm L's jumps): every row has a uniform random key
    # and the k smallest keys are kept, which is a uniform k of the step and merges exactly
    # across processes (the k smallest of the union). Keys are drawn only for rows that enter:
    # once k rows are held with largest key `w`, the number of rows until one has a key below
    # `w` is geometric, and that row's key is uniform below `w`. So a refused row costs a
    # counter increment, no draw. Random numbers are taken from `_draws` (drawn ahead by
    # `keeps`) before the generator, so asking what would be kept never changes what is kept.
    __slots__ = ("_draws", "_full", "_heap", "_k", "_n", "_next", "_rng", "_w")

    def __init__(self, k: int, rng: random.Random) -> None:
        self._k = k
        self._n = 0  # rows offered
        self._heap: list[tuple[float, int, Entry]] = []  # (-key, -seq, entry): root = largest key
        self._rng = rng
        self._draws: deque[float] = deque()
        self._full = False  # k rows were held once: from then on rows enter by skip-ahead
        self._w = 1.0  # the threshold below which a row's key enters
        self._next = 0  # the row number (1-based) of the next row to enter, once full

    def _draw(self, i: int) -> float:
        """The i-th random number not yet used (drawn from the generator on first need)."""
        draws = self._draws
        while len(draws) <= i:
            draws.append(self._rng.random())
        return draws[i]

    @staticmethod
    def _skip(u: float, w: float) -> int:
        """Rows passed over before the next key below `w`, from a uniform `u` in [0, 1)."""
        if w >= 1.0:
            return 0
        if w <= 0.0:
            return 1 << 62
        return int(math.log(1.0 - u) / math.log1p(-w))

    def skip(self, n: int) -> None:
        self._n += n
        self._catch_up()

    def _catch_up(self) -> None:
        # The row planned to enter was passed over: only when a `keeps` raced with another
        # offer to the same step. Plan afresh from here, as algorithm L would after a skip.
        if self._full and self._next <= self._n:
            self._next = self._n + 1 + self._skip(self._draw(0), self._w)
            self._draws.popleft()

    def offer(self, entry: Entry) -> tuple[bool, Entry | None]:
        if entry.gap:
            self.skip(entry.gap)
        self._n += 1
        heap = self._heap
        if not self._full:
            key = self._draw(0)
            self._draws.popleft()
            entry.key = key
            heapq.heappush(heap, (-key, -entry.seq, entry))
            if len(heap) >= self._k:
                self._fill_done()
            return True, None
        if self._n != self._next:
            return False, None
        u = self._draw(0) * self._w
        self._draws.popleft()
        entry.key = u
        out: Entry | None = None
        if len(heap) >= self._k:
            out = heapq.heapreplace(heap, (-u, -entry.seq, entry))[2]
        else:  # a place `withdraw` freed goes to the next row that draws a key below `w`
            heapq.heappush(heap, (-u, -entry.seq, entry))
        if len(heap) >= self._k:
            self._w = -heap[0][0]
        self._next = self._n + 1 + self._skip(self._draw(0), self._w)
        self._draws.popleft()
        return True, out

    def _fill_done(self) -> None:
        self._full = True
        self._w = -self._heap[0][0] if self._heap else 1.0
        self._next = self._n + 1 + self._skip(self._draw(0), self._w)
        self._draws.popleft()

    def keeps(self, scores: Sequence[float | None], first_seq: int) -> list[bool] | None:
        n = len(scores)
        out = [False] * n
        if not self._full:
            room = self._k - len(self._heap)
            if room >= n:
                return [True] * n
            # The fill ends inside this call: the rest would be judged by keys not drawn yet.
            # Simulate on a copy that shares the drawn-ahead numbers (drawing more as needed).
            return self._simulate(n)
        last = self._n + n
        nxt = self._next
        if nxt > last:  # the usual call once the reservoir is full: no row enters
            return out
        # Jump from one entering row to the next, on a copy of the heap of negated keys (root:
        # the largest key): it draws only for those rows.
        heap = [t[0] for t in self._heap]
        w, used, room = self._w, 0, self._k - len(heap)
        while nxt <= last:
            out[nxt - self._n - 1] = True
            u = self._draw(used) * w
            used += 1
            if room > 0:
                heapq.heappush(heap, -u)
                room -= 1
                if room == 0:
                    w = -heap[0]
            else:
                heapq.heapreplace(heap, -u)
                w = -heap[0]
            nxt = nxt + 1 + self._skip(self._draw(used), w)
            used += 1
        return out

    def _simulate(self, n: int) -> list[bool]:
        sim = _ReservoirSelection(self._k, self._rng)
        sim._n, sim._full, sim._w, sim._next = self._n, self._full, self._w, self._next
        sim._heap = list(self._heap)
        # Numbers the copy draws ahead are this selection's next ones: they go to the shared queue.
        sim._draws = _SharedDraws(self._draws, self._rng)  # type: ignore[assignment]
        out = []
        for i in range(n):
            took, _ = sim.offer(Entry(None, -1 - i))
            out.append(took)
        return out

    def held(self) -> list[Entry]:
        return sorted((t[2] for t in self._heap), key=lambda e: e.seq)

    def withdraw(self, entries: Sequence[Entry]) -> None:
        # Later rows then enter at the rate they would have had were the withdrawn rows never
        # offered; the rows those displaced are gone, so a step that ends before a later row
        # draws a key below the threshold is left short of k.
        gone = {id(e) for e in entries}
        kept = [t for t in self._heap if id(t[2]) not in gone]
        removed = len(self._heap) - len(kept)
        if self._n - removed <= self._k:
            # Every row so far would have been held: the step is still filling.
            self._n -= removed
            self._full = False
        self._heap = kept
        heapq.heapify(kept)


class _SharedDraws:
    """A read-through view of a selection's drawn-ahead numbers for a simulation: popping
    advances a private cursor, and numbers it needs beyond them are drawn into the shared queue."""

    __slots__ = ("_i", "_q", "_rng")

    def __init__(self, q: deque[float], rng: random.Random) -> None:
        self._q, self._rng, self._i = q, rng, 0

    def _fill(self, i: int) -> None:
        while len(self._q) <= i:
            self._q.append(self._rng.random())

    def popleft(self) -> float:
        self._fill(self._i)
        self._i += 1
        return self._q[self._i - 1]

    def __len__(self) -> int:
        return len(self._q) - self._i

    def __getitem__(self, i: int) -> float:
        self._fill(self._i + i)
        return self._q[self._i + i]

    def append(self, x: float) -> None:
        self._q.append(x)


class ReservoirSampler(Sampler):
    """A uniform random `k` of the step (the `k` smallest of uniform random keys, drawn by
    skip-ahead only for rows that enter); seeded per (seed, split, step), so reproducible, and
    merged exactly across processes."""

    starts_cheaply = True

    def __init__(self, seed: int | None = 0) -> None:
        self.seed = seed

    def new_step(self, split: str, step: int, k: int) -> StepSelection:
        return self.new_part_step(split, step, k, 0)

    def new_part_step(self, split: str, step: int, k: int, part: int) -> StepSelection:
        # A string seed is hashed deterministically (sha512), unlike hash() of a tuple. Each
        # part draws its own keys: parts sharing a stream would keep the same rows of each.
        tail = f":{part}" if part else ""
        rng = random.Random(f"{self.seed}:{split}:{step}{tail}" if self.seed is not None else None)
        return _ReservoirSelection(k, rng)

    def merge(self, split: str, step: int, k: int, parts: Sequence[Sequence[Entry]]) -> list[Entry]:
        merged = in_merged_order(parts)
        if any(e.key is None for e in merged):
            raise ValueError("a reservoir merge needs each entry's key, as its part's selection set it")
        chosen = heapq.nsmallest(k, merged, key=lambda e: (e.key, e.seq))
        return sorted(chosen, key=lambda e: e.seq)


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
        # A selection `keeps` started for a step not open yet (one at most).
        self._fresh: dict[tuple[str, int], StepSelection] = {}

    def is_closed(self, split: str, step: int) -> bool:
        """True when samples for this step are late."""
        closed_upto = self._closed_upto.get(split)
        return closed_upto is not None and step <= closed_upto

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
        if self.is_closed(split, step):
            return [False] * len(scores)
        opened = self._open.get((split, step))
        if opened is not None:
            return self._ask(opened.selection, scores, first_seq, groups)
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
            fresh = self._fresh.pop(key, None)
            selection = fresh if fresh is not None else self.sampler.new_step(split, step, self.k)
            opened = self._open[key] = _OpenStep(selection, now)
        opened.last_seen = now
        holds = self.sampler.holds
        flags, pushed_out = opened.selection.offer_all(entries)
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

    def skip(self, split: str, step: int, n: int) -> None:
        """`n` samples of (split, step) that `keeps` refused were passed over (see `StepSelection.skip`)."""
        opened = self._open.get((split, step))
        selection = opened.selection if opened is not None else self._fresh.get((split, step))
        if selection is not None and n:
            selection.skip(n)

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
