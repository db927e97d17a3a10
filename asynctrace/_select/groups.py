"""The group sampler: whole prompt groups per step, ranked by a statistic of their rewards.

The rule (docs/choosing.md "whole groups"): when a step closes, its groups are put in the
policy's order and taken in that order while each fits what is left of the cap; a group that
does not fit is skipped whole and the next ones are tried. Until then a selection holds every
sample whose group could still be taken, and refuses (or drops whole) only groups that can
never be: a group larger than the cap, and, where a group's rank is fixed when it first
arrives ("first" and "random" with ``count="groups"``), groups behind `k` others.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
from collections.abc import Hashable, Iterable, Sequence
from typing import Literal

import orjson

from .._records.groups import DEFAULT_GROUP_KEYS, GroupKey, payload_group, population_spread
from .._security import logger, shown
from .base import Entry, Sampler, StepSelection, in_merged_order

__all__ = ["GroupPolicy", "GroupSampler", "GroupStat", "group_random_key"]


GroupPolicy = Literal["top_bottom", "top", "bottom", "first", "random"]
GroupStat = Literal["mean", "spread"]
_POLICIES: tuple[str, ...] = ("top_bottom", "top", "bottom", "first", "random")
_STATS: tuple[str, ...] = ("mean", "spread")
_SINGLE = "asynctrace.single"  # a sample that names no group is a group of its own
# Samples a selection without `group_size` may hold for one step before a warning suggests it.
_HOLDING_WARNING = 1024


def _canonical(group: Hashable) -> bytes:
    """The same bytes for the same group id in every process: the JSON the payload carries
    (a tuple is the array it was read from), else its type and repr."""
    try:
        return orjson.dumps(group, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:
        return f"{type(group).__qualname__}:{group!r}".encode()


def group_random_key(seed: int | str, split: str, step: int, group: Hashable) -> float:
    """A group's random key in [0, 1): a stable hash (blake2b) of the seed, split, step and the
    group id, so every process, rank and actor ranks a group alike (never the salted `hash`)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{seed}\x00{split}\x00{step}\x00".encode())
    digest.update(_canonical(group))
    return int.from_bytes(digest.digest(), "big") / 2.0**64


class _Group:
    __slots__ = ("entries", "first", "rkey", "scores")

    def __init__(self, first: int, rkey: float) -> None:
        self.entries: list[Entry] = []
        self.scores: list[float] = []  # each entry's score (0.0 for none), kept beside it
        self.first = first  # arrival index of its first sample in the step: "first" ranks by it
        self.rkey = rkey  # its random key: "random" takes the smallest first


def _is_single(g: Hashable) -> bool:
    return isinstance(g, tuple) and len(g) == 2 and g[0] == _SINGLE


def _stat(scores: Sequence[float], stat: GroupStat) -> float:
    if stat == "mean":
        return math.fsum(scores) / len(scores) if scores else 0.0
    return population_spread(scores)


def _order(policy: GroupPolicy, cands: dict[Hashable, tuple[float, float, int]]) -> list[Hashable]:
    """The groups in the order the policy takes them; `cands`: name -> (statistic, random key, first)."""
    names = list(cands)
    if policy == "first":
        return sorted(names, key=lambda g: cands[g][2])
    if policy == "random":
        return sorted(names, key=lambda g: (cands[g][1], cands[g][2]))
    high = sorted(names, key=lambda g: (-cands[g][0], cands[g][2]))
    if policy == "top":
        return high
    low = sorted(names, key=lambda g: (cands[g][0], cands[g][2]))
    if policy == "bottom":
        return low
    # top_bottom: the best group not placed yet, then the worst not placed yet, and so on.
    out: list[Hashable] = []
    placed: set[Hashable] = set()
    hi = lo = 0
    while len(out) < len(names):
        for side in (high, low):
            i = hi if side is high else lo
            while i < len(side) and side[i] in placed:
                i += 1
            if i < len(side):
                out.append(side[i])
                placed.add(side[i])
                i += 1
            if side is high:
                hi = i
            else:
                lo = i
    return out


