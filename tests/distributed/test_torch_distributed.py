"""DistributedTraceLogger with gloo: three spawned ranks, real Trackio storage."""

from __future__ import annotations

import json
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

torch = pytest.importorskip("torch")

import asynctrace as at  # noqa: E402
from asynctrace._select.base import Entry  # noqa: E402
from asynctrace.testing import MemorySink  # noqa: E402
from tests.distributed import _gloo_worker  # noqa: E402
from tests.distributed._gloo_worker import (  # noqa: E402
    GROUP_POLICIES,
    GROUP_STEPS,
    PAIR_SAMPLERS,
    SAMPLES_PER_STEP,
    K,
    sampler_for,
)
from tests.distributed._helpers import make_samples, pair_of, read_traces, shared_groups  # noqa: E402

WORLD = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Spawned:
    """What the module's ranks saw: `run` on all WORLD of them, `run_pair` on two."""

    project: str
    ranks: list[dict[str, Any]]
    pair: dict[int, dict[str, Any]]


@pytest.fixture(scope="module")
def spawned() -> Spawned:
    """Spawn the ranks once for the module (process start-up dominates): the WORLD ranks' run,
    then two of them in a process group of their own for the fault scenarios of `run_pair`."""
    from torch.multiprocessing.spawn import spawn

    projects = (f"dist-{uuid.uuid4().hex[:10]}", f"pair-{uuid.uuid4().hex[:10]}")
    ports = (_free_port(), _free_port())
    while ports[1] == ports[0]:
        ports = (ports[0], _free_port())
    with tempfile.TemporaryDirectory() as out:
        spawn(  # type: ignore[no-untyped-call]
            _gloo_worker.run_then_pair, args=(WORLD, ports, projects, out), nprocs=WORLD, join=True
        )
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(WORLD)]
        pair = {r: json.loads((Path(out) / f"pair{r}.json").read_text()) for r in range(2)}
    return Spawned(projects[0], ranks, pair)


@pytest.fixture(scope="module")
def ranks(spawned: Spawned) -> tuple[str, list[dict[str, Any]]]:
    """The project of the WORLD ranks' run, and what each rank saw."""
    return spawned.project, spawned.ranks


def _single_process_pick(tag: str, sampler: str, world: int = WORLD) -> dict[int, list[str]]:
    """What one process picks when it logs every rank's samples itself, rank by rank."""
    sink = MemorySink()
    with at.TraceSession(
        "unused",
        sinks=[sink],
        max_traces_per_step=K,
        sampler=sampler_for(sampler),
        max_open_steps=len(SAMPLES_PER_STEP),
    ) as session:
        for step, n in enumerate(SAMPLES_PER_STEP):
            for rank in range(world):
                session.log_samples(make_samples(f"{tag}{rank}", step, n, seed=rank), step=step)
    return {step: sorted(r.sample.metadata["uid"] for r in recs) for step, recs in sink.steps().items()}


