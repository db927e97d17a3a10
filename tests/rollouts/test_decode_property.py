from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asynctrace.rollouts import decode_rollouts
from asynctrace.rollouts._toy import toy_tokenizer
from tests.rollouts._helpers import encode, expected_messages, padded_batch

TOKENIZER = toy_tokenizer()

texts = st.text(min_size=1, max_size=40)


@st.composite
def conversations(draw: st.DrawFn) -> list[tuple[str, str]]:
    """A user prompt, then assistant turns alternating with tool feedback."""
    turns = [("user", draw(texts))]
    for k in range(draw(st.integers(min_value=1, max_value=5))):
        turns.append(("assistant" if k % 2 == 0 else "tool", draw(texts)))
    return turns


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(conversations(), min_size=1, max_size=4), st.sampled_from(["right", "left"]))
def test_any_conversation_round_trips_through_tensors(convs: list[list[tuple[str, str]]], side: str) -> None:
    """Whatever the text and padding side, decoding gives back every turn exactly."""
    batch = padded_batch(TOKENIZER, convs, side=side)
    samples = decode_rollouts(
        batch["input_ids"],
        tokenizer=TOKENIZER,
        attention_mask=batch["attention_mask"],
        loss_mask=batch["loss_mask"],
    )
    assert [s.messages for s in samples] == [expected_messages(c) for c in convs]


@settings(max_examples=40, deadline=None)
@given(st.lists(conversations(), min_size=1, max_size=4), st.data())
def test_any_rows_selection_matches_decoding_everything(convs: list[Any], data: st.DataObject) -> None:
    """Decoding chosen rows gives the same samples as decoding all rows and picking them."""
    encoded = [encode(TOKENIZER, c) for c in convs]
    ids = [e[0] for e in encoded]
    masks = [e[1] for e in encoded]
    rows = data.draw(st.lists(st.integers(min_value=0, max_value=len(convs) - 1), max_size=6))
    everything = decode_rollouts(ids, tokenizer=TOKENIZER, loss_mask=masks)
    chosen = decode_rollouts(ids, tokenizer=TOKENIZER, loss_mask=masks, rows=rows)
    assert chosen == [everything[r] for r in rows]
