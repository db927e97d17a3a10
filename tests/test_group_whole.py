"""The group sampler keeps whole groups, whatever the calls, paths and processes bring them."""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asynctrace as at
from asynctrace._select.base import Entry
from asynctrace._select.gate import Gate
from tests._group_oracle import pick

POLICIES = ("top_bottom", "top", "bottom", "first", "random")


def _samples(rows: Sequence[tuple[str, float]]) -> list[dict[str, object]]:
    return [
        {"prompt": f"q {g}", "response": f"a {i}", "reward": r, "group_uid": g, "uid": i}
        for i, (g, r) in enumerate(rows)
    ]


def _session_pick(
    rows: Sequence[tuple[str, float]],
    cuts: Sequence[int],
    k: int,
    sampler: at.GroupSampler,
    *,
    redact: bool,
) -> set[int]:
    """What a session writes when the rows of step 0 come in calls cut at `cuts`."""
    sink = at.testing.MemorySink()
    samples = _samples(rows)
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(samples)}), len(samples)]
    with at.TraceSession(
        "p", sinks=[sink], max_traces_per_step=k, sampler=sampler, redact=(lambda s: s) if redact else None
    ) as s:
        for a, b in itertools.pairwise(bounds):
            if b > a:
                s.log_samples(samples[a:b], step=0)
    st_ = s.stats()
    assert st_.check() and st_.written + st_.dropped.get("capped", 0) == len(rows)
    return {int(r.sample.metadata["uid"]) for r in sink.records}


def test_a_group_that_grows_past_the_cap_is_dropped_whole() -> None:
    """Issue 27 case 4: A x2, B x2, then A x3 in a second call with a cap of 4 writes B only, on the
    precheck path and the encode-everything path (redact) alike."""
    rows = [("A", 3.0)] * 2 + [("B", 1.0)] * 2 + [("A", 3.0)] * 3
    for redact in (False, True):
        assert _session_pick(rows, [4], 4, at.GroupSampler("top"), redact=redact) == {2, 3}


