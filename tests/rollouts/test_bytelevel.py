from __future__ import annotations

import importlib.util
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from asynctrace.rollouts import _bytelevel, decode_rollouts, toy_tokenizer
from asynctrace.rollouts._bytelevel import ByteTable, byte_table, char_bytes
from asynctrace.rollouts._text import SpanBatch, TextBatch, batch_decode, tokenizer_decode

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")

# Added tokens whose characters are not all byte-level ones: the decoder keeps their UTF-8 as is.
ODD_ADDED = ["<think>\n", "ünïcödé", " spaced out ", "Ġalready", "🙂🙂"]


def _odd_tokenizer() -> Any:
    tokenizer = toy_tokenizer()
    tokenizer.add_tokens(ODD_ADDED[:3])
    tokenizer.add_special_tokens(ODD_ADDED[3:])
    return tokenizer


TOKENIZER = _odd_tokenizer()
SIZE = TOKENIZER.get_vocab_size(with_added_tokens=True)
SPECIAL = sorted(TOKENIZER.get_added_tokens_decoder())


def _byte_ids(tokenizer: Any) -> dict[int, int]:
    """byte -> the id of the token that is that one byte."""
    mapping = char_bytes()
    out = {}
    for token, i in tokenizer.get_vocab().items():
        if len(token) == 1 and token in mapping:
            out[mapping[token]] = i
    return out


BYTES = _byte_ids(TOKENIZER)
HIGH_BYTES = sorted(i for b, i in BYTES.items() if b >= 0x80)

ids = st.one_of(
    st.integers(min_value=0, max_value=SIZE - 1),
    st.sampled_from(SPECIAL),
    st.sampled_from(HIGH_BYTES),
)
sequences = st.lists(st.lists(ids, max_size=30), min_size=1, max_size=8)


def _reference(tokenizer: Any) -> Any:
    return lambda seqs: tokenizer_decode(tokenizer, seqs)


class Plain:
    """A tokenizer-like wrapper the fast path does not recognise: always the tokenizer's decode."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return list(self.inner.decode_batch(sequences, skip_special_tokens=skip_special_tokens))


class Wrapper:
    """A transformers-style tokenizer: `batch_decode` plus the `backend_tokenizer` doing the work."""

    def __init__(self, inner: Any, shout: bool = False) -> None:
        self.backend_tokenizer = inner
        self.shout = shout

    def batch_decode(
        self,
        sequences: list[list[int]],
        skip_special_tokens: bool = True,
        clean_up_tokenization_spaces: bool = True,
    ) -> list[str]:
        texts = self.backend_tokenizer.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
        return [t.upper() if self.shout else t for t in texts]


class SlotWrapper:
    """A wrapper that takes no weak reference (slots, no __weakref__)."""

    __slots__ = ("backend_tokenizer",)

    def __init__(self, inner: Any) -> None:
        self.backend_tokenizer = inner

    def batch_decode(self, sequences: list[list[int]], **kwargs: Any) -> list[str]:
        return list(self.backend_tokenizer.decode_batch(sequences, skip_special_tokens=False))


def test_byte_level_tokenizers_get_a_table() -> None:
    """The toy tokenizer, one with odd added tokens and a transformers-style wrapper all qualify."""
    for tokenizer in (toy_tokenizer(), TOKENIZER, Wrapper(TOKENIZER)):
        assert byte_table(tokenizer, _reference(tokenizer)) is not None


def test_added_tokens_decode_as_the_tokenizer_writes_them() -> None:
    """Added tokens decode as the tokenizer decodes them, byte-level characters or not."""
    table = byte_table(TOKENIZER, _reference(TOKENIZER))
    assert table is not None
    for content in ODD_ADDED:
        token_id = TOKENIZER.token_to_id(content)
        assert table.decode([[token_id]]) == TOKENIZER.decode_batch([[token_id]], skip_special_tokens=False)
    # A character outside the byte alphabet keeps the whole token's UTF-8 as it is ...
    for content in ("<think>\n", " spaced out ", "🙂🙂"):
        assert table.decode([[TOKENIZER.token_to_id(content)]]) == [content]
    # ... while one made of byte-level characters only is read as bytes, as the decoder reads it.
    assert table.decode([[TOKENIZER.token_to_id("Ġalready")]]) == [" already"]
    assert table.decode([[TOKENIZER.token_to_id("ünïcödé")]]) == ["\ufffdn\ufffdc\ufffdd\ufffd"]


@settings(max_examples=150, deadline=None)
@given(sequences)
def test_table_matches_the_tokenizer(seqs: list[list[int]]) -> None:
    """Random ids (special tokens, lone bytes of split characters) decode exactly as the tokenizer does."""
    table = byte_table(TOKENIZER, _reference(TOKENIZER))
    assert table is not None
    expected = TOKENIZER.decode_batch(seqs, skip_special_tokens=False)
    assert table.decode(seqs) == expected
    assert [TOKENIZER.decode(s, skip_special_tokens=False) for s in seqs] == expected
    assert batch_decode(TOKENIZER, seqs) == expected


@settings(max_examples=150, deadline=None)
@given(sequences)
def test_vectorised_spans_match_the_tokenizer(seqs: list[list[int]]) -> None:
    """The numpy span decoder gives the tokenizer's text for every span of one flat array."""
    np = pytest.importorskip("numpy")
    table = byte_table(TOKENIZER, _reference(TOKENIZER))
    assert table is not None
    flat = [i for seq in seqs for i in seq]
    bounds: list[int] = []
    at = 0
    for seq in seqs:
        bounds += (at, at + len(seq))
        at += len(seq)
    expected = TOKENIZER.decode_batch(seqs, skip_special_tokens=False)
    assert table.decode_spans(np.asarray(flat, dtype=np.int64), bounds) == expected
    assert table.decode_spans(np.asarray(flat, dtype=np.int32), bounds) == expected


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40))
def test_invalid_utf8_is_replaced_like_rust(data: bytes) -> None:
    """Python's errors="replace" matches Rust's from_utf8_lossy on any bytes, broken ones included."""
    seq = [BYTES[b] for b in data]
    expected = TOKENIZER.decode(seq, skip_special_tokens=False)
    assert data.decode("utf-8", "replace") == expected
    table = byte_table(TOKENIZER, _reference(TOKENIZER))
    assert table is not None and table.decode([seq]) == [expected]


