"""What every sampler shares: an entry's states, one step's selection, the `Sampler` interface,
and the merge order of parts from several processes."""

from __future__ import annotations

import abc
from collections.abc import Hashable, Sequence

from .._records.types import TraceRecord

__all__ = [
    "EVICTED",
    "HELD",
    "RELEASED",
    "Entry",
    "Sampler",
    "StepSelection",
    "entries_for",
    "in_merged_order",
]

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


def entries_for(
    records: Sequence[TraceRecord],
    first_seq: int,
    gaps: Sequence[int] | None = None,
    groups: Sequence[Hashable | None] | None = None,
) -> list[Entry]:
    """Held entries for a submission's records, numbered from `first_seq` on, each with its
    `gap` and `group` where given: `Entry(record.score, seq, record)` for each, in one pass and
    without a Python-level `__init__` call per entry (this runs on the caller's path)."""
    new = object.__new__
    out = []
    for i, r in enumerate(records):
        e = new(Entry)
        e.score = r.score
        e.seq = first_seq + i
        e.record = r
        e.state = HELD
        e.key = None
        e.group = None if groups is None else groups[i]
        e.gap = 0 if gaps is None else gaps[i]
        out.append(e)
    return out


class StepSelection(abc.ABC):
    """The selection state of one (split, step): O(k) entries at most."""

    @abc.abstractmethod
    def offer(self, entry: Entry) -> tuple[bool, Entry | None]:
        """Offer one candidate; returns (kept, evicted) where evicted is an earlier entry now dropped."""

    @abc.abstractmethod
    def held(self) -> list[Entry]:
        """Entries still held (for holding samplers): the candidates a part ships to a merge;
        `close` says which of them the step releases."""

    def close(self) -> tuple[list[Entry], list[Entry]]:
        """The step closes: the entries to release, and those dropped only now (counted
        "capped"). The default releases `held()`; a selection that decides when the step
        closes (the group sampler) overrides it."""
        return self.held(), []

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
    #: False when no selection of the sampler counts the samples `keeps` refused
    #: (`StepSelection.skip`), so the session need not say where they were.
    counts_skipped: bool = True

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
