"""The ``"global"`` mode's reduction: every rank's ended steps gathered to the writing rank,
merged there over the whole step (the watch list's places, then the sampler's), and written.

It also keeps the reduction's counters that `RankStats` reports.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from .._fronts.selection import Ended
from .._records.groups import payload_group
from .._select.base import Sampler
from .._select.parts import grant_watched, group_key_of, merge_parts
from .._select.watch import WatchCounter
from ._collective import Collective, frame, unframe

__all__ = ["Reduction"]


class Write(Protocol):
    """Queue a step's selected (or, with `watched`, watched) payloads in the writing session."""

    def __call__(
        self,
        split: str,
        step: int,
        payloads: Sequence[bytes],
        deadline: float | None,
        *,
        watched: bool = False,
    ) -> None: ...


class Reduction:
    """One rank's side of the reductions: what it sent, and on the writing rank what it merged."""

    def __init__(
        self,
        ranks: Collective,
        k: int,
        sampler: Sampler,
        granted: WatchCounter | None,
        write: Write,
    ) -> None:
        self._ranks = ranks
        self._k = k
        self._sampler = sampler
        self._group_key = group_key_of(sampler)
        # The writing rank's watch counter: it takes the step's places over every rank's (see
        # `grant_watched`).
        self._granted = granted
        self._write = write
        self.reductions = self.bytes_sent = self.last_bytes = self.payload_bytes = 0
        self.merged_received = self.merged_capped = self.merged_late = 0
        # On the writing rank: the newest step of each split already merged and written.
        self._merged_upto: dict[str, int] = {}

    def gather(self, ended: Ended) -> list[bytes] | None:
        """Send `ended` to the writing rank: every rank's frames there, None elsewhere. Raises
        when the collective fails (a peer died, a timeout): then this rank's candidates never
        reached the writing rank, or cannot be known to have."""
        data, payload_bytes = frame(self._ranks.rank, ended)
        frames, sent = self._ranks.gather(data)
        self.reductions += 1
        self.payload_bytes += payload_bytes
        self.last_bytes = sent  # 0 in a world of one, where nothing is sent
        self.bytes_sent += sent
        return frames

    def write(self, frames: list[bytes] | None, timeout: float | None) -> float | None:
        """On the writing rank, merge each gathered step and write it; `timeout` bounds waiting
        for room in its session, from now (waiting for slower ranks is not waiting for room).
        Returns the deadline that applied (None without `timeout`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if frames is None:
            return deadline
        by_step = unframe(frames, lambda payload: payload_group(payload, self._group_key))
        # Each step's parts are in rank order, as `gather` returns the frames: the order one
        # process would log in. Sorted, each split's steps come in increasing order, so
        # `_merged_upto` stops only a step that an earlier reduction wrote.
        for (split, step), parts in sorted(by_step.items()):
            received = sum(len(p.cands) + len(p.watched) for p in parts)
            self.merged_received += received
            if step <= self._merged_upto.get(split, -1):
                # Written by an earlier reduction: `flush` ended it only on the ranks that had it
                # open, and another rank logged some later. Merging again would break the cap.
                self.merged_late += received
                continue
            # The watch list's places over every rank, rank after rank; then the sampler's own
            # merge: exactly what one selection offered every rank's samples, rank after rank,
            # would keep (see `Sampler.merge`).
            k = self._k
            if self._granted is not None:
                watched, cands = grant_watched(
                    self._granted,
                    self._sampler,
                    split,
                    step,
                    k,
                    [(p.rank, p.cands, p.watched) for p in parts],
                )
            else:
                watched, cands = [], [p.cands for p in parts]
            chosen = merge_parts(self._sampler, split, step, k, cands)
            self.merged_capped += received - len(watched) - len(chosen)
            self._merged_upto[split] = step
            self._write(split, step, watched, deadline, watched=True)
            self._write(split, step, chosen, deadline)
        return deadline