def _behind_front(
    policy: GroupPolicy, front: Sequence[tuple[float, float, int]], c: tuple[float, float, int]
) -> bool:
    """Whether a group (statistic, random key, first arrival) falls behind a full `front` of
    complete groups, the policy's first ``len(front)``: True only when that is certain."""
    value, rkey, first = c
    if policy == "first":
        return all(f[2] < first for f in front)
    if policy == "random":
        return all((f[1], f[2]) < (rkey, first) for f in front)
    if policy == "top":
        return all((-f[0], f[2]) < (-value, first) for f in front)
    if policy == "bottom":
        return all((f[0], f[2]) < (value, first) for f in front)
    # top_bottom: with no tie on the statistic, the high order is the low one reversed, so the
    # group is reached at pick 2*above from the top or 2*below+1 from the bottom.
    above = below = 0
    for f in front:
        if f[0] > value:
            above += 1
        elif f[0] < value:
            below += 1
        else:
            return False  # a tie: the full order decides
    slots = len(front)
    return 2 * above >= slots and 2 * below + 1 >= slots


class _GroupSelection(StepSelection):
    __slots__ = (
        "_complete",
        "_held",
        "_k",
        "_n",
        "_part",
        "_refused",
        "_sampler",
        "_singles",
        "_split",
        "_step",
    )

    def __init__(self, sampler: GroupSampler, k: int, split: str, step: int, *, part: bool) -> None:
        self._sampler = sampler
        self._k = k
        self._split = split
        self._step = step
        # A part's selection (one process of a step merged later) refuses early only what no
        # other part can change: it cannot know where other parts' groups come first.
        self._part = part
        self._held: dict[Hashable, _Group] = {}
        self._refused: set[Hashable] = set()
        # With `group_size`: the held groups that have at least that many samples, each as
        # (statistic, random key, first arrival), the statistic final once a group is complete,
        # so that a call looks only at its own groups and these, never at every held sample.
        self._complete: dict[Hashable, tuple[float, float, int]] = {}
        self._n = 0  # samples offered: orders groups by their first arrival
        # Group-less samples offered: names each (never refused early, so the session's
        # precheck and encode-first paths, and a merge, number them alike).
        self._singles = 0

    # -- what a group is -------------------------------------------------------------------------

    def _groups_of(self, entries: Sequence[Entry]) -> list[Hashable]:
        out: list[Hashable] = []
        singles = self._singles
        for e in entries:
            if e.group is None and e.record is not None:
                e.group = payload_group(e.record.payload, self._sampler.key)
            if e.group is None:
                singles += 1
                out.append((_SINGLE, singles))
            else:
                out.append(e.group)
        return out

    def _rkey(self, g: Hashable, carried: float | None) -> float:
        if self._sampler.policy != "random":
            return 0.0
        if self._sampler.seed is None and carried is not None:
            return carried  # drawn by the part that first held the group (its own session seed)
        return group_random_key(self._sampler.run_seed, self._split, self._step, g)

    def _size(self, n: int) -> int:
        return n if self._sampler.count == "samples" else 1

    def _ranked_early(self) -> bool:
        """True when a group's place is fixed on arrival, so groups behind `k` others are out."""
        sampler = self._sampler
        if sampler.count != "groups":
            return False
        if sampler.policy == "first":
            return not self._part
        return sampler.policy == "random" and not (self._part and sampler.seed is None)

    def _note(self, g: Hashable) -> None:
        """Keep `_complete` in step with held group `g` (after it changed)."""
        gs = self._sampler.group_size
        group = self._held.get(g)
        if gs is None or group is None or len(group.entries) < gs or _is_single(g):
            self._complete.pop(g, None)
        else:
            self._complete[g] = (self._value(group.scores), group.rkey, group.first)

    def _value(self, scores: Sequence[float | None]) -> float:
        """A group's statistic, where the policy ranks by one."""
        if not self._sampler.needs_score:
            return 0.0
        if None in scores:
            scores = [0.0 if x is None else x for x in scores]
        return _stat(scores, self._sampler.stat)  # type: ignore[arg-type]

    # -- deciding --------------------------------------------------------------------------------

    def _plan(
        self,
        names: Sequence[Hashable],
        scores: Sequence[float | None],
        carried: Sequence[float | None] | None = None,
    ) -> tuple[set[Hashable], dict[Hashable, _Group], dict[Hashable, int]]:
        """The groups that can never be taken once these samples (each one's group, score and
        carried random key) join the held ones, the groups new to the step, and the size of
        each group of the call: changes nothing. Looks at the call's groups and, with
        `group_size`, the complete ones, never at every held sample."""
        held, refused = self._held, self._refused
        added: dict[Hashable, list[float | None]] = {}
        for g, score in zip(names, scores, strict=True):
            if g in refused:
                continue
            got = added.get(g)
            if got is None:
                added[g] = [score]
            else:
                got.append(score)
        new: dict[Hashable, _Group] = {}
        sizes: dict[Hashable, int] = {}
        for g, got in added.items():
            group = held.get(g)
            if group is None:
                i = names.index(g)  # its first sample's place in the call orders it ("first")
                new[g] = _Group(self._n + i + 1, self._rkey(g, None if carried is None else carried[i]))
                sizes[g] = len(got)
            else:
                sizes[g] = len(got) + len(group.entries)
        k = self._k
        # A part keeps a group larger than the cap: the merge must see every sample of it to
        # know the group is too large (another part's share of it may fit on its own).
        if self._part:
            out: set[Hashable] = set()
        elif self._sampler.count == "samples":
            out = {g for g, size in sizes.items() if size > k}
        else:
            out = set()  # a group counts 1
        if self._ranked_early():
            out |= self._behind(new, out)
        if self._sampler.group_size is not None and added:
            out |= self._settled_out(added, sizes, new, out)
        return out, new, sizes

    def _behind(self, new: dict[Hashable, _Group], out: set[Hashable]) -> set[Hashable]:
        """Groups whose place is fixed on arrival behind `k` others ("first", "random" with
        ``count="groups"``). Held groups beyond the first `k` were let go, so only the held
        ones and the call's new ones are looked at."""
        live = {
            g: group
            for g, group in itertools.chain(self._held.items(), new.items())
            if g not in out and not _is_single(g)
        }
        if len(live) <= self._k:
            return set()
        cands = {g: (0.0, group.rkey, group.first) for g, group in live.items()}
        return set(_order(self._sampler.policy, cands)[self._k :])

    def _settled_out(
        self,
        added: dict[Hashable, list[float | None]],
        sizes: dict[Hashable, int],
        new: dict[Hashable, _Group],
        out: set[Hashable],
    ) -> set[Hashable]:
        """Groups with `group_size` samples or more that can never be taken.

        A complete group (exactly `group_size` samples) is ranked for good. Each complete group
        placed before another group is either taken (using `group_size`) or skipped because
        less than that was left, so a group placed after `slots` complete ones (`k // group_size`,
        with ``count="groups"`` `k`) cannot fit. Over complete groups only, the policy's first
        `slots` (its front) are the only ones that can still be taken: a group that arrives
        later never moves one of them ahead, and one out of the front never comes back, so the
        front is computed over the held front and the call's groups alone. For
        ``"top_bottom"`` this is exact while every group has `group_size` samples (the
        alternation of the others changes when a smaller group takes its turn, see
        docs/choosing.md); for the other policies a group's place among complete ones is fixed
        by its own key, so it holds whatever the sizes. Leaving a group out changes no other
        group's fate: a group not taken uses none of the cap.
        """
        sampler = self._sampler
        gs = sampler.group_size
        assert gs is not None
        policy = sampler.policy
        if policy == "random" and self._part and sampler.seed is None:
            return set()  # keys drawn per part: another part may rank a group differently
        held = self._held
        # Every group with at least `group_size` samples once the call joins, as (statistic,
        # random key, first arrival): the call's own, and the held ones it does not touch.
        full = {g: c for g, c in self._complete.items() if g not in added}
        over: list[Hashable] = []  # more samples than `group_size` promised
        for g, got in added.items():
            size = sizes[g]
            if size < gs or g in out or _is_single(g):
                continue
            group = held.get(g)
            if group is None:
                group = new[g]
                value = self._value(got)
            else:
                value = self._value(group.scores + got)
            full[g] = (value, group.rkey, group.first)
            if size > gs:
                over.append(g)
        for g in full:
            if g not in added and len(held[g].entries) > gs:
                over.append(g)
        if not full:
            return set()
        slots = self._k // gs if sampler.count == "samples" else self._k
        if slots == 0:
            return set(full)  # `group_size` samples already exceed the cap
        counted = {g: c for g, c in full.items() if g not in over} if over else full
        if len(counted) <= slots and not over:
            return set()
        if not over:
            # The usual call: the held front is full and each of the call's complete groups,
            # set against it alone, falls behind it; then together they do too (a group never
            # moves another ahead), and the front stays as it is.
            base = [c for g, c in counted.items() if g not in added]
            if len(base) == slots:
                fresh = [g for g in counted if g in added]
                if all(_behind_front(policy, base, counted[g]) for g in fresh):
                    return set(fresh)
        front = _order(policy, counted)[:slots]
        settled = {g for g in counted if g not in front}
        if over and len(front) == slots:
            # A group with more samples than promised: out when placed after `slots` complete ones.
            fronted = {g: counted[g] for g in front}
            for g in over:
                if _order(policy, {**fronted, g: full[g]}).index(g) >= slots:
                    settled.add(g)
        return settled

    def keeps(
        self,
        scores: Sequence[float | None],
        first_seq: int,
        groups: Sequence[Hashable | None] | None = None,
    ) -> list[bool] | None:
        if groups is None:
            return None  # the group of each sample is needed first
        names: Sequence[Hashable] = groups
        if None in groups:
            singles = self._singles
            named: list[Hashable] = []
            for g in groups:
                if g is None:
                    singles += 1
                    g = (_SINGLE, singles)
                named.append(g)
            names = named
        out, _, sizes = self._plan(names, scores)
        held, k, count = self._held, self._k, self._sampler.count
        # Refused without offering: only what offering would change nothing about. A group the
        # call makes larger than the cap is offered, so that it is dropped whole (held) and its
        # later samples are refused by name (new): its size is known only to the selection.
        keep = {
            g: g not in out or g in held or (count == "samples" and size > k) for g, size in sizes.items()
        }
        # A group of the call that is not in `sizes` was refused before.
        return [keep.get(g, False) for g in names]

    def offer(self, entry: Entry) -> tuple[bool, Entry | None]:
        raise NotImplementedError("the group sampler takes a call's samples together (offer_all)")

    def offer_all(self, entries: Sequence[Entry]) -> tuple[list[bool], list[Entry]]:
        names = self._groups_of(entries)
        scores = [e.score for e in entries]
        out, new, sizes = self._plan(names, scores, [e.key for e in entries])
        self._n += len(entries)
        self._singles += sum(1 for g in names if _is_single(g))
        held, refused = self._held, self._refused
        evicted: list[Entry] = []
        for g in out:
            group = held.pop(g, None)
            if group is not None:
                evicted.extend(group.entries)
            self._complete.pop(g, None)
            refused.add(g)
        kept: list[bool] = []
        random = self._sampler.policy == "random"
        for e, g, score in zip(entries, names, scores, strict=True):
            if g in refused:
                kept.append(False)
                continue
            group = held.get(g)
            if group is None:
                group = held[g] = new[g]
            if random:
                e.key = group.rkey
            group.entries.append(e)
            group.scores.append(0.0 if score is None else score)
            kept.append(True)
        sampler = self._sampler
        if sampler.group_size is not None:
            for g in sizes:
                if g not in out:
                    self._note(g)
        self._warn(out, sizes)
        if (
            sampler.group_size is None
            and not sampler.warned_holding
            and self._n > max(_HOLDING_WARNING, 64 * self._k)
        ):
            n_held = sum(len(g.entries) for g in held.values())
            if n_held > max(_HOLDING_WARNING, 64 * self._k):
                sampler.warn_holding(n_held, self._step)
        return kept, evicted

    def _warn(self, out: Iterable[Hashable], sizes: dict[Hashable, int]) -> None:
        over = [sizes[g] for g in out if g in sizes and self._size(sizes[g]) > self._k]
        if over:
            self._sampler.warn_oversized(max(over), self._k)

    def _pick(self) -> set[Hashable]:
        stat, k = self._sampler.stat, self._k
        sizes = {g: len(held.entries) for g, held in self._held.items()}
        self._warn(sizes, sizes)
        # A group larger than the cap is never written, nor ranked (a part holds them).
        cands = {
            g: (_stat(held.scores, stat), held.rkey, held.first)
            for g, held in self._held.items()
            if self._size(sizes[g]) <= k
        }
        picked: set[Hashable] = set()
        left = k
        for g in _order(self._sampler.policy, cands):
            size = self._size(sizes[g])
            if size <= left:
                picked.add(g)
                left -= size
        return picked

    def _regroup(self) -> list[Entry]:
        """Put rows offered before their sample existed (`log_rollouts` reserves places by reward,
        then decodes) in the groups their samples name; returns those of refused groups."""
        gone: list[Entry] = []
        for name in [g for g in self._held if _is_single(g)]:
            single = self._held[name]
            e = single.entries[0] if single.entries else None
            if e is None or e.group is not None or e.record is None:
                continue
            real = payload_group(e.record.payload, self._sampler.key)
            if real is None:
                continue
            del self._held[name]
            e.group = real
            if real in self._refused:
                gone.append(e)
                continue
            group = self._held.get(real)
            if group is None:
                group = self._held[real] = _Group(single.first, self._rkey(real, None))
            group.first = min(group.first, single.first)
            group.entries.append(e)
            group.scores.append(single.scores[0])
        return gone

    def close(self) -> tuple[list[Entry], list[Entry]]:
        gone = self._regroup()
        picked = self._pick()
        chosen = [e for g, held in self._held.items() if g in picked for e in held.entries]
        dropped = [e for g, held in self._held.items() if g not in picked for e in held.entries]
        return sorted(chosen, key=lambda e: e.seq), dropped + gone

    def held(self) -> list[Entry]:
        # Every candidate: what a part ships to the merge (`close` decides which are written).
        return sorted((e for g in self._held.values() for e in g.entries), key=lambda e: e.seq)

    def withdraw(self, entries: Sequence[Entry]) -> None:
        gone = {id(e) for e in entries}
        for name in list(self._held):
            group = self._held[name]
            if not any(id(e) in gone for e in group.entries):
                continue
            pairs = [(e, s) for e, s in zip(group.entries, group.scores, strict=True) if id(e) not in gone]
            group.entries = [e for e, _ in pairs]
            group.scores = [s for _, s in pairs]
            if not group.entries:
                del self._held[name]
            self._note(name)


