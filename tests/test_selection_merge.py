"""Skip-ahead reservoir, `keeps` against offering, and merging the selections of several parts."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

import asynctrace as at
from asynctrace._select.base import Entry, Sampler
from asynctrace._select.gate import Gate
from asynctrace._select.samplers import resolve_sampler


def _select(
    sampler: Sampler, k: int, scores: Sequence[float], groups: Sequence[object] | None = None
) -> list[int]:
    """What one selection keeps when offered everything one by one (each index its own entry)."""
    sel = sampler.new_step("train", 0, k)
    entries = [Entry(s, i, group=None if groups is None else groups[i]) for i, s in enumerate(scores)]
    kept, evicted = sel.offer_all(entries)
    gone = {id(e) for e in evicted}
    if sampler.holds:
        return sorted(e.seq for e in sel.close()[0])
    return [e.seq for e, took in zip(entries, kept, strict=True) if took and id(e) not in gone]


def _through_keeps(sampler: Sampler, k: int, scores: Sequence[float], batch: int) -> list[int]:
    """The session's capped path: ask `keeps` per call, offer only the kept rows (with the gaps of
    refused rows before them), skip the trailing refused ones; returns the rows kept."""
    gate = Gate(k, sampler, max_open_steps=2, step_timeout=None)
    row_of: dict[int, int] = {}
    seq = 0
    for c in range(0, len(scores), batch):
        part = scores[c : c + batch]
        keeps = gate.keeps("train", 0, part, seq + 1)
        assert keeps is not None
        entries, gap = [], 0
        for i, keep in enumerate(keeps):
            if keep:
                seq += 1
                e = Entry(part[i], seq)
                e.gap = gap
                row_of[id(e)] = c + i
                entries.append(e)
                gap = 0
            else:
                gap += 1
        result = gate.offer("train", 0, entries, 0.0)
        assert result.capped == 0  # `keeps` promised each of them a place
        if gap:
            gate.skip("train", 0, gap)
    return sorted(row_of[id(e)] for e in gate.close_all())


@pytest.mark.parametrize("batch", [1, 7, 32])
def test_reservoir_keeps_agrees_with_offering_every_row(batch: int) -> None:
    """Offering only the rows `keeps` keeps (gaps counted) chooses exactly what offering every row does."""
    for seed in range(30):
        scores = [float(i) for i in range(500)]
        full = _select(at.ReservoirSampler(seed=seed), 8, scores)
        assert _through_keeps(at.ReservoirSampler(seed=seed), 8, scores, batch) == full


def test_reservoir_draws_only_for_rows_that_enter() -> None:
    """After the reservoir fills, a step of 100,000 rows draws a few hundred numbers, not one a row."""
    draws = 0

    class Counting(random.Random):
        def random(self) -> float:
            nonlocal draws
            draws += 1
            return super().random()

    sampler = at.ReservoirSampler(seed=1)
    sel = sampler.new_step("train", 0, 16)
    sel._rng = Counting(5)  # type: ignore[attr-defined]
    for i in range(100_000):
        sel.offer(Entry(None, i))
    # k ln(n/k) entries, two draws each, plus the k of the fill: about 300.
    assert 16 < draws < 800, draws
    assert len(sel.held()) == 16


def test_reservoir_is_uniform_over_positions() -> None:
    """Each of 20 positions is kept about k/n of the time (k=4, 4000 seeds)."""
    counts = [0] * 20
    for seed in range(4000):
        for i in _select(at.ReservoirSampler(seed=seed), 4, [0.0] * 20):
            counts[i] += 1
    expected = 4000 * 4 / 20
    assert all(abs(c - expected) < 0.12 * expected for c in counts), counts


def _parts(n: int, sizes: Sequence[int]) -> list[range]:
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    assert start == n
    return out


def _merge(sampler: Sampler, k: int, scores: Sequence[float], sizes: Sequence[int], groups=None) -> list[int]:
    """Each part selects on its own (its own random stream), then the parts' picks are merged."""
    picks = []
    for p, rows in enumerate(_parts(len(scores), sizes)):
        sel = sampler.new_part_step("train", 0, k, p)
        entries = [Entry(scores[i], i, group=None if groups is None else groups[i]) for i in rows]
        kept, evicted = sel.offer_all(entries)
        gone = {id(e) for e in evicted}
        part = (
            sel.held()
            if sampler.holds
            else [e for e, t in zip(entries, kept, strict=True) if t and id(e) not in gone]
        )
        # What would cross a process boundary: score, key, group, the row (as payload).
        picks.append([Entry(e.score, e.seq, key=e.key, group=e.group) for e in part])
    rows = {id(e): e.seq for part in picks for e in part}
    return sorted(rows[id(e)] for e in sampler.merge("train", 0, k, picks))


