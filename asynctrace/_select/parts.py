"""Selecting a step in parts and merging them: the one mechanism of the distributed and Ray paths.

A process (a rank, a Ray actor) is a part of each step: it selects its own samples with
`Sampler.new_part_step` and hands on only what its selection kept, each entry with its payload,
score, sequence number and key. Whoever writes merges the parts with `Sampler.merge`, which
chooses exactly what one selection offered every part's samples would keep.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from .._records.groups import GroupKey, payload_group
from .._records.types import TraceRecord
from .base import Entry, Sampler, StepSelection
from .watch import WatchCounter

__all__ = ["ROUND_STRIDE", "PartStep", "PartSteps", "Row", "grant_watched", "group_key_of", "merge_parts"]

# What travels for one kept entry: (sequence number, score, key).
Row = tuple[int, float | None, float | None]

# Round r of part p is part p + r * ROUND_STRIDE (see `PartSteps` with `reopen`): a part number
# of its own, so a sampler that draws gives it its own stream, and the merge orders it after
# the earlier rounds.
ROUND_STRIDE = 1 << 32
# How many ended steps remember their rounds (a step seen again after that starts at round 0).
_ROUNDS_KEPT = 4096


def group_key_of(sampler: Sampler) -> GroupKey | None:
    """How the sampler reads a sample's group (a group sampler's `group_key`); None for the others."""
    key: GroupKey | None = getattr(sampler, "group_key", None)
    return key


class PartStep:
    """One part's selection of one (split, step): O(k) entries at most, with their payloads;
    `part` is the part number it selects as.
    `watched`: the samples this part's watch list passed by the selection (see `grant_watched`)."""

    __slots__ = ("kept", "nbytes", "offered", "part", "selection", "watched")

    def __init__(self, selection: StepSelection, part: int = 0) -> None:
        self.selection = selection
        self.part = part
        self.kept: dict[int, tuple[Entry, bytes]] = {}  # by sequence number, in arrival order
        self.watched: list[tuple[Entry, bytes]] = []  # in arrival order
        self.offered = 0
        self.nbytes = 0

    def offer(self, cands: Sequence[tuple[Entry, bytes]]) -> int:
        """Offer new candidates to the selection; returns how many samples it cut."""
        self.offered += len(cands)
        flags, evicted = self.selection.offer_all([e for e, _ in cands])
        cut = 0
        for (e, payload), took in zip(cands, flags, strict=True):
            if took:
                self.kept[e.seq] = (e, payload)
                self.nbytes += len(payload)
            else:
                cut += 1
        for e in evicted:
            out = self.kept.pop(e.seq, None)
            if out is not None:
                cut += 1
                self.nbytes -= len(out[1])
        return cut

    def take(self, seqs: Sequence[int]) -> list[tuple[Entry, bytes]]:
        """Remove and return these kept entries (a sampler that holds nothing passes them on at once)."""
        out = [self.kept.pop(seq) for seq in seqs]
        self.nbytes -= sum(len(p) for _, p in out)
        return out

    def rows(self) -> list[tuple[Entry, bytes]]:
        """The kept entries with their payloads, in arrival order."""
        return [self.kept[seq] for seq in sorted(self.kept)]

    @property
    def held(self) -> int:
        """The samples this part holds for the step: kept and watched."""
        return len(self.kept) + len(self.watched)


def grant_watched(
    counter: WatchCounter,
    sampler: Sampler,
    split: str,
    step: int,
    k: int,
    parts: Sequence[tuple[int, Sequence[tuple[Entry, bytes]], Sequence[tuple[Entry, bytes]]]],
) -> tuple[list[bytes], list[list[tuple[Entry, bytes]]]]:
    """The watched samples of a step whose places the step's watch cap (`counter`) still has,
    and each part's candidates for the merge.

    `parts` holds, in part order, (part number, what its selection kept, what its watch list
    passed by), each in the part's arrival order and numbered (`seq`) in one sequence with its
    kept entries. Places are taken part after part, each part's watched samples in arrival
    order: the order one process offered every part's samples in. A part's watched samples left
    without a place go on to the cap as any of its samples would: a selection of their own (a
    part number no process uses, so a sampler that draws gives them their own stream) keeps
    what the step could take of them, and they join that part's candidates in arrival order.
    """
    granted: list[bytes] = []
    out: list[list[tuple[Entry, bytes]]] = []
    for part, cands, watched in parts:
        ordered = sorted(watched, key=lambda c: c[0].seq)
        n = counter.take(split, step, len(ordered)) if ordered else 0
        granted.extend(payload for _, payload in ordered[:n])
        rest = ordered[n:]
        if rest:
            extra = PartStep(sampler.new_part_step(split, step, k, -1 - part))
            extra.offer(rest)
            cands = [*cands, *extra.rows()]
        out.append(list(cands))
    return granted, out