def _written(project: str, run: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for t in read_traces(project, run):
        out.setdefault(t["step"], []).append(t["metadata"]["uid"])
    return {step: sorted(uids) for step, uids in out.items()}


def _parts_pick(tag: str, world: int) -> dict[int, list[str]]:
    """The reservoir's whole-step pick computed here: each rank's samples offered (in the chunks
    the ranks log) to that rank's part of the step, the parts merged by the sampler."""
    sampler = at.ReservoirSampler()
    out = {}
    for step, n in enumerate(SAMPLES_PER_STEP):
        parts = []
        for rank in range(world):
            selection = sampler.new_part_step("train", step, K, rank)
            samples = make_samples(f"{tag}{rank}", step, n, seed=rank)
            entries = [Entry(None, i, group=s["uid"]) for i, s in enumerate(samples)]
            for i in range(0, n, 50):
                selection.offer_all(entries[i : i + 50])
            parts.append([Entry(None, e.seq, key=e.key, group=e.group) for e in selection.held()])
        out[step] = sorted(str(e.group) for e in sampler.merge("train", step, K, parts))
    return out


@pytest.mark.parametrize("sampler", ["top_bottom", "first"])
def test_global_mode_picks_what_one_process_would(
    ranks: tuple[str, list[dict[str, Any]]], sampler: str
) -> None:
    """Global mode writes, for every step, exactly the samples one process would pick from all
    ranks' samples, and the job's accounting adds up across ranks."""
    project, results = ranks
    assert _written(project, f"global-{sampler}") == _single_process_pick("g", sampler)

    stats = results[0][f"stats_{sampler}"]
    assert [s["rank"] for s in stats] == list(range(WORLD))
    writer = stats[0]
    for s in stats:
        assert s["submitted"] == s["handed_on"] + s["held"] + sum(s["dropped"].values())
        assert s["dropped"]["late"] == 3
    assert writer["merged_received"] == sum(s["handed_on"] for s in stats)
    session = writer["session"]
    assert writer["merged_received"] == writer["merged_capped"] + session["submitted"]
    assert session["written"] == K * len(SAMPLES_PER_STEP)
    total = sum(s["submitted"] for s in stats)
    assert total == WORLD * (sum(SAMPLES_PER_STEP) + 3)
    dropped_on_ranks = sum(sum(s["dropped"].values()) for s in stats)
    assert total == dropped_on_ranks + writer["merged_capped"] + session["written"]


def test_global_mode_sends_o_k_bytes_per_rank(ranks: tuple[str, list[dict[str, Any]]]) -> None:
    """The bytes a rank sends per step stay O(k): the same for 20 and 2000 samples, and far below
    what sending every sample would cost."""
    _, results = ranks
    largest = max(len(s["prompt"]) + len(s["response"]) + 120 for s in make_samples("g0", 0, 1, 0))
    for r in results:
        for sampler in ("top_bottom", "first"):
            sent = r[f"bytes_{sampler}"]
            assert len(sent) == len(SAMPLES_PER_STEP)
            assert max(sent) <= 1.15 * min(sent)
            assert max(sent) <= K * largest + 512
            assert max(sent) * 50 < max(SAMPLES_PER_STEP) * largest


def test_per_rank_modes_write_one_run_per_rank_in_one_group(ranks: tuple[str, list[dict[str, Any]]]) -> None:
    """Per-rank mode writes each rank's own top/bottom k per step to its own run, per-rank streaming every
    sample; each mode's runs share one Trackio group."""
    from trackio.sqlite_storage import SQLiteStorage

    project, results = ranks
    for r in results:
        rank = r["rank"]
        assert r["per_rank_run"] == f"per-rank-rank{rank}"
        written = _written(project, r["per_rank_run"])
        assert sorted(written) == list(range(len(SAMPLES_PER_STEP)))
        for step, uids in written.items():
            mine = make_samples(f"p{rank}", step, SAMPLES_PER_STEP[step], seed=rank)
            ranked = sorted(mine, key=lambda s: s["reward"])
            expected = ranked[: K // 2] + ranked[-(K - K // 2) :]
            assert uids == sorted(s["uid"] for s in expected)
        assert (SQLiteStorage.get_run_config(project, r["per_rank_run"]) or {}).get("_Group") == "per-rank"

        assert len(read_traces(project, r["stream_run"])) == sum(SAMPLES_PER_STEP)
        assert (SQLiteStorage.get_run_config(project, r["stream_run"]) or {}).get("_Group") == "stream"
        assert r["stream_stats"]["session"]["written"] == sum(SAMPLES_PER_STEP)


def test_world_of_one_without_process_group(project: str) -> None:
    """Without an initialised process group the logger is a world of one: global mode selects k per
    step as a plain session would."""
    sink = MemorySink()
    from asynctrace.distributed import DistributedTraceLogger

    with DistributedTraceLogger(
        project, "solo", mode="global", max_traces_per_step=4, sampler="top_bottom", sinks=[sink]
    ) as logger:
        for step in range(3):
            logger.log_samples(make_samples("solo", step, 100, seed=0), step=step)
            logger.end_step(step)
        assert logger.stats().bytes_sent == 0
    assert {step: len(recs) for step, recs in sink.steps().items()} == {0: 4, 1: 4, 2: 4}
    stats = logger.stats()
    assert stats.check() and stats.session is not None and stats.session.written == 12


def test_invalid_arguments_are_rejected(project: str) -> None:
    """Bad modes and a global or per_rank logger without a cap fail up front with ValueError."""
    from asynctrace.distributed import DistributedTraceLogger

    with pytest.raises(ValueError, match="mode must be one of"):
        DistributedTraceLogger(project, mode="everywhere")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="give one"):
        DistributedTraceLogger(project, mode="global")


@pytest.fixture(scope="module")
def pair(spawned: Spawned) -> dict[int, dict[str, Any]]:
    """What two gloo ranks saw in the fault scenarios of `_gloo_worker.run_pair`."""
    return spawned.pair


@pytest.mark.parametrize("sampler", PAIR_SAMPLERS)
def test_reservoir_and_group_merge_over_two_ranks(pair: dict[int, dict[str, Any]], sampler: str) -> None:
    """On two gloo ranks the group sampler writes the whole groups one process would pick, and
    the reservoir the k smallest keys of both ranks (its pick recomputed here from each rank's
    part, as the ranks draw their own keys); each rank sends O(k) bytes a step."""
    written = {int(step): uids for step, uids in pair[0][f"written_{sampler}"].items()}
    expected = _parts_pick("g", 2) if sampler == "reservoir" else _single_process_pick("g", sampler, 2)
    assert written == expected
    assert all(len(uids) == K for uids in written.values())
    if sampler == "group":
        for uids in written.values():
            pairs = [pair_of({"uid": u}) for u in uids]
            assert all(pairs.count(p) == 2 for p in pairs)  # whole groups only
    largest = max(len(s["prompt"]) + len(s["response"]) + 120 for s in make_samples("g0", 0, 1, 0))
    for rank in range(2):
        sent = pair[rank][f"bytes_{sampler}"]
        if sampler == "group":
            # Told the group size, a rank ships only the groups that may still be taken: the
            # k//2 best and worst complete groups, each way (distributed.md).
            assert max(sent) <= 2 * K * (largest + 24) + 512
            continue
        # Each candidate also carries its random key (a float, at most 24 bytes of JSON).
        assert max(sent) <= 1.15 * min(sent) and max(sent) <= K * (largest + 24) + 512


@pytest.mark.parametrize("policy", GROUP_POLICIES)
def test_group_modes_over_two_ranks_pick_what_one_process_would(
    pair: dict[int, dict[str, Any]], policy: str
) -> None:
    """Issue 27 case 6: for every group mode (`random` included) two gloo ranks, which split some
    groups between them, write at every step the whole groups one process picks from both ranks'
    samples."""
    sink = MemorySink()
    with at.TraceSession(
        "unused",
        sinks=[sink],
        max_traces_per_step=K,
        sampler=at.GroupSampler(policy),
        max_open_steps=GROUP_STEPS,  # type: ignore[arg-type]
    ) as session:
        for step in range(GROUP_STEPS):
            for rank in range(2):
                session.log_samples(shared_groups(rank, step), step=step)
    expected = {
        str(step): sorted(r.sample.metadata["uid"] for r in recs) for step, recs in sink.steps().items()
    }
    assert pair[0][f"groups_{policy}"] == expected
    assert len(expected) == GROUP_STEPS and all(len(uids) == K for uids in expected.values())


def test_random_groups_without_a_seed_share_rank_0s_seed(pair: dict[int, dict[str, Any]]) -> None:
    """`GroupSampler("random", seed=None)` on two ranks: each drew its own seed, the logger gives
    every rank rank 0's, and the written groups are what one process with that seed picks."""
    assert pair[0]["own_seed"] != pair[1]["own_seed"]
    assert pair[0]["agreed_seed"] == pair[1]["agreed_seed"] == pair[0]["own_seed"]
    sampler = at.GroupSampler("random", seed=None)
    sampler.run_seed = pair[0]["agreed_seed"]
    sink = MemorySink()
    with at.TraceSession(
        "unused", sinks=[sink], max_traces_per_step=K, sampler=sampler, max_open_steps=GROUP_STEPS
    ) as session:
        for step in range(GROUP_STEPS):
            for rank in range(2):
                session.log_samples(shared_groups(rank, step), step=step)
    expected = {
        str(step): sorted(r.sample.metadata["uid"] for r in recs) for step, recs in sink.steps().items()
    }
    assert pair[0]["groups_unseeded"] == expected


def test_flush_ends_a_step_on_every_rank(pair: dict[int, dict[str, Any]]) -> None:
    """After a global flush, samples a rank logs for a step that only another rank had open are
    counted as merged_late on the writing rank, never written as a second selection of the step."""
    stats = pair[0]["flush_stats"]
    assert pair[0]["flush_written"] == [0, 0]  # k=2 for step 0, not 4
    writer = stats[0]
    assert writer["merged_late"] == 2
    assert writer["merged_received"] == writer["merged_capped"] + writer["merged_late"] + 2
    assert all(s["submitted"] == s["handed_on"] + s["held"] + sum(s["dropped"].values()) for s in stats)
    total = sum(s["submitted"] for s in stats)
    dropped = sum(sum(s["dropped"].values()) for s in stats)
    assert total == 10 == dropped + writer["merged_capped"] + writer["merged_late"] + 2


def test_failed_collective_counts_held_samples_as_aborted(pair: dict[int, dict[str, Any]]) -> None:
    """When a peer dies, end_step raises and the samples it took out of the selection are counted as
    "aborted" instead of vanishing as handed_on; the rank's session is still finished."""
    result = pair[0]
    assert result["error"] is not None
    stats = result["dies_stats"]
    assert stats["submitted"] == 3
    assert stats["handed_on"] == 0 and stats["held"] == 0
    assert stats["dropped"] == {"aborted": 3}
    assert stats["session"]["submitted"] == 0


def test_a_writing_rank_that_cannot_open_its_session_fails_every_rank(
    pair: dict[int, dict[str, Any]],
) -> None:
    """When the writing rank's session_factory raises, the writing rank raises that error and the
    other rank a RuntimeError naming it, both at construction (not in a later collective)."""
    assert pair[0]["broken"] == "OSError: disk full"
    told = "RuntimeError: the writing rank (0) could not open its session: OSError: disk full"
    assert pair[1]["broken"] == told


def _logger(project: str, **kwargs: Any) -> Any:
    from asynctrace.distributed import DistributedTraceLogger

    return DistributedTraceLogger(project, "solo", **kwargs)


def test_per_rank_stream_takes_a_generator(project: str) -> None:
    """per_rank_stream writes every sample of a generator (it is read once, not counted and then lost)."""
    sink = MemorySink()
    logger = _logger(project, mode="per_rank_stream", sinks=[sink])
    assert logger.log_samples((s for s in make_samples("gen", 0, 5, seed=0)), step=0) == 5
    assert logger.log_samples_nowait((s for s in make_samples("gen", 1, 3, seed=0)), step=1) == 3
    stats = logger.finish(10.0)
    assert len(sink.records) == 8
    assert stats.check() and stats.submitted == stats.handed_on == 8


@pytest.mark.parametrize("mode", ["global", "per_rank"])
def test_flush_ends_steps_for_good(project: str, mode: Literal["global", "per_rank"]) -> None:
    """Samples logged after flush() for a step it ended are "late": the step's cap still holds."""
    sink = MemorySink()
    logger = _logger(project, mode=mode, max_traces_per_step=2, sinks=[sink])
    logger.log_samples(make_samples("a", 0, 5, seed=0), step=0)
    assert logger.flush(10.0)
    assert logger.log_samples(make_samples("b", 0, 5, seed=0), step=0) == 0
    assert logger.log_samples(make_samples("b", 1, 5, seed=0), step=1) == 2  # a new step is open
    stats = logger.finish(10.0)
    assert {step: len(recs) for step, recs in sink.steps().items()} == {0: 2, 1: 2}
    assert dict(stats.dropped) == {"capped": 6, "late": 5}
    assert stats.check()


def test_log_during_finish_is_counted_closed(project: str) -> None:
    """A sample logged while finish() runs is counted as dropped ("closed"), never held forever."""
    import threading

    import anyio

    class SlowClose(MemorySink):
        async def close(self) -> None:
            await anyio.sleep(1.0)  # a sink whose close takes a while (Trackio finish, network)
            await super().close()

    sink = SlowClose()
    logger = _logger(project, mode="per_rank", max_traces_per_step=4, sinks=[sink])
    logger.log_samples(make_samples("a", 0, 1, seed=0), step=0)
    finishing = threading.Thread(target=logger.finish, args=(10.0,))
    finishing.start()
    try:
        time.sleep(0.3)  # finish() is closing the sink now
        assert logger.log_samples(make_samples("b", 1, 1, seed=0), step=1) == 0
    finally:
        finishing.join()
    stats = logger.stats()
    assert stats.held == 0 and dict(stats.dropped) == {"closed": 1}
    assert stats.check() and len(sink.records) == 1


@pytest.mark.parametrize("mode", ["global", "per_rank"])
def test_block_policy_waits_for_room_when_handing_on(
    project: str, mode: Literal["global", "per_rank"]
) -> None:
    """With on_full="block", end_step waits for room in a small session queue instead of dropping the
    selection as "queue_full"."""
    sink = MemorySink(delay=0.1)
    logger = _logger(
        project, mode=mode, max_traces_per_step=8, sinks=[sink], queue_size=4, batch_size=4, on_full="block"
    )
    logger.log_samples(make_samples("a", 0, 8, seed=0), step=0)
    logger.end_step(0)
    stats = logger.finish(10.0)
    assert stats.session is not None
    assert dict(stats.session.dropped) == {}
    assert stats.session.written == len(sink.records) == 8


def test_end_step_timeout_bounds_the_wait_for_room(project: str) -> None:
    """With on_full="block" and a sink that never returns, end_step(timeout=) gives up in time and
    counts what did not fit as "queue_full"."""
    logger = _logger(
        project,
        mode="per_rank",
        max_traces_per_step=8,
        sinks=[MemorySink(hang=True)],
        queue_size=2,
        on_full="block",
        finish_timeout=0.5,
    )
    logger.log_samples(make_samples("a", 0, 8, seed=0), step=0)
    t = time.monotonic()
    logger.end_step(0, timeout=0.5)
    assert time.monotonic() - t < 3.0
    stats = logger.finish(0.5)
    assert stats.session is not None and stats.session.check()
    assert stats.session.dropped.get("queue_full", 0) >= 6


def test_number_like_timeouts_of_the_distributed_logger_are_accepted() -> None:
    """end_step(timeout=0), numpy and infinite timeouts are accepted, as every timeout= is."""
    import numpy as np
    import torch.distributed as dist

    from asynctrace.distributed import DistributedTraceLogger

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", world_size=1, rank=0)
    try:
        sink = MemorySink()
        logger = DistributedTraceLogger("p", "r", mode="per_rank", max_traces_per_step=2, sinks=[sink])
        logger.log_samples_nowait(make_samples("t", 0, 3, seed=0), step=0)
        logger.end_step(0, timeout=0)
        logger.end_step(1, timeout=np.float32(0.5))
        assert logger.flush(timeout=np.float32(10.0))
        with pytest.raises(ValueError, match="timeout"):
            logger.end_step(2, timeout=-1)
        assert logger.finish(timeout=float("inf")).session.written == 2
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("nowait", [False, True])
def test_per_rank_stream_keeps_the_session_bound_with_a_holding_sampler(project: str, nowait: bool) -> None:
    """per_rank_stream with top_bottom, a producer far faster than the sink: the rank's session
    queue never holds more than queue_size plus a selection per open step; log_samples waits
    for room, log_samples_nowait drops (counted "queue_full")."""
    import threading

    sink = MemorySink(delay=0.01)
    logger = _logger(
        project,
        mode="per_rank_stream",
        max_traces_per_step=8,
        sampler="top_bottom",
        sinks=[sink],
        queue_size=100,
        max_open_steps=2,
        max_queue_bytes=100_000,
    )
    session = logger.session
    assert session is not None
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], session.stats().queue_depth)
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        log = logger.log_samples_nowait if nowait else logger.log_samples
        for step in range(150):
            log(make_samples("s", step, 16, seed=step), step=step)
    finally:
        stop.set()
        watcher.join()
    stats = logger.finish(10.0)
    assert stats.check() and stats.session is not None and stats.session.check()
    assert peak[0] <= 100 + 8 * 3, peak[0]
    dropped = dict(stats.session.dropped)
    if nowait:
        assert dropped.get("queue_full", 0) > 0, dropped
    else:
        assert set(dropped) == {"capped"} and stats.session.written == 150 * 8, dropped