@pytest.mark.parametrize("name", ["first", "top_bottom"])
def test_merged_parts_equal_one_process(name: str) -> None:
    """first and top_bottom: merging the parts' picks equals one process offered every row in part order."""
    sampler = resolve_sampler(name)  # type: ignore[arg-type]
    rng = random.Random(3)
    for _ in range(50):
        scores = [float(rng.randrange(40)) for _ in range(120)]
        for sizes in ([120], [60, 60], [10, 50, 60], [1, 0, 119]):
            assert _merge(sampler, 7, scores, sizes) == _select(sampler, 7, scores)


def test_reservoir_merge_is_the_k_smallest_keys_of_every_part() -> None:
    """Merging reservoirs keeps the k smallest keys over all parts; one part is the single-process pick."""
    sampler = at.ReservoirSampler(seed=9)
    scores = [0.0] * 300
    assert _merge(sampler, 5, scores, [300]) == _select(sampler, 5, scores)
    keys: dict[int, float] = {}
    for p, rows in enumerate(_parts(300, [100, 200])):
        sel = sampler.new_part_step("train", 0, 5, p)
        for i in rows:
            sel.offer(Entry(0.0, i))
        keys.update({e.seq: e.key for e in sel.held()})  # type: ignore[misc]
    smallest = sorted(sorted(keys, key=lambda i: keys[i])[:5])
    assert _merge(sampler, 5, scores, [100, 200]) == smallest


def test_reservoir_merge_is_uniform_across_parts() -> None:
    """Rows of a small part and a large part are kept at the same rate k/n."""
    counts = [0] * 30
    for seed in range(3000):
        for i in _merge(at.ReservoirSampler(seed=seed), 3, [0.0] * 30, [5, 25]):
            counts[i] += 1
    expected = 3000 * 3 / 30
    assert all(abs(c - expected) < 0.2 * expected for c in counts), counts
    assert abs(sum(counts[:5]) / 5 - expected) < 0.1 * expected


def _grouped(n_groups: int, size: int, seed: int) -> tuple[list[float], list[str]]:
    rng = random.Random(seed)
    scores, groups = [], []
    for g in range(n_groups):
        for _ in range(size):
            scores.append(float(rng.randrange(100)))
            groups.append(f"g{g}")
    return scores, groups


