"""`text_ends`: where each token's text ends in its sample's messages, written by decode_rollouts
beside the other token fields, exact for byte-level BPE whatever the bytes (split characters and
bytes that are not UTF-8 included)."""

from __future__ import annotations

import codecs
import itertools
import random
from typing import Any

import numpy as np
import pytest
import torch

from asynctrace._records.tokens import decode_token_fields
from asynctrace.rollouts import decode_rollouts, toy_tokenizer
from asynctrace.rollouts._bytelevel import byte_table
from asynctrace.rollouts._text import tokenizer_decode
from asynctrace.rollouts._text_ends import RowText, text_ends
from tests.rollouts._helpers import CONVERSATIONS, encode, padded_batch

_SPANS: list[tuple[int, int]] = []


def _record(exc: UnicodeError) -> tuple[str, int]:
    assert isinstance(exc, UnicodeDecodeError)
    _SPANS.append((exc.start, exc.end))
    return "\ufffd", exc.end


codecs.register_error("asynctrace-test-spans", _record)


def _last_bytes(data: bytes) -> tuple[list[bool], str]:
    """Python's own reading of `data` (errors="replace"): which bytes end a character or a
    replaced stretch, found with an error handler that records each stretch it replaces."""
    _SPANS.clear()
    text = data.decode("utf-8", "asynctrace-test-spans")
    assert text == data.decode("utf-8", "replace")
    last = [False] * len(data)
    errors = iter(list(_SPANS))
    error = next(errors, None)
    position = 0
    for char in text:
        if error is not None and position == error[0] and char == "\ufffd":
            position = error[1]
            error = next(errors, None)
        else:
            position += len(char.encode())
        last[position - 1] = True
    assert position == len(data)
    return last, text


def _expected(pieces: list[bytes], spans: list[tuple[int, int]]) -> list[int]:
    """Each token's end in its row's text, from Python's decoder: the characters whose last byte
    is in the token or before it, turn by turn (each turn decoded on its own)."""
    out: list[int] = []
    before = 0
    for start, stop in spans:
        last, text = _last_bytes(b"".join(pieces[start:stop]))
        count = position = 0
        for piece in pieces[start:stop]:
            count += sum(last[position : position + len(piece)])
            position += len(piece)
            out.append(before + count)
        before += len(text)
    return out


def _ends(sample: Any) -> list[int]:
    return list(decode_token_fields(sample.tokens)["text_ends"])


def _pieces(sample: Any) -> list[str]:
    """The sample's joined messages cut at its text_ends: each token's text."""
    joined = "".join(m["content"] for m in sample.messages)
    ends = _ends(sample)
    assert ends[-1] == len(joined)
    return [joined[a:b] for a, b in zip([0, *ends], ends, strict=False)]


def test_ends_cut_the_messages_into_each_tokens_text(tokenizer: Any) -> None:
    """With token fields, every sample gets text_ends: its messages joined, cut there, are each
    token's text as Python decodes its bytes, the same from tensors and from lists."""
    batch = padded_batch(tokenizer, CONVERSATIONS)
    fields = {"logprobs": torch.zeros(batch["input_ids"].shape)}
    tensors = decode_rollouts(**batch, tokenizer=tokenizer, token_fields=fields, rows=[3, 1, 0, 2])
    lists = decode_rollouts(
        **{k: v.tolist() for k, v in batch.items()},
        tokenizer=tokenizer,
        token_fields={k: v.tolist() for k, v in fields.items()},
        rows=[3, 1, 0, 2],
    )
    table = byte_table(tokenizer, lambda check: tokenizer_decode(tokenizer, check))
    assert table is not None
    for got, listed, row in zip(tensors, lists, [3, 1, 0, 2], strict=True):
        assert _ends(got) == _ends(listed)
        ids, _ = encode(tokenizer, CONVERSATIONS[row])
        cuts = [0]
        for message in got.messages:
            cuts.append(cuts[-1] + len(tokenizer.encode(message["content"]).ids))
        spans = list(itertools.pairwise(cuts))
        assert _ends(got) == _expected([table.pieces[i] for i in ids], spans)
        assert "".join(_pieces(got)) == "".join(text for _, text in CONVERSATIONS[row])


