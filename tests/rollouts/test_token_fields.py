"""Per-token arrays kept with samples: encoded exactly and compactly, counted by the byte bound,
left out by tracker sinks, and stored as list columns by the Parquet sink (read back exactly)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest
import torch

import asynctrace as at
from asynctrace._records.encode import encode_samples
from asynctrace._records.tokens import decode_token_fields
from asynctrace.rollouts import decode_rollouts
from tests._util import read_traces
from tests.rollouts._helpers import CONVERSATIONS, padded_batch

pytestmark = pytest.mark.anyio


def _batch(tokenizer: Any) -> dict[str, Any]:
    """A real tokenizer's padded batch with per-token log-probs (two series), entropy (float64, kept
    as float32) and advantages (NaN and -inf included)."""
    batch = padded_batch(tokenizer, CONVERSATIONS)
    shape = batch["input_ids"].shape
    g = torch.Generator().manual_seed(7)
    logprobs = -torch.rand(shape, generator=g) * 5
    logprobs[0, 3] = float("-inf")
    logprobs[1, 2] = float("nan")
    advantages = torch.randn(shape, generator=g) * batch["loss_mask"]
    batch["token_fields"] = {
        "token_ids": batch["input_ids"],
        "loss_mask": batch["loss_mask"],
        "logprobs": logprobs,
        "advantages": advantages,
        "ref_logprobs": logprobs + torch.randn(shape, generator=g) * 0.01,
        "entropy": torch.rand(shape, generator=g, dtype=torch.float64) * 3,
    }
    return batch


def _expected(batch: dict[str, Any], row: int) -> dict[str, np.ndarray]:
    """Row `row`'s arrays over its real tokens, in the dtype each field is kept in."""
    keep = batch["attention_mask"][row]
    dtypes = {"token_ids": np.int32, "loss_mask": np.int8, "text_ends": np.int32}
    return {
        name: value[row][keep].numpy().astype(dtypes.get(name, np.float32))
        for name, value in batch["token_fields"].items()
    }


def _same(got: Any, want: np.ndarray) -> bool:
    """Equal bit for bit (NaN included)."""
    got = np.asarray(got, dtype=want.dtype)
    return got.shape == want.shape and got.tobytes() == want.tobytes()


def test_tensor_and_list_paths_keep_the_same_exact_values(tokenizer: Any) -> None:
    """decode_rollouts keeps each row's values at its real tokens, the same from tensors and lists."""
    batch = _batch(tokenizer)
    fields = batch.pop("token_fields")
    from_tensors = decode_rollouts(**batch, tokenizer=tokenizer, token_fields=fields, rows=[2, 0])
    as_lists = {k: v.tolist() for k, v in batch.items()}
    from_lists = decode_rollouts(
        **as_lists, tokenizer=tokenizer, token_fields={k: v.tolist() for k, v in fields.items()}, rows=[2, 0]
    )
    batch["token_fields"] = fields
    for got_t, got_l, row in zip(from_tensors, from_lists, [2, 0], strict=True):
        assert got_t.tokens == got_l.tokens
        want = _expected(batch, row)
        ((payload, _),), _ = encode_samples([got_t])
        held = orjson.loads(payload)["tokens"]
        for name, values in want.items():
            assert held[name]["dtype"] == values.dtype.name
        decoded = decode_token_fields(held)
        assert all(_same(decoded[name], values) for name, values in want.items())
    assert [s.metadata["sample_index"] for s in from_tensors] == [2, 0]


