"""The selection tools together across Ray actors: the collector's cap, a `Selected` tier and the
watch list, with clients that select locally or ship everything, against the one-process oracle
of tests/_composition.py (written from the docs)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest

ray = pytest.importorskip("ray")

import asynctrace as at  # noqa: E402
from asynctrace.ray import ClientStats, start_collector  # noqa: E402
from asynctrace.sinks import JsonlSink  # noqa: E402
from tests._composition import GROUP_SEED, WATCHED, Row, oracle, sample  # noqa: E402
from tests.distributed._ray_actor import Producer  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_cluster")

GROUP_SIZE = 4
TIER = 4
# The collector's cap: (the oracle's name for it, k, the sampler given to the collector).
CAPS: dict[str, tuple[str, int, Any]] = {
    "top_bottom-6": ("top_bottom", 6, "top_bottom"),
    "group-random-8": (
        "group:random",
        8,
        at.GroupSampler("random", key="prompt_id", seed=GROUP_SEED, group_size=GROUP_SIZE),
    ),
    "group-top-8": (
        "group:top",
        8,
        at.GroupSampler("top", key="prompt_id", seed=GROUP_SEED, group_size=GROUP_SIZE),
    ),
}


@pytest.fixture(scope="module")
def producers(ray_cluster: None) -> list[Any]:
    """Three rollout actors for the module (an actor process takes seconds to start)."""
    actors = [ray.remote(Producer).remote() for _ in range(3)]
    ray.get([a.__ray_ready__.remote() for a in actors])
    return actors


# One collector per (cap, watch list), for both kinds of client: each logs its own split, so the
# two never meet in one (split, step) (docs/distributed.md). The budget test has its own.
COLLECTORS: dict[str, tuple[int, Any, at.Watch | None]] = {
    f"{cap}-{watch}": (CAPS[cap][1], CAPS[cap][2], at.Watch(ids=[WATCHED]) if watch == "watch" else None)
    for cap in CAPS
    for watch in ("no-watch", "watch")
}
COLLECTORS["budget"] = (4, "top_bottom", at.Watch(ids=[WATCHED], max_per_step=3))


@pytest.fixture(scope="module")
def collectors(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[Any, Path, Path]]]:
    """Every collector of the module, started side by side (each is a process: a second or
    more), with the JSONL files of its archive and its tier."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in COLLECTORS}

    def start(name: str) -> tuple[Any, Path, Path]:
        k, sampler, watch = COLLECTORS[name]
        sinks, plain_path, tier_path = _sinks(dirs[name])
        collector = start_collector(
            "ray-composition",
            sinks=sinks,
            max_traces_per_step=k,
            sampler=sampler,
            watch=watch,
            step_timeout=None,
            health_metrics=False,
            finish_at_exit=False,
        )
        return collector, plain_path, tier_path

    with ThreadPoolExecutor(4) as pool:
        started = dict(zip(COLLECTORS, pool.map(start, COLLECTORS), strict=True))
    yield started
    for collector, _, _ in started.values():
        ray.kill(collector, no_restart=True)


def _steps(seed: int, n_steps: int = 3, groups: int = 4) -> list[list[Row]]:
    """GRPO-like steps: `groups` prompt groups of GROUP_SIZE with distinct rewards, and the
    watched prompt's group in every step but the first."""
    rng = random.Random(seed)
    per_step = (groups + 1) * GROUP_SIZE
    rewards = iter(rng.sample(range(10_000), n_steps * per_step))
    out = []
    for step in range(n_steps):
        prompts = [f"p{step}-{g}" for g in range(groups)] + ([WATCHED] if step else [])
        out.append(
            [Row(f"s{step}-{p}-{j}", p, next(rewards) / 7.0) for p in prompts for j in range(GROUP_SIZE)]
        )
    return out


def _deal(rows: list[Row], n: int, rng: random.Random) -> list[list[list[at.Sample]]]:
    """A step's rows shuffled over `n` actors, each actor's share in calls of 1 to 3 samples."""
    shuffled = rows[:]
    rng.shuffle(shuffled)
    out = []
    for mine in (shuffled[i::n] for i in range(n)):
        calls, i = [], 0
        while i < len(mine):
            size = rng.randint(1, 3)
            calls.append([sample(r) for r in mine[i : i + size]])
            i += size
        out.append(calls)
    return out


def _sinks(tmp_path: Path) -> tuple[list[Any], Path, Path]:
    plain, tracker = JsonlSink(tmp_path / "plain.jsonl"), JsonlSink(tmp_path / "tier.jsonl")
    plain.name, tracker.name = "plain", "tier"
    tier = at.Selected(tracker, max_traces_per_step=TIER, sampler="top_bottom")
    return [plain, tier], plain.path, tracker.path


def _held(path: Path, split: str) -> dict[int, set[str]]:
    """The uids a JSONL file holds for `split`, per step."""
    out: dict[int, set[str]] = {}
    for line in path.read_bytes().splitlines() if path.exists() else []:
        record = orjson.loads(line)
        if record["split"] == split:
            out.setdefault(record["step"], set()).add(record["sample"]["metadata"]["uid"])
    return out


