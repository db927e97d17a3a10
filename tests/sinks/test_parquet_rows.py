"""ParquetSink's row building: the fast ways to cut journal lines into columns give exactly the table
of decoding every payload whole, or leave the chunk to that exact way."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest

import asynctrace as at
from asynctrace._records.encode import encode_sample
from asynctrace._records.types import TraceRecord
from asynctrace.sinks import _parquet_file as files
from asynctrace.sinks import _parquet_rows as rows

PAYLOADS = [
    {
        "messages": [{"role": "user", "content": "q"}],
        "metadata": {"reward": 0.5, "advantage": -1, "policy_version": 3},
    },
    {"messages": [], "metadata": {"reward": 1, "stop_reason": "length", "policy_version_max": 4}},
    # The key found inside the messages, or inside the metadata: the text cut there is no object.
    {"messages": [{"role": "u", "content": "a", "metadata": {"x": 1}}], "metadata": {"reward": 2.0}},
    {"messages": [], "metadata": {"a": {"metadata": {"b": 1}}}},
    {"messages": [{"role": "user", "content": 'he said "hi" ],"metadata":{'}], "metadata": {}},
    # Values whose column is null: left to the exact way.
    {"messages": [], "metadata": {"reward": True}},
    {"messages": [], "metadata": {"reward": "n/a", "stop_reason": 3}},
    {"messages": [], "metadata": {"policy_version": None, "policy_version_max": 4}},
    {"messages": [], "metadata": {"policy_version": 2**63}},
    # Keys after the metadata.
    {"messages": [], "metadata": {"r": 1}, "score": 0.5},
    {"messages": [], "metadata": {}, "spans": [{"name": "tool", "metadata": {"x": 1}}]},
    {"metadata": {"reward": 1.0}, "messages": [{"role": "user", "content": "order"}]},
    {"messages": [{"role": "user", "content": "é ünïcode ✓"}], "metadata": {"note": "\u2028"}},
]


def _records(payload: bytes, n: int = 3) -> list[TraceRecord]:
    return [TraceRecord(f"p-{i}", i // 2, "train", "train/traces", payload, 1.5 + i // 2) for i in range(n)]


@pytest.mark.parametrize("body", PAYLOADS, ids=range(len(PAYLOADS)))
def test_fast_ways_give_the_exact_table_or_defer(body: dict[str, object]) -> None:
    """Each fast way either gives the table the exact way gives, cell for cell, or gives none."""
    data, layout = rows.journal_lines(_records(orjson.dumps(body)))
    exact = rows._exact_segment(data, ())[0]
    for fast in (rows._quick_segment(data, ()), rows._described_segment(data, layout)):
        assert fast is None or fast.equals(exact), (fast.to_pylist(), exact.to_pylist())


def test_the_session_encoding_takes_the_fast_ways() -> None:
    """What the session encodes for a chat sample is cut without decoding it, and ids with escapes too."""
    sample = at.Sample(messages=[{"role": "user", "content": "x" * 3000}], metadata={"reward": 0.25})
    payload = encode_sample(sample, 0)[0]
    records = [*_records(payload), TraceRecord('q"-1', 7, "eval", "k", payload, 9.0)]
    data, layout = rows.journal_lines(records)
    exact = rows._exact_segment(data, ())[0]
    described = rows._described_segment(data, layout)
    assert described is not None and described.equals(exact)
    assert rows._quick_segment(data, ()) is None  # an id with an escape: decoded the exact way
    assert rows._quick_segment(rows.journal_lines(records[:3])[0], ()).equals(exact.slice(0, 3))


def test_token_fields_become_list_columns_bit_for_bit(tmp_path: Path) -> None:
    """Rows with token fields (decoded the exact way) keep every value, through a written file."""
    rng = np.random.default_rng(1)
    ids, logprobs = rng.integers(0, 150_000, 300, dtype=np.int32), rng.standard_normal(300).astype(np.float32)
    sample = at.Sample(messages=[], metadata={}, tokens={"token_ids": ids, "logprobs": logprobs})
    data, layout = rows.journal_lines(_records(encode_sample(sample, 0)[0], 2))
    journal = tmp_path / "journal"
    journal.write_bytes(data)
    converter = files.FileConverter(row_group_bytes=1)  # a row group each append
    out = os.open(tmp_path / "out.parquet", os.O_WRONLY | os.O_CREAT)
    converter.start(out, os.open(journal, os.O_RDONLY))
    converter.append(len(data), layout=layout)
    assert converter.finish() == 2
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column("token_ids").to_pylist() == [ids.tolist()] * 2
    assert np.array_equal(np.asarray(table.column("logprobs")[1].as_py(), np.float32), logprobs)
    assert table.column("loss_mask").to_pylist() == [None, None]


def test_row_groups_are_written_as_they_fill(tmp_path: Path) -> None:
    """A file is written a row group at a time as the journal grows, not at its end."""
    payload = encode_sample(at.Sample(messages=[{"role": "user", "content": "y" * 2000}], metadata={}), 0)[0]
    journal = tmp_path / "journal"
    converter = files.FileConverter(row_group_bytes=64 * 1024, chunk_bytes=32 * 1024)
    out = os.open(tmp_path / "out.parquet", os.O_WRONLY | os.O_CREAT)
    with open(journal, "wb") as f:
        converter.start(out, os.open(journal, os.O_RDONLY))
        for batch in range(40):
            data, layout = rows.journal_lines(
                [TraceRecord(f"r-{batch}-{i}", batch, "train", "k", payload, 1.0) for i in range(32)]
            )
            start = f.tell()
            f.write(data)
            f.flush()
            converter.append(f.tell(), layout=layout, start=start)
    assert converter.finish() == 40 * 32
    meta = pq.ParquetFile(tmp_path / "out.parquet").metadata
    assert meta.num_row_groups > 10 and meta.num_rows == 1280