def test_gather_stats_rebuilds_every_nested_snapshot(project: str, tmp_path: Path) -> None:
    """gather_stats() returns the snapshots stats() does: the session's spool is a SpoolStats and
    its sinks SinkStats, so their fields and summary() work on the writing rank."""
    logger = _logger(
        project, mode="per_rank", max_traces_per_step=2, sinks=[MemorySink()], spool_dir=tmp_path
    )
    logger.log_samples(make_samples("g", 0, 5, seed=0), step=0)
    logger.end_step(0)
    assert logger.flush(10.0)
    gathered = logger.gather_stats()
    logger.finish(10.0)
    assert gathered is not None and len(gathered) == 1
    session = gathered[0].session
    assert session is not None and session.spool is not None
    assert isinstance(session.spool, at.SpoolStats) and session.spool.appended == 2
    assert all(isinstance(sink, at.SinkStats) for sink in session.sinks.values())
    assert "spool" not in session.summary()  # nothing unspooled: the line leaves the spool out
    assert gathered[0].check() and session.check()


def test_drops_are_warned_once_per_reason(project: str, caplog: pytest.LogCaptureFixture) -> None:
    """As in a session, the first drop of each reason logs one warning; "capped" is the cap at work."""
    logger = _logger(project, mode="per_rank", max_traces_per_step=1, sinks=[MemorySink()])
    logger.log_samples(make_samples("w", 0, 3, seed=0), step=0)
    logger.end_step(0)
    for _ in range(2):
        logger.log_samples(make_samples("w", 0, 1, seed=0), step=0)
    stats = logger.finish(10.0)
    assert dict(stats.dropped) == {"capped": 2, "late": 2}
    warned = [r.getMessage() for r in caplog.records if "dropping samples" in r.getMessage()]
    assert warned == ["asynctrace: dropping samples (late); counts are in logger.stats().dropped"]


