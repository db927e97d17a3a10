"""Built-in sinks can be sent to another process (a Ray collector) before they are opened."""

from __future__ import annotations

import pickle
from pathlib import Path

import orjson
import pytest

import asynctrace as at
from asynctrace import sinks

pytestmark = pytest.mark.anyio


def _unopened(tmp_path: Path) -> list[at.Sink]:
    return [
        sinks.JsonlSink(tmp_path / "a.jsonl"),
        sinks.ParquetSink(tmp_path / "parquet"),
        sinks.ConsoleSink(),
        sinks.TrackioSink("p"),
        sinks.WandbSink(project="p", init_kwargs={"mode": "offline"}),
        sinks.MlflowSink(tracking_uri=(tmp_path / "mlruns").as_uri()),
        sinks.Selected(sinks.JsonlSink(tmp_path / "b.jsonl"), max_traces_per_step=2, sampler="top_bottom"),
    ]


def test_every_built_in_sink_pickles_before_it_is_opened(tmp_path: Path) -> None:
    """Each built-in sink survives a pickle round trip while unopened (its locks are made anew)."""
    for sink in _unopened(tmp_path):
        copy = pickle.loads(pickle.dumps(sink))
        assert type(copy) is type(sink) and copy.name == sink.name


async def test_a_pickled_jsonl_sink_writes_and_an_open_one_is_refused(tmp_path: Path) -> None:
    """The copy of an unopened JsonlSink works in a session; an opened one cannot be pickled."""
    sink = pickle.loads(pickle.dumps(sinks.JsonlSink(tmp_path / "t.jsonl")))
    async with at.TraceSession("p", sinks=[sink]) as s:
        await s.log_samples([{"prompt": "q", "response": "a", "reward": 1.0}], step=0)
        await s.flush()
        with pytest.raises(TypeError):
            pickle.dumps(sink)
    lines = [orjson.loads(x) for x in (tmp_path / "t.jsonl").read_bytes().splitlines()]
    assert [r["sample"]["messages"][0]["content"] for r in lines if "id" in r] == ["q"]
