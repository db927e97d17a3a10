"""The built-in samplers (first, top and bottom, reservoir), and every sampler by name."""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from typing import Literal

from .._security import shown
from .base import Entry, Sampler, StepSelection, in_merged_order
from .groups import GroupSampler

__all__ = [
    "FirstSampler",
    "ReservoirSampler",
    "SamplerName",
    "TopBottomSampler",
    "resolve_sampler",
    "sampler_name",
]


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
    counts_skipped = False

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
            # The usual call: two C-level passes, no per-sample Python (and no `cast`, a call).
            try:
                if max(scores) <= hi and min(scores) >= lo:  # type: ignore[type-var,operator]
                    return [False] * n
            except TypeError:  # a None among them (its sample left out as invalid)
                return [sc is not None and (sc > hi or sc < lo) for sc in scores]
            return [sc > hi or sc < lo for sc in scores]  # type: ignore[operator]
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
    counts_skipped = False

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


SamplerName = Literal["first", "top_bottom", "reservoir", "group"]
_BY_NAME: dict[str, type[Sampler]] = {
    "first": FirstSampler,
    "top_bottom": TopBottomSampler,
    "reservoir": ReservoirSampler,
    "group": GroupSampler,
}


def sampler_name(sampler: Sampler) -> str | None:
    """The built-in name that makes `sampler` again, or None (a sampler of another class, or a
    group sampler, whose arguments a name does not carry; a reservoir also needs its seed)."""
    for name, cls in _BY_NAME.items():
        if type(sampler) is cls and cls is not GroupSampler:
            return name
    return None


def resolve_sampler(sampler: SamplerName | Sampler) -> Sampler:
    """`sampler` itself, or a new built-in sampler of that name."""
    if isinstance(sampler, Sampler):
        return sampler
    if isinstance(sampler, str) and sampler in _BY_NAME:
        return _BY_NAME[sampler]()
    raise ValueError(
        "sampler must be 'first', 'top_bottom', 'reservoir', 'group' or a Sampler instance, "
        f"got {shown(sampler)}"
    )