def test_an_unhashable_group_key_is_refused_in_the_caller(project: str) -> None:
    """A dict as group_uid under a global group selection is a RecordError naming the field, or
    with on_invalid="skip" that sample alone counts "invalid"."""
    from asynctrace.distributed import DistributedTraceLogger

    samples = make_samples("g", 0, 4, seed=0)
    for i, s in enumerate(samples):
        s["group_uid"] = {"bad": 1} if i == 1 else f"g{i // 2}"
    for on_invalid in ("raise", "skip"):
        sink = MemorySink()
        with DistributedTraceLogger(
            project,
            f"groups-{on_invalid}",
            mode="global",
            max_traces_per_step=8,
            sampler=at.GroupSampler("top"),
            sinks=[sink],
            on_invalid=on_invalid,
        ) as logger:
            if on_invalid == "raise":
                with pytest.raises(at.RecordError, match=r"sample 1: metadata\.group_uid"):
                    logger.log_samples(samples, step=0)
            else:
                assert logger.log_samples(samples, step=0) == 3
        stats = logger.stats()
        assert stats.check() and stats.submitted == (0 if on_invalid == "raise" else 4)
        assert len(sink.records) == (0 if on_invalid == "raise" else 3)


def _redact(sample: at.Sample) -> at.Sample:
    return at.Sample(messages=sample.messages, metadata={**sample.metadata, "secret": "***"})


