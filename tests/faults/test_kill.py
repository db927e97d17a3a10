"""SIGKILL at random points: the spool plus `asynctrace recover` deliver every acknowledged record once."""

from __future__ import annotations

import random
import re
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

import asynctrace as at
from asynctrace._durable import segments
from asynctrace.sinks._trackio_writer import stored_record_ids
from tests.faults import _harness as h

SEEDS = (0, 1, 2)


def _kill_at_random(tmp_path: Path, seeds: Sequence[int]) -> list[tuple[str, Path, Path]]:
    """Start one enqueue-durability trainer per seed, SIGKILL each at a seeded random moment,
    and wait for their Trackio writers to exit; returns (project, spool, acked file) per seed."""
    runs = []
    procs = []
    for seed in seeds:
        project = f"kill-{seed}-{uuid.uuid4().hex[:6]}"
        spool = tmp_path / f"spool-{seed}"
        acked = tmp_path / f"acked-{seed}.txt"
        proc = h.start_trainer(
            "--project", project, "--run", "r", "--spool", str(spool), "--acked", str(acked),
            "--durability", "enqueue", "--per-step", "32", "--interval", "0.005",
        )  # fmt: skip
        runs.append((project, spool, acked))
        procs.append(proc)
    for proc in procs:
        h.wait_ready(proc)
    started = time.monotonic()
    order = sorted(range(len(seeds)), key=lambda k: random.Random(seeds[k]).uniform(0.2, 1.5))
    children = []
    for k in order:
        delay = random.Random(seeds[k]).uniform(0.2, 1.5)
        time.sleep(max(0.0, started + delay - time.monotonic()))
        children += h.kill_tree_leader(procs[k])
    h.wait_gone(children)
    return runs


def test_sigkill_then_recover_holds_each_acknowledged_record_exactly_once(tmp_path: Path) -> None:
    """Trainers killed at random points lose nothing they acknowledged, and nothing lands twice."""
    runs = _kill_at_random(tmp_path, SEEDS)
    recoveries = [h.start_recover(str(spool)) for _, spool, _ in runs]
    replayed = 0
    for (project, spool, acked_file), rec in zip(runs, recoveries, strict=True):
        out, err = rec.communicate(timeout=120)
        assert rec.returncode == 0, out + err
        m = re.search(r"(\d+) replayed", out)
        assert m, out
        replayed += int(m.group(1))
        acked = h.acked_uids(acked_file)
        stored = h.trackio_uids(project, "r")
        assert acked, "the trainer was killed before acknowledging anything"
        assert not [u for u, n in stored.items() if n > 1], f"duplicates in Trackio: {out}"
        assert set(acked) <= set(stored), f"{len(set(acked) - set(stored))} acknowledged records lost"
        assert not list(spool.glob("seg-*")), "fully acknowledged segments are deleted"
    assert replayed > 0, "the kills should leave unacknowledged records to replay"


class _FailOddSteps(at.Sink):
    """A sink that refuses, for good, every batch holding a record of an odd step."""

    name = "picky"

    async def write(self, records: Sequence[at.TraceRecord]) -> None:
        if any(r.step % 2 for r in records):
            raise at.PermanentSinkError("odd step")


def test_accounting_is_exact_per_record_id_across_a_kill_and_a_replay(tmp_path: Path) -> None:
    """Each unacknowledged record id is replayed once and ends written or failed (a dead letter), not both."""
    ((project, spool, acked_file),) = _kill_at_random(tmp_path, (7,))
    scan = segments.scan_dir(spool)
    unresolved = {r.id for f in scan.files if f.kind == "seg" for r in f.unresolved}
    assert unresolved, "the kill should leave unacknowledged records"

    async def replay() -> at.SessionStats:
        # What is asserted is where each record ends, not how fast: the finish deadline leaves a
        # loaded machine the time it needs to write a thousand replayed records to Trackio (the
        # default 30 s passed there with 96 still pending).
        async with at.TraceSession(
            project,
            run="r",
            sinks=[at.TrackioSink(), _FailOddSteps()],
            spool_dir=spool,
            batch_size=16,
            finish_timeout=120.0,
        ) as session:
            pass
        return session.stats()

    stats = anyio.run(replay)
    assert stats.replayed == stats.submitted == len(unresolved)
    assert stats.written + stats.failed + stats.dropped_total == stats.submitted and stats.pending == 0
    dead = {r.id for f in segments.scan_dir(spool).files if f.kind == "dead" for r in f.unresolved}
    assert len(dead) == stats.failed and dead <= unresolved
    assert len(unresolved - dead) == stats.written

    # Trackio itself took every record, failed-for-the-other-sink ones included: once each.
    in_trackio = stored_record_ids(project, h.run_id(project, "r"))
    assert unresolved <= in_trackio
    counts = h.trackio_uids(project, "r")
    assert sum(counts.values()) == len(in_trackio) and max(counts.values()) == 1
    assert set(h.acked_uids(acked_file)) <= set(counts)

    # Retrying the dead letters finds them all in Trackio already: nothing is written twice.
    rec = h.recover(str(spool), "--dead-letters")
    assert rec.returncode == 0, rec.stdout + rec.stderr
    if dead:
        assert f"{len(dead)} already stored" in rec.stdout, rec.stdout
    assert not list(spool.glob("dead-*")) and not list(spool.glob("seg-*"))
    assert max(h.trackio_uids(project, "r").values()) == 1


@pytest.fixture(autouse=True)
def _trackio_dir(trackio_dir: str) -> None:
    """Every process here shares the test run's TRACKIO_DIR (inherited through the environment)."""