def test_small_chunks_give_the_same_text() -> None:
    """Gathering the bytes in many small chunks gives the same text as in one."""
    np = pytest.importorskip("numpy")
    table = byte_table(TOKENIZER, _reference(TOKENIZER))
    assert table is not None
    flat = np.arange(SIZE, dtype=np.int64).repeat(3)
    bounds = [0, 5, 5, 700, 700, flat.size, 3, 3]
    whole = table.decode_spans(flat, bounds)
    with mock.patch.object(_bytelevel, "_CHUNK", 7):
        assert table.decode_spans(flat, bounds) == whole
    seqs = [flat[a:b].tolist() for a, b in zip(bounds[::2], bounds[1::2], strict=True)]
    assert whole == TOKENIZER.decode_batch(seqs, skip_special_tokens=False)


def test_unknown_and_negative_ids_go_to_the_tokenizer() -> None:
    """Ids past the vocabulary are dropped as the tokenizer drops them; negative ones fail as there."""
    np = pytest.importorskip("numpy")
    table = byte_table(TOKENIZER, _reference(TOKENIZER))
    assert table is not None
    assert table.decode([[5, SIZE + 10, 6]]) is None
    assert table.decode([[5, -1]]) is None
    assert table.decode_spans(np.asarray([5, SIZE + 10]), [0, 2]) is None
    assert table.decode_spans(np.asarray([5, -1]), [0, 2]) is None
    assert table.decode_spans(np.asarray([5.0, 6.0]), [0, 2]) is None
    assert batch_decode(TOKENIZER, [[5, SIZE + 10, 6]]) == TOKENIZER.decode_batch(
        [[5, SIZE + 10, 6]], skip_special_tokens=False
    )
    with pytest.raises(OverflowError):
        batch_decode(TOKENIZER, [[5, -1]])


def test_ids_without_a_token_add_nothing() -> None:
    """A vocabulary with holes: an id between tokens is dropped, by the table as by the tokenizer."""
    np = pytest.importorskip("numpy")
    to_char = {b: c for c, b in char_bytes().items()}
    vocab = {to_char[b]: b for b in range(256)}
    vocab[to_char[ord("h")] + to_char[ord("i")]] = 300
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = decoders.ByteLevel()
    table = byte_table(tokenizer, _reference(tokenizer))
    assert table is not None and table.pieces[280] == b""
    seqs = [[280, 300, 65], [280], [0xC3, 280, 0xA9]]
    expected = tokenizer.decode_batch(seqs, skip_special_tokens=False)
    assert expected == ["hiA", "", "é"]
    assert table.decode(seqs) == expected
    assert (
        table.decode_spans(np.asarray([280, 300, 65, 280, 0xC3, 280, 0xA9]), [0, 3, 3, 4, 4, 7]) == expected
    )


