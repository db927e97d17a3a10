"""Selecting a step in parts and merging them: the one mechanism of the distributed and Ray paths.

A process (a rank, a Ray actor) is a part of each step: it selects its own samples with
`Sampler.new_part_step` and hands on only what its selection kept, each entry with its payload,
score, sequence number and key. Whoever writes merges the parts with `Sampler.merge`, which
chooses exactly what one selection offered every part's samples would keep.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import orjson

from ._groups import GroupKey, group_of
from ._sampling import Entry, Sampler, StepSelection

__all__ = ["PartStep", "Row", "group_key_of", "merge_parts", "payload_group"]

# What travels for one kept entry: (sequence number, score, key).
Row = tuple[int, float | None, float | None]


def group_key_of(sampler: Sampler) -> GroupKey | None:
    """How the sampler reads a sample's group (a group sampler's `group_key`); None for the others."""
    key: GroupKey | None = getattr(sampler, "group_key", None)
    return key


def payload_group(payload: bytes, key: GroupKey | None) -> Hashable | None:
    """The prompt group of an encoded sample under `key` (None without a key or a group)."""
    if key is None:
        return None
    data = orjson.loads(payload)
    metadata = data.get("metadata") if isinstance(data, dict) else None
    return group_of(metadata, key) if isinstance(metadata, dict) else None


class PartStep:
    """One part's selection of one (split, step): O(k) entries at most, with their payloads."""

    __slots__ = ("kept", "nbytes", "offered", "selection")

    def __init__(self, selection: StepSelection) -> None:
        self.selection = selection
        self.kept: dict[int, tuple[Entry, bytes]] = {}  # by sequence number, in arrival order
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