async def test_token_arrays_round_trip_exactly_through_the_parquet_archive(
    tokenizer: Any, tmp_path: Path
) -> None:
    """log_rollouts with token fields: the archive's list columns hold exactly each row's values."""
    batch = _batch(tokenizer)
    memory = at.testing.MemorySink("memory")
    # In-process writer: the files are what is read here; tests/sinks/ test the writer process.
    sink = at.ParquetSink(tmp_path, process=False)
    async with at.TraceSession("p", run="r", sinks=[sink, memory]) as s:
        fields = batch.pop("token_fields")
        n = await s.log_rollouts(
            batch["input_ids"],
            tokenizer=tokenizer,
            step=0,
            attention_mask=batch["attention_mask"],
            loss_mask=batch["loss_mask"],
            token_fields=fields,
        )
        batch["token_fields"] = fields
    assert n == len(CONVERSATIONS)
    table = pq.read_table(tmp_path)
    schema = table.schema
    assert str(schema.field("logprobs").type) == "list<element: float>"
    assert str(schema.field("token_ids").type) == "list<element: int32>"
    rows = table.to_pylist()
    by_id = {r.id: r for r in memory.records}
    assert len(rows) == len(CONVERSATIONS)
    for row in rows:
        record = by_id[row["id"]]
        index = record.sample.metadata["sample_index"]
        want = _expected(batch, index)
        for name, values in want.items():
            assert _same(row[name], values), name
            # The sample read back from the payload holds the same values.
            assert _same(record.sample.tokens[name], values), name  # type: ignore[index]
        assert len(row["token_ids"]) == record.sample.metadata["seq_len"]
        assert "tokens" not in orjson.loads(row["metadata"])


def test_encoding_is_compact_and_errors_name_the_field() -> None:
    """Base64 float32 costs about a quarter of a JSON list; bad arrays are refused with their field."""
    values = (-torch.rand(2048, generator=torch.Generator().manual_seed(1)) * 5).tolist()
    compact = at.Sample([{"role": "user", "content": "q"}], tokens={"logprobs": torch.tensor(values)})
    as_list = at.Sample([{"role": "user", "content": "q"}], metadata={"logprobs": values})
    ((small, _),), _ = encode_samples([compact])
    ((large, _),), _ = encode_samples([as_list])
    assert len(small) * 3 < len(large), (len(small), len(large))
    for bad, match in [
        ({"logits": [1.0]}, "'logits' is not a token field"),
        ({"token_ids": [2**40]}, "token_ids"),
        ({"token_ids": torch.tensor([1, 2**40])}, "do not fit int32"),
        ({"loss_mask": np.array([0.5])}, "expected integers"),
        ({"logprobs": torch.zeros(2, 3)}, "1-D"),
        ({"logprobs": ["a"]}, "expected numbers"),
        ({"logprobs": {"dtype": "float64", "b64": ""}}, "dtype"),
    ]:
        with pytest.raises(at.RecordError, match=match) as info:
            encode_samples([at.Sample([{"role": "user", "content": "q"}], tokens=bad)])
        assert info.value.path == "tokens"


async def test_byte_bound_counts_token_arrays_and_trackers_leave_them_out(tmp_path: Path) -> None:
    """A sample whose token arrays exceed the byte bound is refused; the console shows none of them."""
    tokens = {"logprobs": torch.zeros(1000), "token_ids": torch.arange(1000)}
    big = at.Sample([{"role": "user", "content": "q"}], metadata={"reward": 1.0}, tokens=tokens)
    stream = io.StringIO()
    async with at.TraceSession(
        "p", run="r", sinks=[at.ConsoleSink(stream)], max_queue_bytes=6000, on_invalid="skip"
    ) as s:
        assert await s.log_samples([big], step=0) == 0
        small = at.Sample([{"role": "user", "content": "q"}], tokens={"loss_mask": [0, 1, 1]})
        assert await s.log_samples([small], step=0) == 1
    assert s.stats().dropped.get("invalid") == 1
    text = stream.getvalue()
    # Quoted: an encoded array is {"dtype": ..., "b64": ...}; a bare "b64" can occur in a hex id.
    assert "step 0" in text and "loss_mask" not in text and '"b64"' not in text


async def test_trackio_shows_the_trace_without_its_token_arrays(project: str) -> None:
    """Trackio's stored trace holds the messages and metadata, and none of the token arrays."""
    tokens = {"logprobs": [-0.5, -1.25], "token_ids": [11, 12]}
    sample = at.Sample([{"role": "user", "content": "q"}], metadata={"reward": 1.0}, tokens=tokens)
    async with at.TraceSession(project, run="r", sinks=[at.TrackioSink(process=False)]) as s:
        assert await s.log_samples([sample], step=0) == 1
    (trace,) = read_traces(project, "r")
    stored = orjson.dumps(trace).decode()
    assert '"q"' in stored and "logprobs" not in stored and '"b64"' not in stored
