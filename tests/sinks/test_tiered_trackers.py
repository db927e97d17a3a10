"""Tiered capture across real backends: every sample to a Parquet archive, the top/bottom 16 of
each step to Trackio and to W&B, and every trace a tracker shows found in the archive by its id."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import asynctrace as at
from tests._util import read_traces, sample
from tests.sinks._wandb_log import table_rows

pytestmark = pytest.mark.anyio

STEPS = 4
PER_STEP = 100
KEPT = 16


@pytest.fixture
def offline_wandb(tmp_path: Path) -> Iterator[Path]:
    """Offline W&B writing under this test's scratch directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_DIR", str(tmp_path))
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_API_KEY", "")
        yield tmp_path


async def test_archive_holds_everything_and_trackers_the_top_bottom_16(
    project: str, tmp_path: Path, offline_wandb: Path
) -> None:
    """The archive holds every accepted sample once; Trackio and W&B exactly 16 a step, each by an id
    the archive holds, with the same sample under it."""
    import duckdb

    settings = {"console": "off", "x_disable_stats": True, "x_disable_meta": True, "silent": True}
    wandb_sink = at.WandbSink(init_kwargs={"dir": str(offline_wandb), "settings": settings})
    archive = tmp_path / "archive"
    rng = random.Random(7)
    async with at.TraceSession(
        project,
        run="tiered",
        sinks=[
            at.ParquetSink(archive),
            at.Selected(at.TrackioSink(), max_traces_per_step=KEPT, sampler="top_bottom"),
            at.Selected(wandb_sink, max_traces_per_step=KEPT, sampler="top_bottom"),
        ],
        finish_timeout=120.0,
    ) as s:
        for step in range(STEPS):
            batch = [sample(i, step=step, reward=rng.random()) for i in range(PER_STEP)]
            await s.log_samples(batch, step=step)
    st = s.stats()
    assert st.check() and st.written == STEPS * PER_STEP and st.failed == 0, st.summary()

    rows = duckdb.sql(f"SELECT id, step, reward, messages FROM '{archive}/*.parquet'").fetchall()
    assert len(rows) == STEPS * PER_STEP and len({r[0] for r in rows}) == len(rows), "each sample once"
    archived = {r[0]: r for r in rows}
    for step in range(STEPS):
        rewards = sorted(r[2] for r in rows if r[1] == step)
        expected = rewards[: KEPT // 2] + rewards[-KEPT // 2 :]

        traces = [t for t in read_traces(project, "tiered") if t["step"] == step]
        assert len(traces) == KEPT
        assert sorted(t["metadata"]["reward"] for t in traces) == expected
        for t in traces:
            rid = t["metadata"]["asynctrace_id"]
            assert (
                rid in archived and archived[rid][1] == step and archived[rid][2] == t["metadata"]["reward"]
            )

        wandb_rows = [
            r for r in table_rows(Path(wandb_sink.wandb_run.dir), "train/traces") if r["step"] == step
        ]
        assert len(wandb_rows) == KEPT and sorted(r["reward"] for r in wandb_rows) == expected
        for r in wandb_rows:
            assert r["id"] in archived and archived[r["id"]][1] == step
    assert Counter(t["step"] for t in read_traces(project, "tiered")) == dict.fromkeys(range(STEPS), KEPT)
    for name in ("trackio", wandb_sink.name):
        assert st.sinks[name].skipped == {"capped": STEPS * (PER_STEP - KEPT)}, st.sinks[name]
