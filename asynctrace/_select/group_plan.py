"""One step's prompt groups as the group sampler holds them, the order its policy takes them in,
and which of them can never be taken (refused before encoding); groups.py has the rule itself."""

from __future__ import annotations

import hashlib
import itertools
import math
import operator
from collections.abc import Hashable, Iterable, Sequence
from typing import Literal, NamedTuple, Protocol

import orjson

from .._records.groups import GroupKey, payload_group, population_spread
from .base import Entry

__all__ = [
    "SINGLE",
    "GroupPolicy",
    "GroupRule",
    "GroupStat",
    "HeldGroup",
    "Plan",
    "Rank",
    "StepGroups",
    "group_random_key",
    "group_stat",
    "is_single",
    "policy_order",
]

GroupPolicy = Literal["top_bottom", "top", "bottom", "first", "random"]
GroupStat = Literal["mean", "spread"]
SINGLE = "asynctrace.single"  # a sample that names no group is a group of its own


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


class GroupRule(Protocol):
    """What a step's groups need of their sampler (`GroupSampler`)."""

    @property
    def policy(self) -> GroupPolicy: ...
    @property
    def stat(self) -> GroupStat: ...
    @property
    def key(self) -> GroupKey: ...
    @property
    def count(self) -> Literal["samples", "groups"]: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def run_seed(self) -> int | str: ...
    @property
    def group_size(self) -> int | None: ...
    @property
    def needs_score(self) -> bool: ...


_GROUP_OF = operator.itemgetter(0)  # of a (group, score) pair


class HeldGroup:
    """One group of a step: its samples, held until the step closes."""

    __slots__ = ("entries", "first", "rkey", "scores")

    def __init__(self, first: int, rkey: float) -> None:
        self.entries: list[Entry] = []
        self.scores: list[float] = []  # each entry's score (0.0 for none), kept beside it
        self.first = first  # arrival index of its first sample in the step: "first" ranks by it
        self.rkey = rkey  # its random key: "random" takes the smallest first


# What places a group in a policy's order: (the statistic of its rewards, its random key, its
# first arrival). A plain tuple: one is made for every group a call or a close ranks.
Rank = tuple[float, float, int]


class Plan(NamedTuple):
    """What a call's samples would do to the step's groups (`StepGroups.plan`)."""

    out: set[Hashable]  # the groups that can never be taken
    new: dict[Hashable, HeldGroup]  # the groups new to the step
    sizes: dict[Hashable, int]  # each group of the call's size once the call joins


def is_single(g: Hashable) -> bool:
    return isinstance(g, tuple) and len(g) == 2 and g[0] == SINGLE


def group_stat(scores: Sequence[float], stat: GroupStat) -> float:
    if stat == "mean":
        return math.fsum(scores) / len(scores) if scores else 0.0
    return population_spread(scores)


def policy_order(policy: GroupPolicy, cands: dict[Hashable, Rank]) -> list[Hashable]:
    """The groups in the order the policy takes them."""
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


def _behind_front(policy: GroupPolicy, front: Sequence[Rank], c: Rank) -> bool:
    """Whether a group falls behind a full `front` of complete groups, the policy's first
    ``len(front)``: True only when that is certain."""
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