def test_table_is_rebuilt_when_tokens_are_added() -> None:
    """Adding tokens after the table was built does not leave it stale."""
    tokenizer = toy_tokenizer()
    before = byte_table(tokenizer, _reference(tokenizer))
    assert before is not None
    tokenizer.add_tokens(["<tool_response>\n"])
    new_id = tokenizer.token_to_id("<tool_response>\n")
    assert batch_decode(tokenizer, [[new_id, 5]]) == tokenizer.decode_batch(
        [[new_id, 5]], skip_special_tokens=False
    )
    after = byte_table(tokenizer, _reference(tokenizer))
    assert after is not None and after is not before and len(after.pieces) > len(before.pieces)


def _word_level() -> Any:
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    corpus = ["hello world the quick brown fox", "jumps over the lazy dog, said the tool"]
    tokenizer.train_from_iterator(
        corpus, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"], show_progress=False)
    )
    return tokenizer


def _word_piece() -> Any:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    corpus = ["hello world the quick brown fox", "jumps over the lazy dog, said the tool"]
    tokenizer.train_from_iterator(
        corpus,
        trainers.WordPieceTrainer(vocab_size=80, special_tokens=["[PAD]", "[UNK]"], show_progress=False),
    )
    return tokenizer


@pytest.mark.parametrize("make", [_word_level, _word_piece], ids=["wordlevel", "wordpiece"])
def test_other_decoders_fall_back_to_the_tokenizer(make: Any) -> None:
    """WordLevel (no decoder) and WordPiece tokenizers get no table and still decode correctly."""
    tokenizer = make()
    assert byte_table(tokenizer, _reference(tokenizer)) is None
    turns = ["hello world", "the quick brown fox", "said the tool"]
    pieces = [tokenizer.encode(t).ids for t in turns]
    ids = [pieces[0] + pieces[1] + pieces[2]]
    mask = [[0] * len(pieces[0]) + [1] * len(pieces[1]) + [0] * len(pieces[2])]
    expected = [tokenizer.decode(p, skip_special_tokens=False) for p in pieces]
    (sample,) = decode_rollouts(ids, tokenizer=tokenizer, loss_mask=mask)
    assert [m["content"] for m in sample.messages] == expected
    if importlib.util.find_spec("torch") is not None:
        import torch

        (sample,) = decode_rollouts(torch.tensor(ids), tokenizer=tokenizer, loss_mask=torch.tensor(mask))
        assert [m["content"] for m in sample.messages] == expected


def test_a_failed_self_check_keeps_the_tokenizers_decode() -> None:
    """A wrapper whose decode differs from its backend's is caught at build time and left to itself."""
    shouting = Wrapper(TOKENIZER, shout=True)
    assert byte_table(shouting, _reference(shouting)) is None
    seqs = [TOKENIZER.encode("hello there").ids]
    assert batch_decode(shouting, seqs) == ["HELLO THERE"]
    # The verdict is kept: no second build.
    with mock.patch.object(_bytelevel, "_build_pieces", side_effect=AssertionError("rebuilt")):
        assert byte_table(shouting, _reference(shouting)) is None


def test_tokenizers_without_weak_references_are_cached_too() -> None:
    """A wrapper that takes no weak reference is cached by identity, holding the wrapper."""
    wrapper = SlotWrapper(TOKENIZER)
    table = byte_table(wrapper, _reference(wrapper))
    assert table is not None
    with mock.patch.object(_bytelevel, "_build_pieces", side_effect=AssertionError("rebuilt")):
        assert byte_table(wrapper, _reference(wrapper)) is table
    assert batch_decode(wrapper, [[5, 6]]) == TOKENIZER.decode_batch([[5, 6]], skip_special_tokens=False)


def test_without_numpy_spans_decode_through_lists() -> None:
    """With no numpy, spans are decoded from lists with the byte table, to the same text."""
    np = pytest.importorskip("numpy")
    flat = np.asarray([5, 6, 7, *SPECIAL, *HIGH_BYTES[:3]], dtype=np.int64)
    spans = SpanBatch(flat)
    handles = [spans.add(0, 3, shared=True), spans.add(3, flat.size), spans.add(0, 3, shared=True)]
    expected = TOKENIZER.decode_batch(
        [flat[:3].tolist(), flat[3:].tolist(), flat[:3].tolist()], skip_special_tokens=False
    )
    assert [spans.decode(TOKENIZER)[h] for h in handles] == expected
    with mock.patch.object(_bytelevel, "_numpy", return_value=None):
        assert [spans.decode(TOKENIZER)[h] for h in handles] == expected
    assert [spans.decode(Plain(TOKENIZER))[h] for h in handles] == expected