def test_a_factory_session_is_refused_where_a_setting_would_go_unapplied(project: str) -> None:
    """per_rank_stream with session_factory: the logger's redact, on_invalid or cap (which only the
    session would apply) is a ValueError naming it, never a secret written as logged; global and
    per_rank: a factory session must count what it still rejects (on_invalid="skip")."""
    from asynctrace.distributed import DistributedTraceLogger

    def factory(rank: int, run: str) -> at.TraceSession:
        return at.TraceSession(project, run, sinks=[MemorySink()])

    for given in ({"redact": _redact}, {"on_invalid": "skip"}, {"max_traces_per_step": 2}):
        name = next(iter(given))
        with pytest.raises(ValueError, match=f"the session applies {name}"):
            DistributedTraceLogger(project, "r", mode="per_rank_stream", session_factory=factory, **given)
    for mode in ("global", "per_rank"):
        with pytest.raises(ValueError, match="on_invalid='skip'"):
            DistributedTraceLogger(project, "r", mode=mode, max_traces_per_step=2, session_factory=factory)


@pytest.mark.parametrize("mode", ["global", "per_rank"])
def test_a_factory_session_counts_a_sample_over_its_byte_bound(project: str, mode: str) -> None:
    """A sample the rank accepted but the writing session's max_queue_bytes refuses is counted
    "invalid" there, with the step's other samples written; end_step does not raise."""
    from asynctrace.distributed import DistributedTraceLogger

    sink = MemorySink()
    logger = DistributedTraceLogger(
        project,
        "bytes",
        mode=mode,  # type: ignore[arg-type]
        max_traces_per_step=4,
        redact=_redact,
        session_factory=lambda rank, run: at.TraceSession(
            project, run, sinks=[sink], on_invalid="skip", max_queue_bytes=2000
        ),
    )
    logger.log_samples([{"prompt": "x" * 5000, "reward": 1.0}, {"prompt": "y", "reward": 0.5}], step=0)
    logger.end_step(0)
    stats = logger.finish(10.0)
    assert stats.check() and stats.session is not None and stats.session.check()
    assert stats.session.dropped == {"invalid": 1} and stats.session.written == 1
    assert [r.sample.metadata["secret"] for r in sink.records] == ["***"]


