"""Validation and encoding at submission: clear errors, coercions, and junk that never kills the writer."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

import anyio
import numpy as np
import orjson
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asynctrace as at
from tests._util import as_logged, read_traces, sample


class Opaque:
    """An object with no JSON meaning."""


def test_record_error_names_index_and_path() -> None:
    """A value that cannot be encoded raises RecordError naming the sample index and field path."""
    from asynctrace._records.encode import encode_sample

    with pytest.raises(at.RecordError) as info:
        encode_sample({"prompt": "p", "response": "r", "extra": {"deep": [1, {"bad": b"bytes"}]}}, 3)
    assert info.value.index == 3 and info.value.path == "metadata.extra.deep[1].bad"
    assert "sample 3: metadata.extra.deep[1].bad" in str(info.value) and "bytes" in str(info.value)
    with pytest.raises(at.RecordError, match=r"sample 0: messages\[1\]\.role"):
        encode_sample({"messages": [{"role": "user", "content": "x"}, {"content": "y"}]}, 0)
    with pytest.raises(at.RecordError, match=r"keys must be str"):
        encode_sample({"prompt": "p", "m": {1: 2}}, 0)
    with pytest.raises(at.RecordError, match="'messages' or 'prompt'"):
        encode_sample({"text": "hello"}, 0)


def test_unambiguous_values_are_coerced() -> None:
    """numpy and torch scalars, 0-d arrays and tensors, datetimes and tuples are coerced; others refused."""
    from asynctrace._records.encode import encode_sample

    payload, score = encode_sample(
        {
            "prompt": "p",
            "response": "r",
            "reward": np.float32(0.5),
            "n": np.int64(3),
            "mean": np.asarray([0.25, 0.75]).mean(keepdims=True).reshape(()),
            "adv": torch.tensor(1.25),
            "when": dt.datetime(2026, 1, 2, 3, 4, 5),
            "pair": (1, 2),
        },
        0,
    )
    meta = orjson.loads(payload)["metadata"]
    assert meta == {
        "reward": 0.5,
        "n": 3,
        "mean": 0.5,
        "adv": 1.25,
        "when": "2026-01-02T03:04:05",
        "pair": [1, 2],
    }
    assert score == 0.5
    with pytest.raises(at.RecordError, match=r"tensor of shape \(2,\)"):
        encode_sample({"prompt": "p", "t": torch.zeros(2)}, 0)
    with pytest.raises(at.RecordError, match="set has no order"):
        encode_sample({"prompt": "p", "t": {1, 2}}, 0)


def test_prompt_forms_normalise_to_messages() -> None:
    """A string prompt becomes a user message, a list prompt is kept, the response is an assistant message."""
    from asynctrace._records.encode import sample_from

    s = sample_from({"prompt": "q", "response": "a", "reward": 1})
    assert s.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert s.metadata == {"reward": 1}
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert sample_from({"prompt": chat, "response": "a"}).messages == [
        *chat,
        {"role": "assistant", "content": "a"},
    ]
    assert sample_from({"messages": chat, "metadata": {"k": 1}, "x": 2}).metadata == {"x": 2, "k": 1}


def test_reward_breakdown_stays_nested() -> None:
    """A nested reward breakdown is kept as a mapping, never flattened."""
    from asynctrace._records.encode import encode_sample

    payload, _ = encode_sample({"prompt": "p", "reward_breakdown": {"math": 1.0, "format": 0.5}}, 0)
    assert orjson.loads(payload)["metadata"]["reward_breakdown"] == {"math": 1.0, "format": 0.5}


def test_constructor_rejects_bad_options() -> None:
    """Bad constructor arguments raise ValueError naming the argument."""
    for kwargs, name in [
        ({"max_traces_per_step": 0}, "max_traces_per_step"),
        ({"queue_size": -1}, "queue_size"),
        ({"on_full": "wait"}, "on_full"),
        ({"sampler": "best"}, "sampler"),
        ({"flush_interval": 0}, "flush_interval"),
        ({"trace_key": "{step}/x"}, "trace_key"),
        ({"sinks": []}, "sinks"),
        ({"on_invalid": "ignore"}, "on_invalid"),
        ({"sinks": at.testing.MemorySink()}, r"sinks must be a list of sinks, got one MemorySink"),
        ({"sinks": "trackio"}, "sinks"),
        ({"trace_key": 5}, "trace_key"),
    ]:
        with pytest.raises(ValueError, match=name):
            at.TraceSession("p", sinks=kwargs.pop("sinks", [at.testing.MemorySink()]), **kwargs)  # type: ignore[arg-type]
    for retry_kwargs, name in [
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": 1.5}, "max_attempts"),
        ({"max_attempts": "3"}, "max_attempts"),
        ({"initial_backoff": -1}, "initial_backoff"),
        ({"attempt_timeout": 0}, "attempt_timeout"),
    ]:
        with pytest.raises(ValueError, match=name):
            at.RetryPolicy(**retry_kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_chars"):
        at.ConsoleSink(max_chars="x")  # type: ignore[arg-type]


# Values that are valid JSON once coerced, and values that never are.
_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=50),
    st.just("z" * 200_000),
)
_junk = st.one_of(
    st.binary(max_size=10),
    st.integers(min_value=2**64, max_value=2**80),
    st.builds(Opaque),
    st.sets(st.integers(), min_size=1, max_size=3),
    st.just("\ud800"),
    st.just(torch.zeros(3)),
    st.just(np.float64("nan")),
)
_value = st.recursive(
    st.one_of(_leaf, _junk),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=5), inner, max_size=4),
        st.dictionaries(st.integers(), inner, min_size=1, max_size=2),
        st.tuples(inner, inner),
    ),
    max_leaves=12,
)
_record = st.one_of(
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=20), _value), "response": _value}),
    st.fixed_dictionaries({"messages": _value}),
    st.dictionaries(st.text(max_size=8), _value, max_size=4).map(lambda d: {"prompt": "p", **d}),
    _value,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(junk=st.lists(_record, min_size=1, max_size=4))
def test_junk_records_raise_or_are_counted_and_never_kill_the_writer(junk: list[Any]) -> None:
    """Hypothesis junk: the caller gets RecordError or a counted drop; valid records around it are written."""
    sink = at.testing.MemorySink()
    raised = 0
    with at.TraceSession("p", sinks=[sink], flush_interval=0.01) as strict:
        for item in junk:
            try:
                strict.log_samples([sample(0), item, sample(1)], step=0)
            except at.RecordError as exc:
                assert "sample 1" in str(exc) and exc.index == 1
                raised += 1
            strict.log_samples([sample(2)], step=1)  # the writer is still alive
        assert strict.flush(timeout=10)
        st_ = strict.stats()
    ok = len(junk) - raised
    assert st_.written == 3 * ok + len(junk) and st_.check()

    skipping = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[skipping], on_invalid="skip", flush_interval=0.01) as lenient:
        for item in junk:
            lenient.log_samples([sample(0), item, sample(1)], step=0)
        assert lenient.flush(timeout=10)
        st2 = lenient.stats()
    assert st2.dropped.get("invalid", 0) == raised
    assert st2.written == 3 * ok + 2 * raised and st2.check()
    for record in skipping.records:
        body = orjson.loads(record.payload)
        assert isinstance(body["messages"], list)
        for value in body["metadata"].values():
            assert not (isinstance(value, float) and math.isnan(value))


_good_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]), "content": st.one_of(st.none(), st.text(max_size=20))}
)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.one_of(st.just("user"), _value), "content": _value}),
    st.fixed_dictionaries({"role": st.just("assistant")}),
    _value,
)
_plain_sample = st.builds(
    at.Sample,
    messages=st.one_of(st.lists(_good_message, max_size=3), st.lists(_message, max_size=3), _value),
    metadata=st.one_of(
        st.fixed_dictionaries(
            {"reward": st.one_of(st.floats(allow_nan=True, allow_infinity=True), _leaf, _junk)},
            optional={"x": _value},
        ),
        st.dictionaries(st.text(max_size=5), _value, max_size=3),
        _value,
    ),
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(
    items=st.lists(_plain_sample, min_size=1, max_size=3),
    max_bytes=st.sampled_from([None, 120, 10_000]),
    ranked=st.booleans(),
)
def test_fast_paths_agree_with_the_careful_path(
    items: list[at.Sample], max_bytes: int | None, ranked: bool
) -> None:
    """A Sample through the fast path gives the payload, score or RecordError the careful path gives."""
    from asynctrace._records.encode import encode_samples

    def outcome(item: at.Sample, careful: bool) -> tuple[Any, ...]:
        try:
            encoded, invalid = encode_samples(
                [item],
                redact=(lambda s: s) if careful else None,  # any redact takes the careful path
                skip_invalid=False,
                max_bytes=max_bytes,
                score_needed_by="top_bottom sampler" if ranked else None,
            )
        except at.RecordError as exc:
            return ("error", exc.index, exc.path)
        ((payload, score),) = encoded
        return (payload, score, invalid)

    for item in items:
        assert outcome(item, careful=False) == outcome(item, careful=True)


@pytest.mark.anyio
async def test_odd_but_valid_values_reach_trackio(project: str) -> None:
    """NaN, huge strings, tool calls and coerced values go through Trackio's writer without killing it."""
    records = [
        {"prompt": "nan reward", "response": "r", "reward": float("nan")},
        {"prompt": "big", "response": "y" * 300_000, "reward": 1.0},
        {
            "messages": [
                {"role": "user", "content": "call a tool"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ],
            "when": dt.date(2026, 1, 1),
            "np": np.arange(3),
        },
    ]
    async with at.TraceSession(project, run="odd", on_invalid="skip") as s:
        await s.log_samples(records, step=0)
        await s.log_samples([{"prompt": "p", "bad": Opaque()}], step=0)
        await s.log_samples([sample(0)], step=1)
    st_ = s.stats()
    assert st_.written == 4 and st_.dropped == {"invalid": 1}
    rows = read_traces(project, "odd")
    assert len(rows) == 4
    by_prompt = {r["messages"][0]["content"]: r for r in rows}
    assert by_prompt["nan reward"]["metadata"]["reward"] is None  # JSON has no NaN
    assert len(by_prompt["big"]["messages"][1]["content"]) == 300_000
    assert by_prompt["call a tool"]["messages"][2]["tool_call_id"] == "c1"
    assert as_logged(by_prompt["call a tool"]["metadata"]) == {"when": "2026-01-01", "np": [0, 1, 2]}
    await anyio.sleep(0)


@pytest.mark.parametrize(
    "bad",
    [
        at.Sample(messages=[{"role": "user", "content": "x"}], score="high"),  # type: ignore[arg-type]
        {"prompt": "p", "response": "r", "score": [1, 2]},
        {"messages": [{"role": "user", "content": "x"}], "score": True},
        {"messages": [{"role": "user", "content": "x"}], "score": np.bool_(True)},
    ],
)
def test_a_score_that_is_not_a_number_is_a_record_error(bad: Any) -> None:
    """`score` must be a number or None even when no sampler ranks by it (path "score")."""
    from asynctrace._records.encode import encode_sample

    with pytest.raises(at.RecordError) as info:
        encode_sample(bad, 2)
    assert info.value.index == 2 and info.value.path == "score"


@pytest.mark.parametrize("value", [np.clongdouble(1 + 2j), np.complex128(1 + 2j), np.array(1 + 2j)])
def test_complex_numbers_in_metadata_are_a_record_error(value: Any) -> None:
    """A complex value has no JSON form: a RecordError naming its path, never its real part alone."""
    from asynctrace._records.encode import encode_sample

    with pytest.raises(at.RecordError) as info:
        encode_sample({"prompt": "p", "z": value}, 0)
    assert info.value.path == "metadata.z"
