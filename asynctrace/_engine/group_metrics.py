"""Per-step prompt-group metrics: how many groups, how many with zero reward spread, the mean spread.

Counted over every sample the caller submits, before the session's cap, at O(groups) memory per
open step: each group keeps a running count, mean and sum of squared deviations (Welford), which
give the population spread `population_spread` defines. Groups are named by `group_of`, the one
place that decides them. A step's metrics are logged at that step once it closes, by the
session's rules: `max_open_steps` behind the newest step of its split, at a flush or finish,
or after `step_timeout` without a sample. Samples of a step already closed are not counted.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Sequence
from typing import Any

from .._records.encode import UNKNOWN, preview_metadata, preview_score, sample_from
from .._records.groups import GroupKey, GroupSummary, group_of
from .._records.types import MetricsItem
from .._select.window import Step, StepWindow
from .health import PREFIX

__all__ = ["GroupMetrics", "group_metrics"]


def _score(obj: Any) -> float | None:
    score = preview_score(obj)
    if score is UNKNOWN:
        try:
            return sample_from(obj).ranking_score()
        except Exception:
            return None
    return score  # type: ignore[no-any-return]


def group_metrics(split: str, summary: GroupSummary) -> dict[str, float]:
    """The metric names and values for one step's groups of `split`."""
    base = f"{PREFIX}groups/{split}/"
    return {
        base + "count": float(summary.groups),
        base + "zero_spread": float(summary.zero_spread),
        base + "mean_spread": summary.mean_spread,
    }


class GroupMetrics:
    """Running group statistics per open (split, step); thread-safe (callers on any thread)."""

    def __init__(self, key: GroupKey, *, max_open_steps: int, step_timeout: float | None) -> None:
        self.key = key
        self.step_timeout = step_timeout
        self._lock = threading.Lock()
        # (split, step) -> (group -> [count, mean, m2]); which steps are open is the window's.
        self._open: dict[Step, dict[Hashable, list[float]]] = {}
        self._window = StepWindow(max_open_steps, step_timeout)

    def observe(self, items: Sequence[Any], step: int, split: str, now: float) -> list[MetricsItem]:
        """Count a submission's samples; returns the metrics of the steps it closes."""
        rewards: list[tuple[Hashable, float]] = []
        key = self.key
        for obj in items:
            meta = preview_metadata(obj)
            if meta is None:
                continue
            try:
                group = group_of(meta, key)
            except TypeError:  # GroupKeyError: no group to count it in (validation names it)
                continue
            if group is None:
                continue
            score = _score(obj)
            if score is not None and math.isfinite(score):
                rewards.append((group, score))
        with self._lock:
            if self._window.is_late(split, step):
                return []
            out = self._close(self._window.arrive(split, step, now))
            groups = self._open.setdefault((split, step), {})
            for group, x in rewards:
                stat = groups.get(group)  # group_of names only hashable groups
                if stat is None:
                    groups[group] = [1.0, x, 0.0]
                    continue
                stat[0] += 1
                delta = x - stat[1]
                stat[1] += delta / stat[0]
                stat[2] += delta * (x - stat[1])
            return out

    def close_all(self) -> list[MetricsItem]:
        with self._lock:
            return self._close(self._window.close_all())

    def close_idle(self, now: float) -> list[MetricsItem]:
        with self._lock:
            return self._close(self._window.close_idle(now))

    def _close(self, steps: list[Step]) -> list[MetricsItem]:
        """Lock held: the metrics of the steps the window closed."""
        out = []
        for split, step in steps:
            groups = self._open.pop((split, step), {})
            summary = GroupSummary.of([math.sqrt(max(m2, 0.0) / n) for n, _, m2 in groups.values()])
            if summary.groups:
                out.append(MetricsItem(step, group_metrics(split, summary)))
        return out