def test_a_split_group_is_never_written_in_part() -> None:
    """Issue 27 case 4, counting samples: a group of 6 brought by three calls, with a cap of 4, is
    never written 4 of 6; the next group that fits (g2, 3 samples) is written instead."""
    calls = [
        [("g3", 3.0)],
        [("g3", 3.0)] * 3 + [("g2", 2.0)] * 3 + [("g0", 0.0)] * 3 + [("g1", 1.0)] * 3,
        [("g0", 0.0)] + [("g1", 1.0)] * 3 + [("g3", 3.0)] * 2,
    ]
    rows = [r for call in calls for r in call]
    for redact in (False, True):
        got = _session_pick(rows, [1, 13], 4, at.GroupSampler("top"), redact=redact)
        assert got == pick(rows, 4, "top") == {4, 5, 6}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_cap_of_one_group_keeps_one_group(policy: str, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 27 case 5: three groups of 16 with max_traces_per_step=16 write one whole group, with
    every mode, and warn of nothing."""
    rng = random.Random(5)
    rows = [(f"g{g}", rng.random()) for g in range(3) for _ in range(16)]
    with caplog.at_level(logging.WARNING, logger="asynctrace"):
        got = _session_pick(rows, [16, 32], 16, at.GroupSampler(policy), redact=False)  # type: ignore[arg-type]
    assert len(got) == 16 and len({rows[i][0] for i in got}) == 1
    assert got == pick(rows, 16, policy)
    assert not [r for r in caplog.records if "larger than" in r.getMessage()]


def test_an_oversized_group_is_skipped_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    """A top group larger than the cap does not block the groups after it; one warning names the sizes."""
    rows = [("big", 9.0)] * 12 + [(f"g{g}", float(g)) for g in range(4) for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger="asynctrace"):
        got = _session_pick(rows, [12], 8, at.GroupSampler("top"), redact=False)
    assert {rows[i][0] for i in got} == {"g3", "g2"} and len(got) == 8
    warned = [r.getMessage() for r in caplog.records if "larger than" in r.getMessage()]
    assert len(warned) == 1 and "12 samples" in warned[0] and "max_traces_per_step=8" in warned[0]


def _gate_pick(
    rows: Sequence[tuple[str, float]],
    cuts: Sequence[int],
    k: int,
    sampler: at.GroupSampler,
    *,
    precheck: bool,
) -> set[int]:
    """The gate alone: each call asks `keeps` first and offers only those (the precheck path),
    or offers every sample (the encode-first path); returns the rows released at close."""
    gate = Gate(k, sampler, max_open_steps=2, step_timeout=None)
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(rows)}), len(rows)]
    row_of: dict[int, int] = {}
    seq = 0
    for a, b in itertools.pairwise(bounds):
        call = list(range(a, b))
        if not call:
            continue
        if precheck:
            keeps = gate.keeps("train", 0, [rows[i][1] for i in call], seq + 1, [rows[i][0] for i in call])
            assert keeps is not None
            call = [i for i, keep in zip(call, keeps, strict=True) if keep]
        entries = []
        for i in call:
            seq += 1
            e = Entry(rows[i][1], seq, group=rows[i][0])
            row_of[id(e)] = i
            entries.append(e)
        gate.offer("train", 0, entries, 0.0)
    dropped: list[Entry] = []
    return {row_of[id(e)] for e in gate.close_all(dropped=dropped)}


_rows = st.lists(
    st.tuples(st.sampled_from([f"g{i}" for i in range(7)]), st.sampled_from([0.0, 0.5, 1.0, 2.0])),
    min_size=1,
    max_size=40,
)


def _at_most(rows: Sequence[tuple[str, float]], size: int | None, policy: str) -> list[tuple[str, float]]:
    """The rows with no group past `size` samples (the promise `group_size` makes); for
    "top_bottom", whose order of the other groups changes when one is left out, only groups of
    exactly `size` samples (choosing.md)."""
    if size is None:
        return list(rows)
    seen: dict[str, int] = {}
    out = []
    for g, r in rows:
        seen[g] = seen.get(g, 0) + 1
        if seen[g] <= size:
            out.append((g, r))
    if policy == "top_bottom":
        out = [(g, r) for g, r in out if seen[g] >= size]
    return out or [("g0", 0.0)] * size


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=_rows,
    cuts=st.lists(st.integers(0, 40), max_size=5),
    k=st.integers(1, 12),
    policy=st.sampled_from(POLICIES),
    stat=st.sampled_from(["mean", "spread"]),
    count=st.sampled_from(["samples", "groups"]),
    group_size=st.sampled_from([None, 1, 2, 3, 4]),
)
def test_gate_paths_equal_the_oracle(
    rows: list[tuple[str, float]],
    cuts: list[int],
    k: int,
    policy: str,
    stat: str,
    count: str,
    group_size: int | None,
) -> None:
    """Whatever the call boundaries, the precheck path (`keeps`) and the offer-everything path keep
    exactly the oracle's whole groups, with or without `group_size` (no group larger than it)."""
    rows = _at_most(rows, group_size, policy)
    sampler = at.GroupSampler(policy, stat=stat, count=count, group_size=group_size)  # type: ignore[arg-type]
    expected = pick(rows, k, policy, stat=stat, count=count)
    assert _gate_pick(rows, cuts, k, sampler, precheck=False) == expected
    assert _gate_pick(rows, cuts, k, sampler, precheck=True) == expected
    if group_size is not None:  # the hint changes what is held, never what is written
        plain = at.GroupSampler(policy, stat=stat, count=count)  # type: ignore[arg-type]
        assert _gate_pick(rows, cuts, k, plain, precheck=True) == expected


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=_rows,
    cuts=st.lists(st.integers(0, 40), max_size=3),
    k=st.integers(1, 10),
    policy=st.sampled_from(POLICIES),
    count=st.sampled_from(["samples", "groups"]),
    group_size=st.sampled_from([None, 2, 3]),
)
def test_session_paths_equal_the_oracle(
    rows: list[tuple[str, float]], cuts: list[int], k: int, policy: str, count: str, group_size: int | None
) -> None:
    """A session writes the oracle's groups whole, with and without `redact` (the two encoding paths)."""
    rows = _at_most(rows, group_size, policy)
    sampler = at.GroupSampler(policy, count=count, group_size=group_size)  # type: ignore[arg-type]
    expected = pick(rows, k, policy, count=count)
    assert _session_pick(rows, cuts, k, sampler, redact=False) == expected
    assert _session_pick(rows, cuts, k, sampler, redact=True) == expected