@pytest.mark.parametrize("mode", ["global", "per_rank"])
def test_a_tiers_group_key_is_validated_on_the_rank(project: str, mode: str) -> None:
    """A Selected tier's GroupSampler in the writing session reads key "g": a dict there is a
    RecordError naming metadata.g on the rank (as one session raises it), or with
    on_invalid="skip" counted "invalid" by the rank, not handed on."""
    from asynctrace.distributed import DistributedTraceLogger

    rows = [{"prompt": "x", "reward": 1.0, "g": "a"}, {"prompt": "y", "reward": 2.0, "g": {"bad": 1}}]
    for on_invalid in ("raise", "skip"):
        archive = MemorySink("archive")
        tier = at.Selected(MemorySink("tier"), max_traces_per_step=2, sampler=at.GroupSampler("top", key="g"))
        logger = DistributedTraceLogger(
            project,
            f"tier-keys-{on_invalid}",
            mode=mode,  # type: ignore[arg-type]
            max_traces_per_step=4,
            sampler="top_bottom",
            on_invalid=on_invalid,  # type: ignore[arg-type]
            sinks=[archive, tier],
        )
        if on_invalid == "raise":
            with pytest.raises(at.RecordError, match=r"sample 1: metadata\.g"):
                logger.log_samples(rows, step=0)
        else:
            assert logger.log_samples(rows, step=0) == 1
        stats = logger.finish(10.0)
        assert stats.check() and stats.session is not None and stats.session.check()
        assert stats.dropped == ({} if on_invalid == "raise" else {"invalid": 1})
        assert stats.session.dropped == {} and len(archive.records) == (0 if on_invalid == "raise" else 1)


