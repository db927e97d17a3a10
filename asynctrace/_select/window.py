"""The one rule of when a step closes (docs/concepts.md, *When a step closes*), for every holder of
per-step state: the session's gate, each `Selected` sink's lane (through its gate), the group
metrics, the Ray collector's merge and a Ray client's local selection.

A step of a split closes when a record arrives for a step more than `max_open_steps` newer
(every step of the split that far behind closes, open or not), when it saw nothing for
`step_timeout` seconds (with any older open step of its split), and at a flush or finish (every
open step). A split's closed steps are a prefix, so lateness is one number per split: a record
for a closed step is late. A holder whose closed steps may open again as new rounds (`reopen`,
a Ray client) never calls anything late.

The holder keeps its own per-step data; the window says which steps open, close and are late.
"""

from __future__ import annotations

__all__ = ["Step", "StepWindow"]

Step = tuple[str, int]  # (split, step)


class StepWindow:
    """Open steps and their last arrival, and each split's closed prefix; not thread-safe (its
    holder's lock covers it)."""

    __slots__ = ("_closed_upto", "_seen", "max_open_steps", "reopen", "step_timeout")

    def __init__(self, max_open_steps: int, step_timeout: float | None, *, reopen: bool = False) -> None:
        self.max_open_steps = max_open_steps
        self.step_timeout = step_timeout
        self.reopen = reopen
        self._seen: dict[Step, float] = {}  # open steps: when each last got a record
        self._closed_upto: dict[str, int] = {}

    def is_late(self, split: str, step: int) -> bool:
        """True when `step` of `split` has closed, so a record for it is late."""
        closed = self._closed_upto.get(split)
        return not self.reopen and closed is not None and step <= closed

    def closed(self) -> dict[str, int]:
        """Each split's last closed step."""
        return dict(self._closed_upto)

    def is_open(self, split: str, step: int) -> bool:
        return (split, step) in self._seen

    def behind(self, split: str, step: int) -> int | None:
        """The last step of `split` an arrival for `step` closes, when it closes any not closed yet."""
        upto = step - self.max_open_steps - 1
        closed = self._closed_upto.get(split)
        if upto < 0 or (closed is not None and upto <= closed and not self.reopen):
            return None
        return upto

    def arrive(self, split: str, step: int, now: float) -> list[Step]:
        """A record for `step` (not late) arrives: returns the open steps it closes, oldest first;
        `step` is then open, seen `now`."""
        upto = self.behind(split, step)
        closed = self.close_upto(split, upto) if upto is not None else []
        self._seen[(split, step)] = now
        return closed

    def touch(self, split: str, step: int, now: float) -> None:
        """Open `step` (or note a record for it) without closing anything (a sampler that holds
        nothing only counts, so no step of it needs closing to be decided)."""
        self._seen[(split, step)] = now

    def close_upto(self, split: str, upto: int) -> list[Step]:
        """Close every step of `split` up to `upto`, open or not; returns the open ones closed."""
        keys = sorted(k for k in self._seen if k[0] == split and k[1] <= upto)
        for key in keys:
            del self._seen[key]
        if not self.reopen:
            self._closed_upto[split] = max(self._closed_upto.get(split, upto), upto)
        return keys

    def close(self, keys: list[Step]) -> list[Step]:
        """Close these steps, each with the older open steps of its split."""
        out: list[Step] = []
        for split, step in sorted(keys):
            if (split, step) in self._seen:  # not closed already by a newer one of its split
                out += self.close_upto(split, step)
        return out

    def close_idle(self, now: float) -> list[Step]:
        """Close the steps that got nothing for `step_timeout` seconds (none without a timeout)."""
        if self.step_timeout is None:
            return []
        timeout = self.step_timeout
        return self.close([key for key, seen in self._seen.items() if now - seen >= timeout])

    def close_all(self) -> list[Step]:
        """Close every open step (a flush or finish)."""
        newest: dict[str, int] = {}
        for split, step in self._seen:
            newest[split] = max(newest.get(split, step), step)
        return self.close(list(newest.items()))

    def next_due(self, now: float) -> float | None:
        """Seconds until `close_idle` has a step to close; None when none is open or no timeout."""
        if self.step_timeout is None or not self._seen:
            return None
        return max(0.0, min(self._seen.values()) + self.step_timeout - now)
