"""ParquetSink's token rows cut by their bytes: the same table as decoding each payload whole, or
left to that exact way (which names what is wrong), whichever base64 decoder is installed."""

from __future__ import annotations

import sys

import numpy as np
import orjson
import pytest

import asynctrace as at
from asynctrace._records.encode import encode_sample
from asynctrace._records.tokens import encoded
from asynctrace._records.types import TraceRecord
from asynctrace.sinks import _parquet_rows as rows
from asynctrace.sinks import _parquet_tokens as tokens

RNG = np.random.default_rng(7)
IDS = RNG.integers(0, 150_000, 257, dtype=np.int32)
LOGPROBS = RNG.standard_normal(257).astype(np.float32)
MASK = (np.arange(257) % 3 == 0).astype(np.int8)


def _payload(**fields: object) -> bytes:
    sample = at.Sample(messages=[{"role": "user", "content": "q"}], metadata={"reward": 0.5}, **fields)  # type: ignore[arg-type]
    return encode_sample(sample, 0)[0]


def _records(*payloads: bytes) -> list[TraceRecord]:
    return [TraceRecord(f"t-{i}", 1, "train", "k", p, 2.5) for i, p in enumerate(payloads)]


def _both(records: list[TraceRecord]) -> tuple[object, object]:
    data, layout = rows.journal_lines(records)
    return rows._described_segment(data, layout), rows._exact_segment(data, ())[0]


@pytest.fixture(params=["pybase64", "binascii"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "binascii":
        monkeypatch.setitem(sys.modules, "pybase64", None)  # as if it were not installed
    assert tokens.Decoder().name == request.param
    return str(request.param)


def test_token_rows_are_cut_without_decoding_their_json(decoder: str) -> None:
    """Token rows, mixed with chat rows and rows of other fields, give the exact table, cell for cell."""
    with_all = _payload(tokens={"token_ids": IDS, "logprobs": LOGPROBS, "loss_mask": MASK})
    records = _records(
        with_all,
        _payload(),
        _payload(tokens={"advantages": LOGPROBS[:5], "token_ids": IDS[:0]}),
        _payload(tokens={"loss_mask": MASK[:1]}),
        with_all,
    )
    described, exact = _both(records)
    assert described is not None and described.equals(exact)  # type: ignore[attr-defined]
    column = described.column("logprobs")  # type: ignore[attr-defined]
    assert np.array_equal(np.asarray(column[0].as_py(), np.float32), LOGPROBS)
    assert column[1].as_py() is None and described.column("token_ids")[2].as_py() == []  # type: ignore[attr-defined]


def _raw(tokens_json: bytes) -> bytes:
    return b'{"messages":[],"metadata":{"reward":1.0},"tokens":' + tokens_json + b"}"


def _field(name: str, dtype: str, b64: str) -> dict[str, dict[str, str]]:
    return {name: {"dtype": dtype, "b64": b64}}


GOOD = encoded("int32", IDS[:4].tobytes())["b64"]
FIELD = b'"token_ids":{"dtype":"int32","b64":"%s"}' % GOOD.encode()
ODD = [
    _raw(orjson.dumps(_field("token_ids", "int32", "AAA"))),  # bad padding
    _raw(orjson.dumps(_field("token_ids", "int32", "AA-A"))),  # not base64
    _raw(orjson.dumps(_field("token_ids", "int32", "AAAA"))),  # 3 bytes: no whole int32
    _raw(orjson.dumps(_field("token_ids", "float32", GOOD))),  # another dtype
    _raw(orjson.dumps(_field("token_id", "int32", GOOD))),  # no such field
    _raw(orjson.dumps({"token_ids": {"b64": GOOD, "dtype": "int32"}})),  # keys in another order
    _raw(b"{}"),
    _raw(orjson.dumps({"token_ids": {"dtype": "int32", "b64": GOOD}, "loss_mask": None})),
    # The same field twice: the JSON decoder keeps the last.
    _raw(
        b'{"token_ids":{"dtype":"int32","b64":"AAAAAA=="},"token_ids":{"dtype":"int32","b64":"%s"}}'
        % GOOD.encode()
    ),
    # Fields after the metadata that are not tokens, or before them.
    b'{"messages":[],"metadata":{},"score":0.5,"tokens":{"token_ids":{"dtype":"int32","b64":"%s"}}}'
    % GOOD.encode(),
    b'{"messages":[],"metadata":{},"spans":[{"a":"}"}],"tokens":{"loss_mask":{"dtype":"int8","b64":"AQ=="}}}',
    # Metadata that ends like token fields, and metadata holding an object shaped like them.
    b'{"messages":[],"metadata":{"x":{"y":"z"}}}',
    b'{"messages":[],"metadata":{"a":1},"other":{"token_ids":{"dtype":"int32","b64":"AAAAAA=="}}}',
    b'{"messages":[],"metadata":{"tokens":{"token_ids":{"dtype":"int32","b64":"AAAAAA=="}}}}',
    b'{"messages":[],"metadata":{"q":1,"tokens":{"token_ids":{"dtype":"int32","b64":"AAAAAA=="}}}}',
    # A field's header inside a string, escaped: it is no header.
    _raw(
        b'{"token_ids":{"dtype":"int32","b64":"x\\"token_ids\\":{\\"dtype\\":\\"int32\\",\\"b64\\":\\"AAAA"}}'
    ),
]


@pytest.mark.parametrize("payload", ODD, ids=range(len(ODD)))
def test_odd_token_payloads_give_the_exact_table_or_defer(payload: bytes, decoder: str) -> None:
    """A payload of any other form is left to the exact way, or cut to the very same table."""
    records = _records(payload, _payload(tokens={"token_ids": IDS}))
    data, layout = rows.journal_lines(records)
    try:
        exact = rows._exact_segment(data, ())[0]
    except (ValueError, KeyError):
        exact = None  # the exact way names the record; the fast way must not make a table of it
    described = rows._described_segment(data, layout)
    assert described is None or (exact is not None and described.equals(exact))


def test_the_walk_finds_each_field_where_it_lies() -> None:
    """`token_spans` gives where the tokens key starts and each field's base64, for any field order."""
    payload = _payload(tokens={"loss_mask": MASK, "token_ids": IDS})
    line = b"xx" + payload
    found = tokens.token_spans(line, 2, len(line) - 1)
    assert found is not None
    start, spans = found
    assert line[start:].startswith(b',"tokens":{"loss_mask":')
    assert sorted(spans) == ["loss_mask", "token_ids"]
    first, last = spans["token_ids"]
    assert np.array_equal(
        np.frombuffer(tokens.Decoder().field("token_ids", line[first:last]) or b"", np.int32), IDS
    )
