"""The group sampler: whole prompt groups per step, ranked by a statistic of their rewards."""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Sequence
from typing import Literal

from .._records.groups import DEFAULT_GROUP_KEYS, GroupKey, payload_group, population_spread
from .._security import shown
from .base import Entry, Sampler, StepSelection

__all__ = ["GroupPolicy", "GroupSampler", "GroupStat"]

GroupPolicy = Literal["top_bottom", "top", "bottom", "first", "random"]
GroupStat = Literal["mean", "spread"]
_POLICIES: tuple[str, ...] = ("top_bottom", "top", "bottom", "first", "random")
_STATS: tuple[str, ...] = ("mean", "spread")


class _Group:
    __slots__ = ("entries", "first", "rkey", "scores")

    def __init__(self, first: int, rkey: float) -> None:
        self.entries: list[Entry] = []
        self.scores: list[float] = []
        self.first = first  # sequence number of its first sample: "first" ranks by it
        self.rkey = rkey  # its random key: "random" keeps the smallest


def _stat(scores: Sequence[float], stat: GroupStat) -> float:
    if stat == "mean":
        return math.fsum(scores) / len(scores) if scores else 0.0
    return population_spread(scores)


class _GroupSelection(StepSelection):
    # A group is judged on the samples it has when a call brings them; a group the selection
    # turns away stays turned away (its later samples are capped), so the selection only gets
    # harder to enter, as `keeps` needs. Groups are taken in rank order while they fit the
    # budget; the first that does not fit ends the pick (a prefix, so that adding a group can
    # only push others out, and each process's pick holds every group of its own that the
    # whole step's pick keeps: merging stays exact).
    __slots__ = ("_held", "_k", "_refused", "_rng", "_sampler")

    def __init__(self, sampler: GroupSampler, k: int, rng: random.Random) -> None:
        self._sampler = sampler
        self._k = k
        self._rng = rng
        self._held: dict[Hashable, _Group] = {}
        self._refused: set[Hashable] = set()

    def _group_key(self, e: Entry) -> Hashable:
        if e.group is None and e.record is not None:
            e.group = payload_group(e.record.payload, self._sampler.key)
        # A sample that names no group is a group of its own.
        return e.group if e.group is not None else ("asynctrace.single", e.seq)

    def _size(self, n: int) -> int:
        return n if self._sampler.count == "samples" else 1

    def _pick(self, groups: dict[Hashable, tuple[int, float, float, int]]) -> set[Hashable]:
        """The groups kept among `groups`: name -> (samples, statistic, random key, first seq)."""
        policy, k = self._sampler.policy, self._k

        def prefix(order: list[Hashable], budget: int) -> list[Hashable]:
            out, used = [], 0
            for g in order:
                used += self._size(groups[g][0])
                if used > budget:
                    break
                out.append(g)
            return out

        names = list(groups)
        if policy == "first":
            return set(prefix(sorted(names, key=lambda g: groups[g][3]), k))
        if policy == "random":
            return set(prefix(sorted(names, key=lambda g: (groups[g][2], groups[g][3])), k))
        high = sorted(names, key=lambda g: (-groups[g][1], groups[g][3]))
        low = sorted(names, key=lambda g: (groups[g][1], groups[g][3]))
        if policy == "top":
            return set(prefix(high, k))
        if policy == "bottom":
            return set(prefix(low, k))
        top = set(prefix(high, -(-k // 2)))
        return top | set(prefix([g for g in low if g not in top], k // 2))

    def _plan(
        self, keyed: Sequence[tuple[Hashable, float | None, int]]
    ) -> tuple[dict[Hashable, tuple[int, float, float, int]], dict[Hashable, list[float]]]:
        """The candidate groups after adding samples (group, score, seq): held groups with
        their new samples and groups new to the step (refused ones are left out)."""
        stat = self._sampler.stat
        added: dict[Hashable, list[float]] = {}
        firsts: dict[Hashable, int] = {}
        refused = self._refused
        for g, score, seq in keyed:
            if g in refused:
                continue
            scores = added.get(g)
            if scores is None:
                scores = added[g] = []
                firsts[g] = seq
            scores.append(0.0 if score is None else score)
        cands: dict[Hashable, tuple[int, float, float, int]] = {}
        for g, held in self._held.items():
            more = added.pop(g, None)
            scores = held.scores + more if more else held.scores
            cands[g] = (len(scores), _stat(scores, stat), held.rkey, held.first)
        for g, scores in added.items():
            cands[g] = (len(scores), _stat(scores, stat), math.inf, firsts[g])
        return cands, added

    def keeps(
        self,
        scores: Sequence[float | None],
        first_seq: int,
        groups: Sequence[Hashable | None] | None = None,
    ) -> list[bool] | None:
        if groups is None or self._sampler.policy == "random":
            return None  # the group of each sample (and a random group's key) is needed first
        keyed = [
            (g if g is not None else ("asynctrace.single", first_seq + i), s, first_seq + i)
            for i, (g, s) in enumerate(zip(groups, scores, strict=True))
        ]
        cands, _ = self._plan(keyed)
        picked = self._pick(cands)
        return [t[0] in picked for t in keyed]

    def offer(self, entry: Entry) -> tuple[bool, Entry | None]:
        raise NotImplementedError("the group sampler takes a call's samples together (offer_all)")

    def offer_all(self, entries: Sequence[Entry]) -> tuple[list[bool], list[Entry]]:
        keyed = [(self._group_key(e), e.score, e.seq) for e in entries]
        cands, added = self._plan(keyed)
        carried: dict[Hashable, float] = {}
        for e, (g, _, _) in zip(entries, keyed, strict=True):
            if g in added and e.key is not None:
                carried.setdefault(g, e.key)
        for g in added:
            # A random key per group, drawn once (or carried from the part that drew it).
            n, value, _, first = cands[g]
            key = carried.get(g)
            cands[g] = (n, value, key if key is not None else self._rng.random(), first)
        picked = self._pick(cands)
        evicted: list[Entry] = []
        for g in [g for g in self._held if g not in picked]:
            evicted.extend(self._held.pop(g).entries)
            self._refused.add(g)
        kept: list[bool] = []
        for e, (g, score, _) in zip(entries, keyed, strict=True):
            if g not in picked:
                self._refused.add(g)
                kept.append(False)
                continue
            group = self._held.get(g)
            if group is None:
                group = self._held[g] = _Group(cands[g][3], cands[g][2])
            e.key = group.rkey
            group.entries.append(e)
            group.scores.append(0.0 if score is None else score)
            kept.append(True)
        return kept, evicted

    def held(self) -> list[Entry]:
        return sorted((e for g in self._held.values() for e in g.entries), key=lambda e: e.seq)

    def withdraw(self, entries: Sequence[Entry]) -> None:
        gone = {id(e) for e in entries}
        for name in list(self._held):
            group = self._held[name]
            pairs = [(e, s) for e, s in zip(group.entries, group.scores, strict=True) if id(e) not in gone]
            group.entries = [e for e, _ in pairs]
            group.scores = [s for _, s in pairs]
            if not group.entries:
                del self._held[name]


class GroupSampler(Sampler):
    """Keeps whole prompt groups per step: every sample of the chosen groups, none of the others.

    The group of a sample comes from its metadata (`key`: by default ``group_uid``, else
    ``prompt_index``; see `asynctrace.group_of`). Groups are ranked by `stat` of their rewards
    (``"mean"``, or ``"spread"``: the population standard deviation) for the ``"top"``,
    ``"bottom"`` and ``"top_bottom"`` policies (half the cap each way), by arrival for
    ``"first"`` and by a seeded random key for ``"random"``. The cap counts samples
    (``count="samples"``) or groups (``count="groups"``); groups are taken in rank order while
    they fit, so with ``count="samples"`` choose a cap that is a multiple of the group size.
    A group is ranked on the samples it has when a call brings them: log each group in one call.
    """

    holds = True
    starts_cheaply = True

    def __init__(
        self,
        policy: GroupPolicy = "top_bottom",
        *,
        stat: GroupStat = "mean",
        key: GroupKey = DEFAULT_GROUP_KEYS,
        count: Literal["samples", "groups"] = "samples",
        seed: int | None = 0,
    ) -> None:
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {shown(policy)}")
        if stat not in _STATS:
            raise ValueError(f"stat must be one of {_STATS}, got {shown(stat)}")
        if count not in ("samples", "groups"):
            raise ValueError(f"count must be 'samples' or 'groups', got {shown(count)}")
        if not (callable(key) or isinstance(key, str) or (isinstance(key, Sequence) and key)):
            raise ValueError(
                f"key must be a metadata key name, a sequence of them or a function, got {shown(key)}"
            )
        self.policy: GroupPolicy = policy
        self.stat: GroupStat = stat
        self.key: GroupKey = key
        self.count = count
        self.seed = seed
        self.needs_score = policy in ("top_bottom", "top", "bottom")

    @property
    def group_key(self) -> GroupKey:
        """How a sample's group is read from its metadata (the session reads it before encoding)."""
        return self.key

    def new_step(self, split: str, step: int, k: int) -> StepSelection:
        return self.new_part_step(split, step, k, 0)

    def new_part_step(self, split: str, step: int, k: int, part: int) -> StepSelection:
        tail = f":{part}" if part else ""
        rng = random.Random(f"{self.seed}:{split}:{step}:groups{tail}" if self.seed is not None else None)
        return _GroupSelection(self, k, rng)