def _means(scores: Sequence[float], groups: Sequence[str]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for s, g in zip(scores, groups, strict=True):
        sums.setdefault(g, []).append(s)
    return {g: sum(v) / len(v) for g, v in sums.items()}


def test_group_sampler_keeps_whole_top_and_bottom_groups() -> None:
    """top_bottom by mean keeps every sample of the best and the worst groups, nothing else."""
    scores, groups = _grouped(12, 4, seed=1)
    kept = _select(at.GroupSampler("top_bottom"), 8, scores, groups)
    means = _means(scores, groups)
    expected = {sorted(means, key=lambda g: -means[g])[0], sorted(means, key=lambda g: means[g])[0]}
    assert {groups[i] for i in kept} == expected and len(kept) == 8


def test_group_sampler_counts_groups_or_samples() -> None:
    """count="groups" keeps k whole groups; count="samples" keeps groups while they fit k samples."""
    scores, groups = _grouped(10, 3, seed=2)
    by_groups = _select(at.GroupSampler("top", count="groups"), 2, scores, groups)
    assert len(by_groups) == 6 and len({groups[i] for i in by_groups}) == 2
    by_samples = _select(at.GroupSampler("top", count="samples"), 7, scores, groups)
    assert len(by_samples) == 6  # a third group of 3 would make 9 > 7
    means = _means(scores, groups)
    best = sorted(means, key=lambda g: -means[g])[:2]
    assert {groups[i] for i in by_groups} == {groups[i] for i in by_samples} == set(best)


def test_group_sampler_spread_first_and_random() -> None:
    """Spread ranks by reward spread; first keeps the earliest groups; random is seeded and whole."""
    scores = [1.0, 1.0, 0.0, 1.0, 5.0, -5.0, 2.0, 2.0]
    groups = ["flat", "flat", "some", "some", "wide", "wide", "flat2", "flat2"]
    assert {
        groups[i] for i in _select(at.GroupSampler("top", stat="spread", count="groups"), 1, scores, groups)
    } == {"wide"}
    assert {groups[i] for i in _select(at.GroupSampler("first", count="groups"), 2, scores, groups)} == {
        "flat",
        "some",
    }
    a = _select(at.GroupSampler("random", count="groups", seed=4), 2, scores, groups)
    assert a == _select(at.GroupSampler("random", count="groups", seed=4), 2, scores, groups)
    assert len({groups[i] for i in a}) == 2 and all(groups.count(groups[i]) == 2 for i in a)
    picks = {
        tuple(_select(at.GroupSampler("random", count="groups", seed=s), 2, scores, groups))
        for s in range(20)
    }
    assert len(picks) > 2


@pytest.mark.parametrize("policy", ["top_bottom", "top", "bottom", "first", "random"])
def test_group_merge_equals_one_process(policy: str) -> None:
    """Whole groups per part: merging the parts' group picks equals one process's pick."""
    sampler = at.GroupSampler(policy, count="samples")  # type: ignore[arg-type]
    for seed in range(20):
        scores, groups = _grouped(15, 4, seed)
        for sizes in ([60], [20, 40], [8, 24, 28]):
            # `random` too: a group's key comes from the seed and its id, in every part.
            assert _merge(sampler, 16, scores, sizes, groups) == _select(sampler, 16, scores, groups), (
                seed,
                sizes,
            )


def test_group_keeps_agrees_with_offering() -> None:
    """The group sampler's `keeps` answers what offering the call would keep, without changing it."""
    sampler = at.GroupSampler("top_bottom")
    scores, groups = _grouped(40, 8, seed=5)
    sel = sampler.new_step("train", 0, 16)
    for c in range(0, len(scores), 32):
        part, names = scores[c : c + 32], groups[c : c + 32]
        predicted = sel.keeps(part, c, groups=names)  # type: ignore[call-arg]
        kept, _ = sel.offer_all([Entry(s, c + i, group=names[i]) for i, s in enumerate(part)])
        assert predicted == kept
    means = _means(scores, groups)
    # Ties go to the earlier group, both ways.
    high, low = sorted(means, key=lambda g: -means[g])[0], sorted(means, key=lambda g: means[g])[0]
    assert {groups[e.seq] for e in sel.close()[0]} == {high, low}


def test_group_sampler_rejects_bad_arguments() -> None:
    """A wrong policy, statistic or count names what was wrong."""
    with pytest.raises(ValueError, match="policy"):
        at.GroupSampler("best")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stat"):
        at.GroupSampler(stat="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="count"):
        at.GroupSampler(count="tokens")  # type: ignore[arg-type]