def test_text_batch_decodes_shared_sequences_once() -> None:
    """TextBatch still hands out one handle per distinct shared sequence, fast path or not."""
    texts = TextBatch()
    a = texts.add([5, 6], shared=True)
    b = texts.add([5, 6], shared=True)
    c = texts.add([5, 6])
    assert a == b != c and len(texts) == 2
    assert texts.decode(TOKENIZER) == TOKENIZER.decode_batch([[5, 6], [5, 6]], skip_special_tokens=False)


def test_byte_table_decodes_empty_sequences() -> None:
    """Empty sequences and empty batches decode to empty text."""
    table = ByteTable([b"a", b"\xc3", b"\xa9"])
    assert table.decode([[], [0, 1, 2], [1]]) == ["", "aé", "\ufffd"]
    assert table.decode_spans([0, 1, 2], [0, 0, 0, 3, 1, 2]) == ["", "aé", "\ufffd"]
    assert table.decode_spans([], []) == []


@st.composite
def batches(draw: st.DrawFn) -> dict[str, Any]:
    """Random ids (special and split bytes included) with holey attention masks, loss masks, versions."""
    n_rows = draw(st.integers(min_value=0, max_value=5))
    width = draw(st.integers(min_value=0, max_value=14))
    cell = st.tuples(ids, st.booleans(), st.integers(0, 2), st.integers(-1, 4))
    rows = [[draw(cell) for _ in range(width)] for _ in range(n_rows)]
    return {
        "input_ids": [[c[0] for c in row] for row in rows],
        "attention_mask": [[int(c[1]) for c in row] for row in rows],
        "loss_mask": [[c[2] for c in row] for row in rows],
        "versions": [[c[3] for c in row] for row in rows],
        "width": width,
    }


@needs_torch
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.booleans(), st.booleans(), st.data())
def test_every_path_gives_the_same_samples(
    batch: dict[str, Any], with_attention: bool, with_prompt_lens: bool, data: st.DataObject
) -> None:
    """numpy or torch layout, byte table or tokenizer, tensors or lists: the same samples."""
    import torch

    from asynctrace.rollouts import _decode

    n_rows, width = len(batch["input_ids"]), batch["width"]

    def tensor(rows: list[list[int]]) -> Any:
        return torch.tensor(rows, dtype=torch.long).reshape(n_rows, width)

    rows = data.draw(st.none() | st.lists(st.integers(0, max(n_rows - 1, 0)), max_size=4)) if n_rows else None
    kwargs: dict[str, Any] = {"loss_mask": batch["loss_mask"], "versions": batch["versions"], "rows": rows}
    if with_attention:
        kwargs["attention_mask"] = batch["attention_mask"]
    if with_prompt_lens:
        kwargs["prompt_lens"] = [2] * n_rows
    reference = decode_rollouts(batch["input_ids"], tokenizer=Plain(TOKENIZER), **kwargs)
    assert decode_rollouts(batch["input_ids"], tokenizer=TOKENIZER, **kwargs) == reference
    tensors = {
        name: tensor(value) if name in ("loss_mask", "versions", "attention_mask") else value
        for name, value in kwargs.items()
    }
    ids = tensor(batch["input_ids"])
    assert decode_rollouts(ids, tokenizer=TOKENIZER, **tensors) == reference
    assert decode_rollouts(ids, tokenizer=Plain(TOKENIZER), **tensors) == reference
    with mock.patch.object(_decode, "_numpy_parts", return_value=None):
        assert decode_rollouts(ids, tokenizer=TOKENIZER, **tensors) == reference
        assert decode_rollouts(ids, tokenizer=Plain(TOKENIZER), **tensors) == reference


def test_a_failed_span_check_keeps_spans_off() -> None:
    """The numpy decoder checks itself on first use; if it disagrees, spans go the list way."""
    pytest.importorskip("numpy")
    table = ByteTable([b"a", b"b"], check=([[0, 1]], ["not ab"]))
    assert table.decode([[0, 1]]) == ["ab"]
    assert table.decode_spans([0, 1], [0, 2]) is None
    assert ByteTable([b"a", b"b"], check=([[0, 1]], ["ab"])).decode_spans([0, 1], [0, 2]) == ["ab"]