def _run(
    producers: list[Any],
    collector: Any,
    split: str,
    calls: list[list[list[list[at.Sample]]]],
) -> tuple[list[ClientStats], Any, Any]:
    """Each step's calls logged by every actor at once; then each ends its step and flushes, so
    the collector has a step's parts before any of the next step's. Returns the clients' final
    stats, and the collector's before and after (flushed: every step of `split` written)."""
    before = ray.get(collector.stats.remote())
    for step, dealt in enumerate(calls):
        ray.get([p.log.remote(step, mine, split) for p, mine in zip(producers, dealt, strict=True)])
        assert all(ray.get([p.end_step.remote(step) for p in producers]))
    clients: list[ClientStats] = ray.get([p.close.remote() for p in producers])
    assert ray.get(collector.flush.remote(30.0))
    return clients, before, ray.get(collector.stats.remote())


def _settled(stats: Any) -> int:
    return int(stats.written + stats.failed + stats.dropped_total)


def _accounting(clients: list[ClientStats], before: Any, after: Any, logged: int) -> None:
    """Every client's and the collector's invariant, and what this run added on both sides adds
    up to every sample it logged; nothing late, in the collector or the tier."""
    assert all(c.check() and c.held == 0 and c.buffered == 0 and c.in_flight == 0 for c in clients)
    assert after.check() and after.pending == 0
    assert sum(c.submitted for c in clients) == logged
    added = _settled(after) - _settled(before)
    assert logged == added + sum(c.dropped_total for c in clients)
    assert sum(c.delivered for c in clients) == after.submitted - before.submitted
    assert "late" not in after.dropped and "late" not in after.sinks["tier"].skipped


@pytest.mark.parametrize("local", [True, False], ids=["local", "ship-all"])
@pytest.mark.parametrize("cap", list(CAPS))
@pytest.mark.parametrize("watch", [False, True], ids=["no-watch", "watch"])
def test_actors_write_what_the_oracle_says(
    producers: list[Any], collectors: dict[str, tuple[Any, Path, Path]], local: bool, cap: str, watch: bool
) -> None:
    """Three actors log each step's rows shuffled, in calls of 1 to 3: the archive and the
    top_bottom tier hold exactly the oracle's pick per step, groups whole, the watched prompt in
    every step it was logged in (in the tier too), nothing late, the accounting exact."""
    name, k, _ = CAPS[cap]
    collector, plain_path, tier_path = collectors[f"{cap}-{'watch' if watch else 'no-watch'}"]
    split = "local" if local else "ship-all"
    ray.get(
        [
            p.connect.remote(collector, select_locally=local, flush_interval=0.01, step_timeout=None)
            for p in producers
        ]
    )
    seed = sum(map(ord, cap)) + 2 * watch + local
    steps = _steps(seed)
    rng = random.Random(seed)
    calls = [_deal(rows, len(producers), rng) for rows in steps]
    clients, before, after = _run(producers, collector, split, calls)

    want_plain, want_tier = oracle(steps, (name, k), TIER, watch, split=split)
    got_plain, got_tier = _held(plain_path, split), _held(tier_path, split)
    assert got_plain == want_plain
    assert got_tier == want_tier
    for step, rows in enumerate(steps):
        watched = {r.uid for r in rows if r.prompt_id == WATCHED}
        if watch:  # the watched prompt, whole, in every step it was logged in, in every sink
            assert watched <= got_plain[step] and watched <= got_tier[step]
        if name.startswith("group:"):  # every other group whole or not at all
            for prompt in {r.prompt_id for r in rows} - ({WATCHED} if watch else set()):
                group = {r.uid for r in rows if r.prompt_id == prompt}
                assert group <= got_plain[step] or not group & got_plain[step], (step, prompt)
    _accounting(clients, before, after, sum(map(len, steps)))
    assert after.written - before.written == sum(len(v) for v in want_plain.values())


def test_the_watch_budget_is_spent_once_across_actors(
    producers: list[Any], collectors: dict[str, tuple[Any, Path, Path]]
) -> None:
    """max_per_step=3 over two actors: the first three watched samples to reach the collector
    pass; the rest, the fourth of actor A (past its own three) and both of B (past the
    collector's three), compete for the cap like any other sample, so the extreme ones are kept
    and the middle one is not, as the oracle says for rows in that order."""
    collector, plain_path, tier_path = collectors["budget"]
    a, b, _ = producers
    ray.get([p.connect.remote(collector, flush_interval=0.01, step_timeout=None) for p in (a, b)])
    rows_a = [Row(f"a{i}", WATCHED, 50.0 + i) for i in range(3)] + [Row("a-top", WATCHED, 99.0)]
    rows_a += [Row(f"a-o{i}", f"p{i}", 10.0 + i) for i in range(4)]
    rows_b = [Row("b-low", WATCHED, 0.5), Row("b-mid", WATCHED, 15.0)]
    rows_b += [Row(f"b-o{i}", f"p{i}", 20.0 + i) for i in range(4)]
    before = ray.get(collector.stats.remote())
    for producer, rows in ((a, rows_a), (b, rows_b)):  # A's samples reach the collector first
        ray.get(producer.log.remote(0, [[sample(r)] for r in rows]))
        assert ray.get(producer.end_step.remote(0))
    clients = ray.get([a.close.remote(), b.close.remote()])
    assert ray.get(collector.flush.remote(30.0))
    after = ray.get(collector.stats.remote())

    want_plain, want_tier = oracle([rows_a + rows_b], ("top_bottom", 4), TIER, True, max_per_step=3)
    assert _held(plain_path, "train") == want_plain
    assert _held(tier_path, "train") == want_tier
    assert {"a0", "a1", "a2", "a-top", "b-low"} <= want_plain[0] and "b-mid" not in want_plain[0]
    _accounting(clients, before, after, len(rows_a) + len(rows_b))
