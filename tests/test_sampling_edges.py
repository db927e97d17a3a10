"""Edges of the samplers: the first sampler's counter window, and the reservoir after a withdraw."""

from __future__ import annotations

import random

from asynctrace._select.base import Entry
from asynctrace._select.gate import COUNTER_WINDOW, Gate
from asynctrace._select.samplers import FirstSampler, ReservoirSampler


def test_first_counter_window_stays_bounded_for_descending_stragglers() -> None:
    """With the first sampler's window full, a straggler older than every counted step is late."""
    gate = Gate(2, FirstSampler(), max_open_steps=2, step_timeout=None)
    newest = COUNTER_WINDOW + 50
    late = 0
    for step in range(newest, -1, -1):
        late += gate.offer("train", step, [Entry(None, step)], 0.0).late
    assert len(gate._open) == COUNTER_WINDOW
    assert late == newest + 1 - COUNTER_WINDOW
    # The counted steps stay exact: one more fits in a step with one sample, then it is capped.
    oldest_counted = newest + 1 - COUNTER_WINDOW
    assert len(gate.offer("train", oldest_counted, [Entry(None, -1)], 0.0).passed) == 1
    assert gate.offer("train", oldest_counted, [Entry(None, -2)], 0.0).capped == 1
    # A newer step still enters, pushing the oldest counted one out.
    assert len(gate.offer("train", newest + 1, [Entry(None, -3)], 0.0).passed) == 1
    assert len(gate._open) == COUNTER_WINDOW and gate.is_closed("train", oldest_counted)


def test_reservoir_stays_uniform_after_a_withdraw() -> None:
    """After a kept row is withdrawn, each later row is kept about k/(n-1) of the time, none surely."""
    k, n, t, runs = 2, 40, 20, 2000  # 2000 runs take about 0.1 s
    counts = [0] * n
    sizes = 0
    for seed in range(runs):
        selection = ReservoirSampler(seed=seed).new_step("train", 0, k)
        for i in range(n):
            selection.offer(Entry(None, i))
            if i == t:
                # A uniformly chosen kept row fails to decode, as any reserved row may.
                selection.withdraw([random.Random(-seed).choice(selection.held())])
        held = selection.held()
        assert len(held) <= k
        sizes += len(held)
        for e in held:
            counts[e.seq] += 1
    expected = runs * k / (n - 1)  # uniform over the rows that were not withdrawn: about 103
    later = counts[t + 1 :]
    assert max(later) < 1.5 * expected, later  # the original kept row t + 1 in over half the runs
    assert abs(sum(later) / len(later) - expected) < 0.15 * expected, later
    # The freed place is usually taken again (by about 1 - (t/n)**k of the runs).
    assert sizes / runs > 0.85 * k


def test_first_counter_window_is_per_split() -> None:
    """A busy split filling the window does not make an out-of-order step of a sparse split late."""
    gate = Gate(2, FirstSampler(), max_open_steps=2, step_timeout=None)
    gate.offer("eval", 10, [Entry(None, 0)], 0.0)
    gate.offer("eval", 20, [Entry(None, 1)], 0.0)
    for step in range(COUNTER_WINDOW + 10):
        gate.offer("train", step, [Entry(None, step)], 0.0)
    result = gate.offer("eval", 15, [Entry(None, 2)], 0.0)
    assert result.late == 0 and len(result.passed) == 1
    assert not gate.is_closed("eval", 10)
    assert sum(1 for sp, _ in gate._open if sp == "train") == COUNTER_WINDOW
