"""The tests' oracle for the group sampler, written from docs/choosing.md ("whole groups")."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Sequence

import orjson


def random_key(seed: int, split: str, step: int, group: Hashable) -> float:
    """A group's random key as choosing.md defines it: blake2b (8 bytes) of the seed, split, step and
    the group id's JSON, as a fraction of 2**64."""
    digest = hashlib.blake2b(f"{seed}\x00{split}\x00{step}\x00".encode() + orjson.dumps(group), digest_size=8)
    return int.from_bytes(digest.digest(), "big") / 2.0**64


def pick(
    rows: Sequence[tuple[Hashable, float]],
    k: int,
    policy: str,
    *,
    stat: str = "mean",
    count: str = "samples",
    seed: int = 0,
    split: str = "train",
    step: int = 0,
) -> set[int]:
    """The indices of `rows` ((group, reward) of one step, in arrival order) the group sampler keeps."""
    members: dict[Hashable, list[int]] = {}
    for i, (g, _) in enumerate(rows):
        members.setdefault(g, []).append(i)
    if count == "samples":  # a group larger than the cap is never written, nor ranked
        members = {g: idx for g, idx in members.items() if len(idx) <= k}
    first = {g: idx[0] for g, idx in members.items()}

    def value(g: Hashable) -> float:
        xs = [rows[i][1] for i in members[g]]
        mean = sum(xs) / len(xs)
        if stat == "mean":
            return mean
        return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))

    high = sorted(members, key=lambda g: (-value(g), first[g]))
    low = sorted(members, key=lambda g: (value(g), first[g]))
    if policy == "first":
        order = sorted(members, key=lambda g: first[g])
    elif policy == "random":
        order = sorted(members, key=lambda g: random_key(seed, split, step, g))
    elif policy == "top":
        order = high
    elif policy == "bottom":
        order = low
    else:  # the best left, then the worst left, and so on
        order = []
        while len(order) < len(members):
            for side in (high, low):
                rest = [g for g in side if g not in order]
                if rest:
                    order.append(rest[0])
    kept: set[int] = set()
    left = k
    for g in order:
        size = len(members[g]) if count == "samples" else 1
        if size <= left:
            kept.update(members[g])
            left -= size
    return kept