class StepGroups:
    """One (split, step)'s groups: those held, those refused for good, and (with `group_size`)
    the complete ones; `plan` tells which groups a call's samples leave no chance."""

    __slots__ = ("complete", "held", "k", "n", "part", "refused", "rule", "singles", "split", "step")

    def __init__(self, rule: GroupRule, k: int, split: str, step: int, *, part: bool) -> None:
        self.rule = rule
        self.k = k
        self.split = split
        self.step = step
        # A part's selection (one process of a step merged later) refuses early only what no
        # other part can change: it cannot know where other parts' groups come first.
        self.part = part
        self.held: dict[Hashable, HeldGroup] = {}
        self.refused: set[Hashable] = set()
        # With `group_size`: the held groups that have at least that many samples, each ranked
        # with its statistic final once the group is complete, so that a call looks only at its
        # own groups and these, never at every held sample.
        self.complete: dict[Hashable, Rank] = {}
        self.n = 0  # samples offered: orders groups by their first arrival
        # Group-less samples offered: names each (never refused early, so the session's
        # precheck and encode-first paths, and a merge, number them alike).
        self.singles = 0

    # -- what a group is -------------------------------------------------------------------------

    def names_of(self, entries: Sequence[Entry]) -> list[Hashable]:
        """Each entry's group (read from its payload when not known yet; a group of its own
        when it names none)."""
        out: list[Hashable] = []
        singles = self.singles
        for e in entries:
            if e.group is None and e.record is not None:
                e.group = payload_group(e.record.payload, self.rule.key)
            if e.group is None:
                singles += 1
                out.append((SINGLE, singles))
            else:
                out.append(e.group)
        return out

    def named(self, groups: Sequence[Hashable | None]) -> Sequence[Hashable]:
        """`groups` with a group of its own for each sample that names none, as `names_of` would."""
        if None not in groups:
            return groups  # type: ignore[return-value]
        singles = self.singles
        named: list[Hashable] = []
        for g in groups:
            if g is None:
                singles += 1
                g = (SINGLE, singles)
            named.append(g)
        return named

    def rkey(self, g: Hashable, carried: float | None) -> float:
        if self.rule.policy != "random":
            return 0.0
        if self.rule.seed is None and carried is not None:
            return carried  # drawn by the part that first held the group (its own session seed)
        return group_random_key(self.rule.run_seed, self.split, self.step, g)

    def size(self, n: int) -> int:
        """What `n` samples of one group take of the cap."""
        return n if self.rule.count == "samples" else 1

    def note(self, g: Hashable) -> None:
        """Keep `complete` in step with held group `g` (after it changed)."""
        gs = self.rule.group_size
        group = self.held.get(g)
        if gs is None or group is None or len(group.entries) < gs or is_single(g):
            self.complete.pop(g, None)
        else:
            self.complete[g] = (self._value(group.scores), group.rkey, group.first)

    def _value(self, scores: Sequence[float | None]) -> float:
        """A group's statistic, where the policy ranks by one."""
        if not self.rule.needs_score:
            return 0.0
        if None in scores:
            scores = [0.0 if x is None else x for x in scores]
        return group_stat(scores, self.rule.stat)  # type: ignore[arg-type]

    def _ranked_early(self) -> bool:
        """True when a group's place is fixed on arrival, so groups behind `k` others are out."""
        rule = self.rule
        if rule.count != "groups":
            return False
        if rule.policy == "first":
            return not self.part
        return rule.policy == "random" and not (self.part and rule.seed is None)

    # -- deciding --------------------------------------------------------------------------------

    def plan(
        self,
        names: Sequence[Hashable],
        scores: Sequence[float | None],
        carried: Sequence[float | None] | None = None,
    ) -> Plan:
        """The groups that can never be taken once these samples (each one's group, score and
        carried random key) join the held ones, the groups new to the step, and the size of
        each group of the call: changes nothing. Looks at the call's groups and, with
        `group_size`, the complete ones, never at every held sample."""
        held, refused = self.held, self.refused
        pairs: Iterable[tuple[Hashable, float | None]] = zip(names, scores, strict=True)
        if refused and not refused.isdisjoint(names):
            # Groups refused before are left out (usually a call has none: one C-level check).
            pairs = [(g, score) for g, score in pairs if g not in refused]
        # Run by run of one group (a group's samples usually come together): a list per run,
        # not a look-up per sample.
        added: dict[Hashable, list[float | None]] = {}
        for g, run in itertools.groupby(pairs, _GROUP_OF):
            got = added.get(g)
            if got is None:
                added[g] = [score for _, score in run]
            else:
                got.extend([score for _, score in run])
        new: dict[Hashable, HeldGroup] = {}
        sizes: dict[Hashable, int] = {}
        for g, got in added.items():
            group = held.get(g)
            if group is None:
                i = names.index(g)  # its first sample's place in the call orders it ("first")
                new[g] = HeldGroup(self.n + i + 1, self.rkey(g, None if carried is None else carried[i]))
                sizes[g] = len(got)
            else:
                sizes[g] = len(got) + len(group.entries)
        k = self.k
        # A part keeps a group larger than the cap: the merge must see every sample of it to
        # know the group is too large (another part's share of it may fit on its own).
        if self.part:
            out: set[Hashable] = set()
        elif self.rule.count == "samples":
            out = {g for g, size in sizes.items() if size > k}
        else:
            out = set()  # a group counts 1
        if self._ranked_early():
            out |= self._behind(new, out)
        if self.rule.group_size is not None and added:
            out |= self._settled_out(added, sizes, new, out)
        return Plan(out, new, sizes)

    def _behind(self, new: dict[Hashable, HeldGroup], out: set[Hashable]) -> set[Hashable]:
        """Groups whose place is fixed on arrival behind `k` others ("first", "random" with
        ``count="groups"``). Held groups beyond the first `k` were let go, so only the held
        ones and the call's new ones are looked at."""
        live = {
            g: group
            for g, group in itertools.chain(self.held.items(), new.items())
            if g not in out and not is_single(g)
        }
        if len(live) <= self.k:
            return set()
        cands = {g: (0.0, group.rkey, group.first) for g, group in live.items()}
        return set(policy_order(self.rule.policy, cands)[self.k :])

    def _settled_out(
        self,
        added: dict[Hashable, list[float | None]],
        sizes: dict[Hashable, int],
        new: dict[Hashable, HeldGroup],
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
        rule = self.rule
        gs = rule.group_size
        assert gs is not None
        policy = rule.policy
        if policy == "random" and self.part and rule.seed is None:
            return set()  # keys drawn per part: another part may rank a group differently
        held = self.held
        # Every group with at least `group_size` samples once the call joins: the call's own,
        # and the held ones it does not touch.
        full: dict[Hashable, Rank] = {g: c for g, c in self.complete.items() if g not in added}
        over: list[Hashable] = []  # more samples than `group_size` promised
        for g, got in added.items():
            size = sizes[g]
            if size < gs or g in out or is_single(g):
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
        slots = self.k // gs if rule.count == "samples" else self.k
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
        front = policy_order(policy, counted)[:slots]
        settled = {g for g in counted if g not in front}
        if over and len(front) == slots:
            # A group with more samples than promised: out when placed after `slots` complete ones.
            fronted = {g: counted[g] for g in front}
            for g in over:
                if policy_order(policy, {**fronted, g: full[g]}).index(g) >= slots:
                    settled.add(g)
        return settled
