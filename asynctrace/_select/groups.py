"""The group sampler: whole prompt groups per step, ranked by a statistic of their rewards.

The rule (docs/choosing.md "whole groups"): when a step closes, its groups are put in the
policy's order and taken in that order while each fits what is left of the cap; a group that
does not fit is skipped whole and the next ones are tried. Until then a selection holds every
sample whose group could still be taken, and refuses (or drops whole) only groups that can
never be: a group larger than the cap, and, where a group's rank is fixed when it first
arrives ("first" and "random" with ``count="groups"``), groups behind `k` others
(group_plan.py keeps a step's groups and tells which can never be taken).
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable, Sequence
from typing import Literal

from .._records.groups import DEFAULT_GROUP_KEYS, GroupKey, payload_group
from .._security import logger, shown
from .base import Entry, Sampler, StepSelection, in_merged_order
from .group_plan import (
    GroupPolicy,
    GroupStat,
    HeldGroup,
    StepGroups,
    group_random_key,
    group_stat,
    is_single,
    policy_order,
)

__all__ = ["GroupPolicy", "GroupSampler", "GroupStat", "group_random_key"]


_POLICIES: tuple[str, ...] = ("top_bottom", "top", "bottom", "first", "random")
_STATS: tuple[str, ...] = ("mean", "spread")
# Samples a selection without `group_size` may hold for one step before a warning suggests it.
_HOLDING_WARNING = 1024


class _GroupSelection(StepSelection):
    __slots__ = ("_groups", "_sampler")

    def __init__(self, sampler: GroupSampler, k: int, split: str, step: int, *, part: bool) -> None:
        self._sampler = sampler
        self._groups = StepGroups(sampler, k, split, step, part=part)

    def keeps(
        self,
        scores: Sequence[float | None],
        first_seq: int,
        groups: Sequence[Hashable | None] | None = None,
    ) -> list[bool] | None:
        if groups is None:
            return None  # the group of each sample is needed first
        step = self._groups
        names = step.named(groups)
        out, _, sizes = step.plan(names, scores)
        held, k, count = step.held, step.k, self._sampler.count
        # Refused without offering: only what offering would change nothing about. A group the
        # call makes larger than the cap is offered, so that it is dropped whole (held) and its
        # later samples are refused by name (new): its size is known only to the selection.
        keep = {
            g: g not in out or g in held or (count == "samples" and size > k) for g, size in sizes.items()
        }
        if True not in keep.values():
            return [False] * len(names)  # the usual call once the step's front is full
        # A group of the call that is not in `sizes` was refused before.
        return [keep.get(g, False) for g in names]

    def offer(self, entry: Entry) -> tuple[bool, Entry | None]:
        raise NotImplementedError("the group sampler takes a call's samples together (offer_all)")

    def offer_all(self, entries: Sequence[Entry]) -> tuple[list[bool], list[Entry]]:
        step = self._groups
        names = step.names_of(entries)
        scores = [e.score for e in entries]
        out, new, sizes = step.plan(names, scores, [e.key for e in entries])
        step.n += len(entries)
        step.singles += sum(1 for g in names if is_single(g))
        held, refused = step.held, step.refused
        evicted: list[Entry] = []
        for g in out:
            group = held.pop(g, None)
            if group is not None:
                evicted.extend(group.entries)
            step.complete.pop(g, None)
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
                    step.note(g)
        self._warn(out, sizes)
        if (
            sampler.group_size is None
            and not sampler.warned_holding
            and step.n > max(_HOLDING_WARNING, 64 * step.k)
        ):
            n_held = sum(len(g.entries) for g in held.values())
            if n_held > max(_HOLDING_WARNING, 64 * step.k):
                sampler.warn_holding(n_held, step.step)
        return kept, evicted

    def _warn(self, out: Iterable[Hashable], sizes: dict[Hashable, int]) -> None:
        step = self._groups
        over = [sizes[g] for g in out if g in sizes and step.size(sizes[g]) > step.k]
        if over:
            self._sampler.warn_oversized(max(over), step.k)

    def _pick(self) -> set[Hashable]:
        step = self._groups
        stat, k = self._sampler.stat, step.k
        sizes = {g: len(held.entries) for g, held in step.held.items()}
        self._warn(sizes, sizes)
        # A group larger than the cap is never written, nor ranked (a part holds them).
        cands = {
            g: (group_stat(held.scores, stat), held.rkey, held.first)
            for g, held in step.held.items()
            if step.size(sizes[g]) <= k
        }
        picked: set[Hashable] = set()
        left = k
        for g in policy_order(self._sampler.policy, cands):
            size = step.size(sizes[g])
            if size <= left:
                picked.add(g)
                left -= size
        return picked

    def _regroup(self) -> list[Entry]:
        """Put rows offered before their sample existed (`log_rollouts` reserves places by reward,
        then decodes) in the groups their samples name; returns those of refused groups."""
        step = self._groups
        gone: list[Entry] = []
        for name in [g for g in step.held if is_single(g)]:
            single = step.held[name]
            e = single.entries[0] if single.entries else None
            if e is None or e.group is not None or e.record is None:
                continue
            real = payload_group(e.record.payload, self._sampler.key)
            if real is None:
                continue
            del step.held[name]
            e.group = real
            if real in step.refused:
                gone.append(e)
                continue
            group = step.held.get(real)
            if group is None:
                group = step.held[real] = HeldGroup(single.first, step.rkey(real, None))
            group.first = min(group.first, single.first)
            group.entries.append(e)
            group.scores.append(single.scores[0])
        return gone

    def close(self) -> tuple[list[Entry], list[Entry]]:
        gone = self._regroup()
        picked = self._pick()
        held = self._groups.held
        chosen = [e for g, group in held.items() if g in picked for e in group.entries]
        dropped = [e for g, group in held.items() if g not in picked for e in group.entries]
        return sorted(chosen, key=lambda e: e.seq), dropped + gone

    def held(self) -> list[Entry]:
        # Every candidate: what a part ships to the merge (`close` decides which are written).
        return sorted((e for g in self._groups.held.values() for e in g.entries), key=lambda e: e.seq)

    def withdraw(self, entries: Sequence[Entry]) -> None:
        step = self._groups
        gone = {id(e) for e in entries}
        for name in list(step.held):
            group = step.held[name]
            if not any(id(e) in gone for e in group.entries):
                continue
            pairs = [(e, s) for e, s in zip(group.entries, group.scores, strict=True) if id(e) not in gone]
            group.entries = [e for e, _ in pairs]
            group.scores = [s for _, s in pairs]
            if not group.entries:
                del step.held[name]
            step.note(name)


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
        # groups that can no longer be taken are refused before encoding (see group_plan.py).
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
        # The parts held every sample whose group the whole step could take (see StepGroups.plan):
        # selecting over them all, as one process offered them, decides the step.
        merged = in_merged_order(parts)
        selection = _GroupSelection(self, k, split, step, part=True)
        selection.offer_all(merged)
        return selection.close()[0]

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_warned": False, "warned_holding": False}