def _merge(
    sampler: at.GroupSampler, k: int, rows: Sequence[tuple[str, float]], cuts: Sequence[int]
) -> set[int]:
    """Each part (the rows between cuts) selects on its own, as a rank or actor would; what crosses
    the process boundary (score, seq, key, group) is merged."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(rows)}), len(rows)]
    parts = []
    for p, (a, b) in enumerate(itertools.pairwise(bounds)):
        sel = sampler.new_part_step("train", 0, k, p)
        entries = [Entry(rows[i][1], i, group=rows[i][0]) for i in range(a, b)]
        sel.offer_all(entries)
        parts.append([Entry(e.score, e.seq, key=e.key, group=e.group) for e in sel.held()])
    seqs = {id(e): e.seq for part in parts for e in part}
    return {seqs[id(e)] for e in sampler.merge("train", 0, k, parts)}


@settings(max_examples=300, deadline=None)
@given(
    rows=_rows,
    cuts=st.lists(st.integers(0, 40), max_size=3),
    k=st.integers(1, 12),
    policy=st.sampled_from(POLICIES),
    count=st.sampled_from(["samples", "groups"]),
    seed=st.sampled_from([0, 7, None]),
    group_size=st.sampled_from([None, 2, 3]),
)
def test_merged_parts_equal_one_process(
    rows: list[tuple[str, float]],
    cuts: list[int],
    k: int,
    policy: str,
    count: str,
    seed: int | None,
    group_size: int | None,
) -> None:
    """Issue 27 case 6: parts merged (groups may span parts) keep what one process keeps, for every
    mode; `random` included, its keys derived from the seed and the group id."""
    rows = _at_most(rows, group_size, policy)
    sampler = at.GroupSampler(policy, count=count, seed=seed, group_size=group_size)  # type: ignore[arg-type]
    one = _gate_pick(rows, [], k, sampler, precheck=False)
    assert _merge(sampler, k, rows, cuts) == one
    if seed is not None:
        assert one == pick(rows, k, policy, count=count, seed=seed)


def test_random_keys_are_the_same_in_every_process() -> None:
    """Two samplers with one seed (two processes) rank groups alike; another seed ranks them differently."""
    rows = [(f"g{g}", 0.0) for g in range(40) for _ in range(2)]
    a = _gate_pick(rows, [], 8, at.GroupSampler("random", seed=3), precheck=False)
    b = _gate_pick(rows, [], 8, at.GroupSampler("random", seed=3), precheck=False)
    c = _gate_pick(rows, [], 8, at.GroupSampler("random", seed=4), precheck=False)
    assert a == b == pick(rows, 8, "random", seed=3) and a != c


@pytest.mark.parametrize("policy", POLICIES)
def test_group_size_refuses_groups_before_encoding(policy: str) -> None:
    """With `group_size`, a step of 128 groups of 8 logged 4 groups a call has most of its samples
    refused by `keeps` (never encoded) and holds few; the pick is the oracle's, as without it."""
    rng = random.Random(11)
    rows = [(f"g{g}", float(rng.randrange(5))) for g in range(128) for _ in range(8)]
    sel = at.GroupSampler(policy, group_size=8).new_step("train", 0, 16)  # type: ignore[arg-type]
    offered: list[Entry] = []
    most_held = 0
    for a in range(0, len(rows), 32):
        call = rows[a : a + 32]
        keeps = sel.keeps([r for _, r in call], a + 1, groups=[g for g, _ in call])  # type: ignore[call-arg]
        entries = [
            Entry(r, a + j, group=g) for j, ((g, r), k) in enumerate(zip(call, keeps, strict=True)) if k
        ]
        sel.offer_all(entries)
        offered.extend(entries)
        most_held = max(most_held, len(sel.held()))
    assert len(offered) < len(rows) / 3
    assert most_held <= 16 + 32  # the groups that may still be taken, and one call's
    assert {e.seq for e in sel.close()[0]} == pick(rows, 16, policy)


def test_top_bottom_refuses_a_complete_group_outside_its_alternation() -> None:
    """`group_size=2`, a cap of two groups: once a best and a worst complete group are held, a
    complete group between them can never be taken (the alternation takes the best, then the
    worst) and is refused before encoding; one above the best or below the worst still enters."""
    sel = at.GroupSampler("top_bottom", group_size=2).new_step("train", 0, 4)
    held = [Entry(r, i, group=g) for i, (g, r) in enumerate([("A", 5.0), ("A", 5.0), ("B", 1.0), ("B", 1.0)])]
    sel.offer_all(held)
    between, above, below = [3.0, 3.0], [9.0, 9.0], [0.0, 0.0]
    assert sel.keeps(between, 5, groups=["C", "C"]) == [False, False]  # type: ignore[call-arg]
    assert sel.keeps(above, 5, groups=["D", "D"]) == [True, True]  # type: ignore[call-arg]
    assert sel.keeps(below, 5, groups=["E", "E"]) == [True, True]  # type: ignore[call-arg]


def test_a_selected_tier_writes_whole_groups_and_counts_the_rest() -> None:
    """Issue 27 case 4 in a `Selected` tier: the tier decides when its step closes, writes B only,
    and counts A's five samples as capped for that sink alone."""
    from asynctrace.sinks import Selected

    archive, tracker = at.testing.MemorySink(name="archive"), at.testing.MemorySink(name="tracker")
    samples = _samples([("A", 3.0)] * 2 + [("B", 1.0)] * 2 + [("A", 3.0)] * 3)
    with at.TraceSession(
        "p", sinks=[archive, Selected(tracker, max_traces_per_step=4, sampler=at.GroupSampler("top"))]
    ) as s:
        s.log_samples(samples[:4], step=0)
        s.log_samples(samples[4:], step=0)
    st = s.stats()
    assert sorted(int(r.sample.metadata["uid"]) for r in tracker.records) == [2, 3]
    assert len(archive.records) == 7 and st.sinks["tracker"].skipped == {"capped": 5}
    assert st.sinks["tracker"].held == 0 and st.check()


def test_holding_a_large_step_without_group_size_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    """Without `group_size` a step of 2,048 samples is held whole until it closes; one warning says
    so and names the remedy; with it, nothing is said."""
    rows = [(f"g{g}", float(g % 5)) for g in range(256) for _ in range(8)]
    for size, warnings in ((None, 1), (8, 0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="asynctrace"):
            _gate_pick(
                rows, list(range(64, len(rows), 64)), 16, at.GroupSampler(group_size=size), precheck=True
            )
        said = [r.getMessage() for r in caplog.records if "group_size" in r.getMessage()]
        assert len(said) == warnings and all("holds" in m for m in said)