def test_group_metrics_are_refused_where_the_session_sees_only_the_selection(project: str) -> None:
    """group_key= counts every sample of a step before the cap: in "global" and "per_rank" modes
    (whose session gets only the selection) it is a ValueError, by keyword or from a
    session_factory; in "per_rank_stream" the session counts all three groups of the step."""
    from asynctrace.distributed import DistributedTraceLogger

    for mode in ("global", "per_rank"):
        with pytest.raises(ValueError, match=r"group metrics \(group_key=\)"):
            DistributedTraceLogger(project, "r", mode=mode, max_traces_per_step=2, group_key="g")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"group metrics \(group_key=\)"):
            DistributedTraceLogger(
                project,
                "r",
                mode=mode,  # type: ignore[arg-type]
                max_traces_per_step=2,
                session_factory=lambda rank, run: at.TraceSession(
                    project, run, sinks=[MemorySink()], on_invalid="skip", group_key="g"
                ),
            )
    sink = MemorySink()
    rows = [
        {"prompt": f"{g}{j}", "reward": float(g * 4 + j % 2), "g": f"g{g}"}
        for g in range(3)
        for j in range(4)
    ]
    logger = DistributedTraceLogger(
        project,
        "stream",
        mode="per_rank_stream",
        max_traces_per_step=2,
        sampler="top_bottom",
        sinks=[sink],
        group_key="g",
        health_metrics=False,
    )
    logger.log_samples(rows, step=0)
    assert logger.finish(10.0).check()
    assert sink.metrics[0][1]["asynctrace/groups/train/count"] == 3.0