def merge_parts(
    sampler: Sampler, split: str, step: int, k: int, parts: Sequence[Sequence[tuple[Entry, bytes]]]
) -> list[bytes]:
    """The payloads the sampler's merge chooses from the parts (given in part order), in merged order.

    Each entry must carry what its part's selection set: `score`, `seq`, `key`, and `group` for
    a group sampler (`payload_group` reads it again from the payload).
    """
    payload_of = {id(e): p for part in parts for e, p in part}
    chosen = sampler.merge(split, step, k, [[e for e, _ in part] for part in parts])
    return [payload_of[id(e)] for e in chosen]


class PartSteps:
    """One part's open selections of every (split, step), and the steps it has ended, with the
    entries (`held`) and payload bytes (`held_bytes`) they keep.

    Each part of a step selects with its own stream (`new_part_step` with `part`). A step ended
    here takes no more samples: a later one is ``late``, as a second selection of the same step
    would break the cap. With `reopen`, a later one starts a new round of the step instead, a
    part of its own (see `ROUND_STRIDE`), so ending a step early costs bytes, never exactness.
    Not thread-safe: the owner holds its lock.
    """

    def __init__(self, sampler: Sampler, k: int, part: int, *, reopen: bool = False) -> None:
        self.sampler, self.k, self.part = sampler, k, part
        self.group_key = group_key_of(sampler)
        self.open: dict[tuple[str, int], PartStep] = {}
        self.held = 0
        self.held_bytes = 0
        self._ended_all = -1
        self._ended: dict[str, int] = {}
        self._reopen = reopen
        self._rounds: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._seq = 0

    def is_ended(self, split: str, step: int) -> bool:
        """Whether `step` of `split` was ended here for good, so a sample for it is late (never
        with `reopen`)."""
        return step <= max(self._ended_all, self._ended.get(split, -1))

    def offer(
        self,
        split: str,
        step: int,
        encoded: Sequence[tuple[bytes, float | None]],
        now: float = 0.0,
        watched: Collection[int] = (),
    ) -> tuple[int, int, int]:
        """Offer one call's (payload, score) pairs; returns how many are kept for now, cut, and late.

        The pairs at the positions in `watched` (the watch list's) are held past the selection,
        numbered in one sequence with the others, for `grant_watched` where the parts meet."""
        if self.is_ended(split, step):
            return 0, 0, len(encoded)
        key = (split, step)
        opened = self.open.get(key)
        if opened is None:
            part = self.part + self._rounds.get(key, 0) * ROUND_STRIDE
            selection = self.sampler.new_part_step(split, step, self.k, part)
            opened = self.open[key] = PartStep(selection, part)
        before, before_bytes = len(opened.kept), opened.nbytes
        cands = []
        passed = 0
        for i, (payload, score) in enumerate(encoded):
            self._seq += 1
            # The record lets a custom selection read the sample itself, as inside a session.
            record = TraceRecord("", step, split, "", payload, now, score)
            group = payload_group(payload, self.group_key)
            entry = Entry(score, self._seq, record, group=group)
            if i in watched:
                opened.watched.append((entry, payload))
                passed += len(payload)
            else:
                cands.append((entry, payload))
        cut = opened.offer(cands) if cands else 0
        n_watched = len(encoded) - len(cands)
        self.held += len(opened.kept) - before + n_watched
        self.held_bytes += opened.nbytes - before_bytes + passed
        return sum(1 for e, _ in cands if e.seq in opened.kept) + n_watched, cut, 0

    def take(self, key: tuple[str, int]) -> list[tuple[Entry, bytes]]:
        """Remove and return what the open step `key` kept so far; the step stays open (a sampler
        that holds nothing passes its picks on at once)."""
        opened = self.open[key]
        out = opened.take(list(opened.kept))
        self.held -= len(out)
        self.held_bytes -= sum(len(p) for _, p in out)
        return out

    def end_keys(self, keys: Iterable[tuple[str, int]]) -> list[tuple[tuple[str, int], PartStep]]:
        """Remove and return these open steps, in order (with `reopen`, each starts a new round
        when it is seen again)."""
        out = [(key, self.open.pop(key)) for key in sorted(keys)]
        self.held -= sum(opened.held for _, opened in out)
        self.held_bytes -= sum(opened.nbytes + sum(len(p) for _, p in opened.watched) for _, opened in out)
        if self._reopen:
            for key, _ in out:
                self._rounds[key] = self._rounds.get(key, 0) + 1
                self._rounds.move_to_end(key)
                if len(self._rounds) > _ROUNDS_KEPT:
                    self._rounds.popitem(last=False)
        return out

    def end(self, step: int | None, split: str | None) -> list[tuple[tuple[str, int], PartStep]]:
        """Remove and return the open steps up to `step` (every one when None) of `split` (or all)."""
        out = self.end_keys(
            k for k in self.open if (step is None or k[1] <= step) and (split is None or k[0] == split)
        )
        if self._reopen:
            return out
        if step is not None:
            if split is None:
                self._ended_all = max(self._ended_all, step)
            else:
                self._ended[split] = max(self._ended.get(split, -1), step)
        else:
            # Ending every open step (flush, finish) makes each final too.
            for (key_split, key_step), _ in out:
                self._ended[key_split] = max(self._ended.get(key_split, -1), key_step)
        return out
