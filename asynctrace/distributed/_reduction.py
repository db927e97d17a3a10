"""The ``"global"`` mode's reduction: every rank's ended steps gathered to the writing rank,
merged there over the whole step (the watch list's places, then the sampler's), and written.

It also keeps the reduction's counters that `RankStats` reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from .._records.groups import payload_group
from .._select.base import Sampler
from .._select.parts import PartSteps, grant_watched, merge_parts
from .._select.watch import WatchCounter
from ._collective import Collective, Ended, frame, unframe

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
        steps: PartSteps,
        sampler: Sampler,
        granted: WatchCounter | None,
        write: Write,
        abort: Callable[[Ended], None],
    ) -> None:
        self._ranks = ranks
        self._steps = steps
        self._sampler = sampler
        # The writing rank's watch counter: it takes the step's places over every rank's (see
        # `grant_watched`).
        self._granted = granted
        self._write = write
        self._abort = abort
        self.reductions = self.bytes_sent = self.last_bytes = self.payload_bytes = 0
        self.merged_received = self.merged_capped = self.merged_late = 0
        # On the writing rank: the newest step of each split already merged and written.
        self._merged_upto: dict[str, int] = {}

    def reduce(self, ended: Ended, timeout: float | None) -> float | None:
        """Gather `ended` to the writing rank, which merges and writes each step; `timeout` bounds
        waiting for room in its session. Returns the deadline that applied (None without `timeout`)."""
        data, payload_bytes = frame(self._ranks.rank, ended)
        try:
            frames, sent = self._ranks.gather(data)
        except BaseException:
            # The collective failed (a peer died, a timeout): this rank's candidates never
            # reached the writing rank, or cannot be known to have; count them, then re-raise.
            self._abort(ended)
            raise
        # The clock starts after the gather: waiting for slower ranks is not waiting for room.
        deadline = None if timeout is None else time.monotonic() + timeout
        self.reductions += 1
        self.payload_bytes += payload_bytes
        self.last_bytes = sent  # 0 in a world of one, where nothing is sent
        self.bytes_sent += sent
        if frames is None:
            return deadline
        by_step = unframe(frames, lambda payload: payload_group(payload, self._steps.group_key))
        # Each step's parts are in rank order, as `gather` returns the frames: the order one
        # process would log in. Sorted, each split's steps come in increasing order, so
        # `_merged_upto` stops only a step that an earlier reduction wrote.
        for (split, step), parts in sorted(by_step.items()):
            received = sum(len(c) + len(w) for _, _, c, w in parts)
            self.merged_received += received
            if step <= self._merged_upto.get(split, -1):
                # Written by an earlier reduction: `flush` ended it only on the ranks that had it
                # open, and another rank logged some later. Merging again would break the cap.
                self.merged_late += received
                continue
            # The watch list's places over every rank, rank after rank; then the sampler's own
            # merge: exactly what one selection offered every rank's samples, rank after rank,
            # would keep (see `Sampler.merge`).
            k = self._steps.k
            if self._granted is not None:
                watched, cands = grant_watched(
                    self._granted, self._sampler, split, step, k, [(r, c, w) for r, _, c, w in parts]
                )
            else:
                watched, cands = [], [c for _, _, c, _ in parts]
            chosen = merge_parts(self._sampler, split, step, k, cands)
            self.merged_capped += received - len(watched) - len(chosen)
            self._merged_upto[split] = step
            self._write(split, step, watched, deadline, watched=True)
            self._write(split, step, chosen, deadline)
        return deadline