def test_a_concurrent_finish_waits_for_the_one_handing_on(project: str) -> None:
    """A finish() from a second thread while the first is still handing the last step to the
    session (waiting for room) waits for that finish and returns its stats, instead of closing
    the session under it and losing the step as "closed"."""
    import threading

    sink = MemorySink(delay=0.2)
    logger = _logger(
        project,
        mode="per_rank",
        max_traces_per_step=8,
        sinks=[sink],
        queue_size=2,
        batch_size=2,
        on_full="block",
    )
    logger.log_samples(make_samples("c", 0, 8, seed=0), step=0)
    results: dict[str, Any] = {}
    first = threading.Thread(target=lambda: results.setdefault("first", logger.finish(30.0)))
    first.start()
    deadline = time.monotonic() + 10
    while logger.stats().handed_on < 8 and time.monotonic() < deadline:
        time.sleep(0.01)  # the first finish took the step and is writing it into the session
    time.sleep(0.1)
    results["second"] = logger.finish(5.0)
    first.join(30)
    final = results["first"]
    assert results["second"] == final
    assert final.session is not None and dict(final.session.dropped) == {}
    assert final.session.written == len(sink.records) == 8 and final.check()


def test_finish_reentered_from_a_signal_handler_returns_at_once(project: str) -> None:
    """A finish() from a signal handler that interrupts a finish() on the same thread returns the
    stats of the moment at once, instead of waiting for the finish it interrupted."""
    import signal

    logger = _logger(project, mode="per_rank", max_traces_per_step=4, sinks=[MemorySink(hang=True)])
    logger.log_samples(make_samples("s", 0, 4, seed=0), step=0)
    took: list[float] = []

    def handler(signum: int, frame: Any) -> None:
        t = time.monotonic()
        logger.finish(0.5)
        took.append(time.monotonic() - t)

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        final = logger.finish(2.0)  # its drain waits out the 2 s on the sink that never answers
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert len(took) == 1 and took[0] < 1.0, took
    assert final.check() and logger.finish() == final
