"""TraceClient selects locally before it ships: exact over the whole step, O(k) bytes per step."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest

ray = pytest.importorskip("ray")

from asynctrace import GroupSampler, Sampler, StepSelection, TraceSession  # noqa: E402
from asynctrace._select.base import Entry  # noqa: E402
from asynctrace.ray import ClientStats, TraceClient, start_collector  # noqa: E402
from asynctrace.testing import MemorySink  # noqa: E402
from tests.distributed._helpers import make_groups, make_samples, top_bottom_uids, uids_by_step  # noqa: E402

K = 8
STEPS = 3
GROUP_SIZE = 4


pytestmark = pytest.mark.usefixtures("ray_cluster")


class _Rollout:
    """A rollout actor logging through a TraceClient of its own, to whichever collector a test gives."""

    def connect(self, collector: Any, tag: str, **client_kwargs: Any) -> None:
        self.tag = tag
        self.client = TraceClient(collector, **client_kwargs)

    def generate(self, step: int, n: int, chunk: int = 10) -> list[dict[str, Any]]:
        samples = make_samples(self.tag, step, n, seed=0)
        for i in range(0, n, chunk):
            self.client.log_samples_nowait(samples[i : i + chunk], step=step)
        return samples

    def generate_groups(self, step: int, n: int) -> list[dict[str, Any]]:
        """`n` samples in whole prompt groups, each group logged in one call, as a rollout worker does."""
        groups = make_groups(self.tag, step, n // GROUP_SIZE, GROUP_SIZE, seed=0)
        for group in groups:
            self.client.log_samples_nowait(group, step=step)
        return [s for group in groups for s in group]

    def flush(self) -> bool:
        return self.client.flush(30.0)

    def close(self) -> ClientStats:
        return self.client.close(30.0)


Rollout: Any = ray.remote(_Rollout)


@pytest.fixture(scope="module")
def pool(ray_cluster: None) -> list[Any]:
    """Four rollout actors for the module: an actor process takes seconds to start."""
    actors = [Rollout.remote() for _ in range(4)]
    ray.get([a.__ray_ready__.remote() for a in actors])
    return actors


@pytest.fixture(scope="module")
def top_bottom_collector(ray_cluster: None) -> Iterator[Any]:
    """A collector keeping the top/bottom 4 of each step in memory, for tests of the client alone."""
    collector = start_collector(
        "local-selection",
        sinks=[MemorySink()],
        max_traces_per_step=4,
        sampler="top_bottom",
        finish_at_exit=False,
    )
    yield collector
    ray.kill(collector, no_restart=True)


def _one_process(
    sampler: str | Sampler, produced: dict[int, list[dict[str, Any]]], call: int | None = None
) -> dict[int, set[str]]:
    """What a single session chooses when it logs every step's samples itself, in actor order
    (`call` samples a call: whole groups for a group sampler)."""
    sink = MemorySink()
    session = TraceSession(
        "reference", sinks=[sink], max_traces_per_step=K, sampler=sampler, step_timeout=None
    )
    sync = session.start()
    for step, samples in sorted(produced.items()):
        size = call or len(samples)
        for i in range(0, len(samples), size):
            sync.log_samples(samples[i : i + size], step=step)
    sync.finish(30.0)
    return {step: {r.sample.metadata["uid"] for r in rows} for step, rows in sink.steps().items()}


def _wait_for(what: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "condition not reached within the deadline"
        time.sleep(0.01)


def _sampler(name: str) -> str | Sampler:
    return GroupSampler() if name == "group" else name


@pytest.mark.parametrize("sampler", ["first", "top_bottom", "reservoir", "group"])
def test_collector_selects_what_one_process_would(project: str, sampler: str, pool: list[Any]) -> None:
    """4 actors with a cap: each ships only its k candidates a step (whatever it logged; the group
    sampler's actors ship every candidate, decided on whole groups by the collector), and
    Trackio holds exactly what one process logging every sample would keep (whole prompt groups
    for the group sampler; for reservoir, an exact uniform merge of the actors' keyed picks, k a
    step, which is not one process's draw); the accounting of clients and collector adds up."""
    collector = start_collector(
        project,
        "sel",
        max_traces_per_step=K,
        sampler=_sampler(sampler),
        step_timeout=None,
        finish_at_exit=False,
    )
    # Unequal on purpose: a small actor ships all it has. Multiples of the group size.
    sizes = [4, 20, 60, 200]
    actors = pool
    ray.get([a.connect.remote(collector, f"a{i}", flush_interval=0.02) for i, a in enumerate(actors)])
    produced: dict[int, list[dict[str, Any]]] = {}
    for step in range(STEPS):
        # One actor after another, each flushed: the collector sees actor order, as the reference.
        for actor, n in zip(actors, sizes, strict=True):
            generate = actor.generate_groups if sampler == "group" else actor.generate
            produced.setdefault(step, []).extend(ray.get(generate.remote(step, n)))
            assert ray.get(actor.flush.remote())
    clients: list[ClientStats] = ray.get([a.close.remote() for a in actors])
    final = ray.get(collector.finish.remote())

    written = uids_by_step(project, "sel")
    if sampler == "reservoir":
        assert written.keys() == produced.keys()
        for step, uids in written.items():
            assert uids <= {s["uid"] for s in produced[step]}
    else:
        call = GROUP_SIZE if sampler == "group" else None
        assert written == _one_process(_sampler(sampler), produced, call)
    assert all(len(uids) == K for uids in written.values())
    if sampler == "group":
        groups = [uid.rpartition(":")[0] for uids in written.values() for uid in uids]
        assert all(groups.count(g) == GROUP_SIZE for g in groups)  # whole groups only
    for stats, n in zip(clients, sizes, strict=True):
        assert stats.check() and stats.held == 0
        # The group sampler decides on whole groups at the collector: an actor ships every candidate.
        shipped = STEPS * (n if sampler == "group" else min(n, K))
        assert stats.delivered == shipped
        assert stats.dropped == ({"capped": STEPS * n - shipped} if shipped < STEPS * n else {})
    assert final.check()
    assert sum(c.submitted for c in clients) == STEPS * sum(sizes)
    client_dropped = sum(c.dropped_total for c in clients)
    assert sum(c.submitted for c in clients) == (
        final.written + final.failed + final.pending + final.dropped_total + client_dropped
    )


@pytest.mark.parametrize("sampler", ["top_bottom", "group"])
def test_bytes_shipped_per_step_do_not_grow_with_samples(project: str, sampler: str, pool: list[Any]) -> None:
    """An actor logging 20 or 2000 samples a step ships the same k candidates (for the group
    sampler told the group size, the groups that may still be taken: at most 2k samples): what
    crosses to the collector is O(k) per step, whatever the actor logged."""
    collector = start_collector(
        project,
        sinks=[MemorySink()],
        max_traces_per_step=K,
        sampler=GroupSampler(group_size=GROUP_SIZE) if sampler == "group" else sampler,
        finish_at_exit=False,
    )
    shipped: dict[int, ClientStats] = {}
    for n, actor in zip((20, 2000), pool, strict=False):
        ray.get(actor.connect.remote(collector, f"b{n}", flush_interval=0.02))
        for step in range(STEPS):
            if sampler == "group":
                ray.get(actor.generate_groups.remote(step, n))
            else:
                ray.get(actor.generate.remote(step, n, 100))
        shipped[n] = ray.get(actor.close.remote())
    ray.get(collector.finish.remote())
    small, large = shipped[20], shipped[2000]
    assert large.calls <= STEPS  # one call per step at most: candidates of a closed step go together
    assert large.dropped == {"capped": STEPS * 2000 - large.delivered}
    if sampler == "group":
        # Shipping every sample would cost 100 times the small actor's bytes.
        assert small.delivered <= large.delivered <= STEPS * 2 * K
        assert large.bytes_shipped < 2 * small.bytes_shipped
        return
    assert small.delivered == large.delivered == STEPS * K
    # Samples differ only in the digits of their ids and rewards: the same k cost the same bytes
    # to within 10%, where shipping every sample would cost 100 times more.
    assert abs(large.bytes_shipped - small.bytes_shipped) < 0.1 * small.bytes_shipped


def test_a_step_closes_on_the_next_step_on_end_step_and_when_idle(top_bottom_collector: Any) -> None:
    """A client ships a step's candidates, without flush, when a newer step is logged, on
    end_step(step), and after step_timeout seconds without samples for it."""
    collector = top_bottom_collector
    client = TraceClient(collector, flush_interval=0.01, step_timeout=None)
    client.log_samples_nowait(make_samples("n", 0, 20, seed=0), step=0)
    assert client.stats().held == 4 and client.stats().dropped == {"capped": 16}
    client.log_samples_nowait(make_samples("n", 1, 20, seed=0), step=1)  # closes step 0 here
    _wait_for(lambda: client.stats().delivered == 4)
    assert client.stats().held == 4
    client.end_step(1)
    _wait_for(lambda: client.stats().delivered == 8)
    assert client.stats().held == 0
    client.close(30.0)

    idle = TraceClient(collector, flush_interval=0.01, step_timeout=0.2)
    idle.log_samples_nowait(make_samples("i", 5, 20, seed=0), step=5)
    # Nothing else is logged and nothing flushed (a client without the timeout holds its step,
    # as `client` did above): the timeout ships the step's candidates.
    _wait_for(lambda: idle.stats().delivered == 4)
    assert idle.stats().held == 0
    assert idle.close(30.0).check()


def test_samples_after_a_step_closed_locally_merge_exactly(project: str) -> None:
    """Samples logged for a step the client already shipped start a new local selection; the
    collector, which still has the step open, keeps the true top/bottom over both rounds."""
    collector = start_collector(
        project,
        "rounds",
        max_traces_per_step=6,
        sampler="top_bottom",
        step_timeout=None,
        finish_at_exit=False,
    )
    client = TraceClient(collector, flush_interval=0.01)
    first, second = make_samples("r1", 0, 30, seed=0), make_samples("r2", 0, 30, seed=1)
    client.log_samples_nowait(first, step=0)
    client.end_step(0)
    client.log_samples_nowait(second, step=0)
    stats = client.close(30.0)
    final = ray.get(collector.finish.remote())
    assert stats.delivered == 12 and stats.dropped == {"capped": 48}
    assert uids_by_step(project, "rounds") == {0: top_bottom_uids(first + second, 6)}
    assert final.check() and final.written == 6


def test_client_without_local_selection_ships_everything(top_bottom_collector: Any) -> None:
    """select_locally=False ships every sample and leaves the whole selection to the collector."""
    client = TraceClient(top_bottom_collector, select_locally=False, flush_interval=0.01)
    client.log_samples_nowait(make_samples("all", 0, 40, seed=0), step=0)
    assert client.stats().held == 0
    stats = client.close(30.0)
    assert stats.delivered == 40 and stats.dropped == {}


def test_unscored_sample_is_refused_in_the_caller_under_top_bottom(top_bottom_collector: Any) -> None:
    """With a top_bottom collector, a sample without a score is a RecordError in the actor's own
    call (or counted "invalid" with on_invalid="skip"), as in a session: the local selection
    ranks by score."""
    from asynctrace import RecordError

    strict = TraceClient(top_bottom_collector)
    with pytest.raises(RecordError, match="score"):
        strict.log_samples_nowait([{"prompt": "q", "response": "no reward"}], step=0)
    skipping = TraceClient(top_bottom_collector, on_invalid="skip")
    assert skipping.log_samples_nowait([{"prompt": "q", "response": "a"}], step=0) == 0
    assert skipping.close(30.0).dropped == {"invalid": 1}
    strict.close(1.0)


class _ByPriority(Sampler):
    """Keeps the k samples with the highest metadata "priority": it reads the sample itself."""

    def new_step(self, split: str, step: int, k: int) -> StepSelection:
        return _ByPrioritySelection(k)


class _ByPrioritySelection(StepSelection):
    def __init__(self, k: int) -> None:
        self.k = k
        self.kept: list[tuple[int, Entry]] = []

    def offer(self, entry: Entry) -> tuple[bool, Entry | None]:
        assert entry.record is not None
        self.kept.append((entry.record.sample.metadata["priority"], entry))
        self.kept.sort(key=lambda pe: -pe[0])
        if len(self.kept) <= self.k:
            return True, None
        _, out = self.kept.pop()
        return (False, None) if out is entry else (True, out)

    def held(self) -> list[Entry]:
        return [e for _, e in self.kept]


def test_local_selection_plugs_in_a_custom_sampler() -> None:
    """A custom Sampler gets each sample's record (it can read its metadata, as a group sampler
    does); steps close on a newer step past max_open_steps and after step_timeout on the clock
    given, releasing their candidates in arrival order with their rows, as the client's part."""
    from asynctrace import Sample
    from asynctrace._fronts.selection import PartSelection
    from asynctrace._records.encode import encode_samples

    local = PartSelection.streaming(2, _ByPriority(), 3, max_open_steps=1, step_timeout=10.0)

    def encoded(step: int, priorities: list[int]) -> list[tuple[bytes, float | None]]:
        samples = [Sample(messages=[], metadata={"priority": p, "step": step}) for p in priorities]
        return encode_samples(samples)[0]

    assert local.offer("train", 0, encoded(0, [1, 5, 3, 4]), now=0.0) == (2, 2, [])
    assert local.held == 2
    assert local.offer("train", 1, encoded(1, [7]), now=1.0)[2] == []  # step 0 stays open (window 1)
    released = local.offer("train", 2, encoded(2, [9]), now=2.0)[2]  # step 0 closes
    priorities = [[orjson.loads(p)["metadata"]["priority"] for p in ps] for *_, ps, _ in released]
    assert [(split, step, part) for split, step, part, _, _ in released] == [("train", 0, 3)]
    assert priorities == [[5, 4]]  # the step's two best, in arrival order
    assert [seq for seq, _, _ in released[0][4]] == [2, 4]  # their sequence numbers, for the merge
    assert local.close_idle(now=10.5) == []
    assert [step for _, step, *_ in local.close_idle(now=11.0)] == [1]
    assert local.next_due(now=11.0) == pytest.approx(1.0)
    assert [step for _, step, *_ in local.close_all()] == [2]
    assert local.held == local.held_bytes == 0


def test_collector_merges_reservoir_parts_by_key_and_counts_late_parts() -> None:
    """The collector's merge keeps the k smallest keys over every part (an exact uniform merge),
    closes a step on a newer step past max_open_steps, on idle time and on demand, and counts
    a part for a step already merged as late."""
    from asynctrace import ReservoirSampler
    from asynctrace.ray._merge import StepMerge

    merge = StepMerge(3, ReservoirSampler(), max_open_steps=0, step_timeout=10.0)
    keys = {1: [0.9, 0.2, 0.5], 2: [0.1, 0.7], 3: [0.3]}
    for part, ks in keys.items():
        payloads = [f"{part}:{i}".encode() for i in range(len(ks))]
        rows = [(i, None, key) for i, key in enumerate(ks)]
        assert merge.add("train", 0, part, payloads, rows, now=0.0) == []
    assert merge.held == 6
    merged = merge.add("train", 1, 1, [b"next"], [(0, None, 0.4)], now=1.0)  # closes step 0
    assert merged == [("train", 0, [b"1:1", b"2:0", b"3:0"])]  # keys 0.2, 0.1, 0.3, in merged order
    assert (merge.held, merge.capped) == (1, 3)
    assert merge.add("train", 0, 4, [b"late"], [(0, None, 0.0)], now=1.0) == []
    assert merge.late == 1
    assert merge.next_due(now=5.0) == pytest.approx(6.0)
    assert merge.close_idle(now=10.5) == []
    assert merge.close_idle(now=11.0) == [("train", 1, [b"next"])]
    assert (merge.held, merge.capped, merge.late) == (0, 3, 1)
    with pytest.raises(ValueError, match="one row per payload"):
        merge.add("train", 2, 1, [b"a", b"b"], [(0, None, 0.1)], now=12.0)


def test_held_group_candidates_count_in_the_client_byte_bound(project: str) -> None:
    """A group sampler without group_size holds every candidate of an open step on the actor:
    those count in the client's max_buffered_bytes, so a step larger than the bound is held up
    to it and the rest dropped as "queue_full", counted, never held without a bound."""
    collector = start_collector(
        project, sinks=[MemorySink()], max_traces_per_step=K, sampler=GroupSampler(), finish_at_exit=False
    )
    bound = 16 * 1024
    client = TraceClient(collector, max_buffered_bytes=bound, step_timeout=None)
    for group in make_groups("held", 0, 200, GROUP_SIZE, seed=0):  # ~130 KB in all
        client.log_samples_nowait(group, step=0)
    stats = client.stats()
    assert stats.held > 0 and stats.held_bytes <= bound
    assert stats.dropped["queue_full"] == 200 * GROUP_SIZE - stats.held and stats.check()
    final = client.close(30.0)
    assert final.check() and final.held == 0 and final.delivered == stats.held
    assert ray.get(collector.finish.remote()).check()


def test_collector_spends_one_watch_budget_and_merges_the_rest() -> None:
    """Watched samples within a step's max_per_step go on at once, even for a step already
    merged; past it they join the step's merge as a part of the collector's own (held, then
    capped or chosen like any candidate), and are late once their step was merged."""
    from asynctrace import TopBottomSampler, Watch
    from asynctrace._fronts.selection import WATCHED
    from asynctrace.ray._merge import StepMerge

    merge = StepMerge(
        2, TopBottomSampler(), max_open_steps=0, step_timeout=None, watch=Watch(ids=["w"], max_per_step=3)
    )

    def part(prompt: str, rewards: list[float]) -> tuple[list[bytes], list[tuple[int, float, None]]]:
        payloads = [
            orjson.dumps({"messages": [], "metadata": {"prompt_id": prompt, "r": r}}) for r in rewards
        ]
        return payloads, [(i, r, None) for i, r in enumerate(rewards)]

    watched, rows = part("w", [5.0, 6.0, 7.0, 9.0])
    assert merge.add("train", 0, WATCHED, watched, rows, now=0.0) == [("train", 0, watched[:3])]
    assert merge.held == 1  # the fourth: past the budget, a candidate of step 0
    others, rows = part("p", [1.0, 2.0, 3.0])
    assert merge.add("train", 0, 1, others, rows, now=0.0) == []
    nxt, rows = part("p", [4.0])
    merged = merge.add("train", 1, 1, nxt, rows, now=0.0)  # closes step 0: top 1 and bottom 1 of 4
    assert merged == [("train", 0, [watched[3], others[0]])]  # parts in order of arrival
    assert (merge.held, merge.capped, merge.late) == (1, 2, 0)
    assert merge.add("train", 2, 1, nxt, rows, now=0.0) == [("train", 1, nxt)]  # closes step 1
    late, rows = part("w", [8.0])
    assert merge.add("train", 1, WATCHED, late, rows, now=0.0) == [("train", 1, late)]  # never late
    more, rows = part("w", [1.5])
    assert merge.add("train", 0, WATCHED, more, rows, now=0.0) == []  # step 0's budget is spent
    assert (merge.held, merge.capped, merge.late) == (1, 2, 1)