class GroupSampler(Sampler):
    """Keeps whole prompt groups per step: every sample of the chosen groups, none of the others.

    The group of a sample comes from its metadata (`key`: by default ``group_uid``, else
    ``prompt_index``; see docs/choosing.md). When a step closes its groups are ordered by
    the policy: by `stat` of their rewards (``"mean"``, or ``"spread"``: the population standard
    deviation) highest first for ``"top"``, lowest first for ``"bottom"``, alternately the
    highest and the lowest left for ``"top_bottom"``; by arrival for ``"first"``; by a random
    key derived from `seed`, the split, the step and the group id for ``"random"``. They are
    taken in that order while each fits what is left of the cap, which counts samples
    (``count="samples"``) or groups (``count="groups"``); a group that does not fit is skipped
    whole. Whatever the calls, processes or ranks the samples come from, the pick is the same.

    Until its step closes the selection holds every sample whose group may still be taken.
    `group_size` (the samples of every group, e.g. GRPO's samples per prompt) lets it refuse,
    before encoding, the complete groups that can no longer be taken; the pick stays the same
    while no group has more samples (for ``"top_bottom"``: while every group has exactly that
    many).
    """

    holds = True
    starts_cheaply = True
    counts_skipped = False

    def __init__(
        self,
        policy: GroupPolicy = "top_bottom",
        *,
        stat: GroupStat = "mean",
        key: GroupKey = DEFAULT_GROUP_KEYS,
        count: Literal["samples", "groups"] = "samples",
        seed: int | None = 0,
        group_size: int | None = None,
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
        if group_size is not None and (
            isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1
        ):
            raise ValueError(f"group_size must be a positive int or None, got {shown(group_size)}")
        self.policy: GroupPolicy = policy
        self.stat: GroupStat = stat
        self.key: GroupKey = key
        self.count = count
        self.seed = seed
        # Samples of every group, when known: a group that has them all is ranked for good, so
        # groups that can no longer be taken are refused before encoding (see _settled_out).
        self.group_size = group_size
        # With seed=None, one seed drawn here serves every step and part this sampler selects
        # (it travels with the sampler to Ray actors); a merge keeps the key a part drew.
        self.run_seed: int | str = seed if seed is not None else f"run:{int.from_bytes(os.urandom(8), 'big')}"
        self.needs_score = policy in ("top_bottom", "top", "bottom")
        self._warned = False
        self.warned_holding = False

    @property
    def group_key(self) -> GroupKey:
        """How a sample's group is read from its metadata (the session reads it before encoding)."""
        return self.key

    def warn_holding(self, held: int, step: int) -> None:
        """Warn once that a step's selection holds many samples for want of `group_size`."""
        self.warned_holding = True
        logger.warning(
            "asynctrace: GroupSampler holds %d samples of step %d until the step closes: without "
            "group_size it cannot tell that a group is complete, so it refuses none before; pass "
            "GroupSampler(group_size=<samples per group>) to refuse groups that can no longer be taken",
            held,
            step,
        )

    def warn_oversized(self, size: int, k: int) -> None:
        """Warn once that groups larger than the cap are never written."""
        if self._warned:
            return
        self._warned = True
        logger.warning(
            "asynctrace: a prompt group of %d samples is larger than max_traces_per_step=%d, so it "
            "is never written (counted as capped; smaller groups of the step still are); raise the "
            "cap to a multiple of the group size or use GroupSampler(count='groups')",
            size,
            k,
        )

    def new_step(self, split: str, step: int, k: int) -> StepSelection:
        return _GroupSelection(self, k, split, step, part=False)

    def new_part_step(self, split: str, step: int, k: int, part: int) -> StepSelection:
        return _GroupSelection(self, k, split, step, part=True)

    def merge(self, split: str, step: int, k: int, parts: Sequence[Sequence[Entry]]) -> list[Entry]:
        # The parts held every sample whose group the whole step could take (see _plan):
        # selecting over them all, as one process offered them, decides the step.
        merged = in_merged_order(parts)
        selection = _GroupSelection(self, k, split, step, part=True)
        selection.offer_all(merged)
        return selection.close()[0]

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_warned": False, "warned_holding": False}