def test_a_split_character_belongs_to_the_token_holding_its_last_byte(tokenizer: Any) -> None:
    """An emoji written one byte a token: the tokens before its last byte have no text of their
    own, and the last one holds the emoji; a sample's other tokens keep theirs."""
    table = byte_table(tokenizer, lambda check: tokenizer_decode(tokenizer, check))
    assert table is not None
    single = {piece[0]: i for i, piece in reversed(list(enumerate(table.pieces))) if len(piece) == 1}
    ids = tokenizer.encode("Hi ").ids + [single[b] for b in "🙂".encode()] + tokenizer.encode("!").ids
    (sample,) = decode_rollouts([ids], tokenizer=tokenizer, token_fields={"token_ids": [ids]})
    assert _pieces(sample)[-5:] == ["", "", "", "🙂", "!"]


@pytest.mark.parametrize("seed", range(4))
def test_bytes_that_are_not_utf8_end_where_the_decoder_replaces_them(seed: int) -> None:
    """Random ids, lone bytes and characters cut short, in random turns of random rows: the ends
    are those of Python's decoder (errors="replace"), one U+FFFD per stretch it replaces."""
    tokenizer = toy_tokenizer()
    table = byte_table(tokenizer, lambda check: tokenizer_decode(tokenizer, check))
    assert table is not None
    single = {piece[0]: i for i, piece in enumerate(table.pieces) if len(piece) == 1}
    rng = random.Random(seed)
    for _ in range(200):
        rows: list[RowText] = []
        flat: list[int] = []
        for _ in range(rng.randrange(1, 4)):
            ids: list[int] = []
            for _ in range(rng.randrange(0, 25)):
                pick = rng.random()
                if pick < 0.2:
                    ids.append(rng.randrange(len(table.pieces)))
                elif pick < 0.7:
                    ids.append(single[rng.choice(list(single))])
                else:
                    data = rng.choice(["é", "你", "🙂", "a", "\ufffd", "\U0010ffff"]).encode()
                    ids += [single[b] for b in data[: rng.randrange(1, len(data) + 1)]]
            cuts = sorted({0, len(ids), *rng.sample(range(len(ids) + 1), min(len(ids) + 1, 2))})
            spans = list(itertools.pairwise(cuts))
            texts = [table.decode([ids[a:b]])[0] for a, b in spans]  # type: ignore[index]
            rows.append(RowText(len(flat), len(ids), spans, texts))
            flat += ids
        for row, got in zip(rows, text_ends(tokenizer, np.asarray(flat), rows), strict=True):
            assert got is not None
            pieces = [table.pieces[i] for i in flat[row.offset : row.offset + row.length]]
            assert np.frombuffer(got, "<i4").tolist() == _expected(pieces, list(row.spans))


def test_other_tokenizers_and_given_ends_are_left_as_they_are(tokenizer: Any) -> None:
    """A tokenizer that is not byte-level BPE gets no text_ends (its text is still decoded);
    text_ends given in token_fields are kept; without token fields a sample has no tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.decoder = decoders.WordPiece()
    (other,) = decode_rollouts([[1, 2, 3]], tokenizer=wordpiece, token_fields={"token_ids": [[1, 2, 3]]})
    assert other.messages == [{"role": "assistant", "content": "hello worlds"}]
    assert set(other.tokens or {}) == {"token_ids"}
    ids = tokenizer.encode("some text").ids
    given = list(range(len(ids)))
    (kept,) = decode_rollouts([ids], tokenizer=tokenizer, token_fields={"text_ends": [given]})
    assert _ends(kept) == given
    (plain,) = decode_rollouts([ids], tokenizer=tokenizer)
    assert plain.tokens is None
