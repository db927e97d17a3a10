"""Token sequences decoded together: one tokenizer call per batch, each distinct sequence once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._bytelevel import byte_table

__all__ = ["SpanBatch", "TextBatch", "batch_decode"]


def batch_decode(tokenizer: Any, sequences: Sequence[Sequence[int]]) -> list[str]:
    """Decode `sequences` in one call, keeping special tokens, for both tokenizer families.

    transformers tokenizers spell it `batch_decode`, a `tokenizers.Tokenizer` spells it
    `decode_batch`; a tokenizer with neither is decoded one sequence at a time. A byte-level
    BPE tokenizer (GPT-2, Llama 3, Qwen style) is decoded from its byte table instead, which
    gives the same text (see `_bytelevel`).
    """
    if not sequences:
        return []
    seqs = sequences if isinstance(sequences, list) else list(sequences)
    table = byte_table(tokenizer, lambda check: tokenizer_decode(tokenizer, check))
    if table is not None:
        texts = table.decode(seqs)
        if texts is not None:
            return texts
    return tokenizer_decode(tokenizer, seqs)


def tokenizer_decode(tokenizer: Any, seqs: Sequence[Sequence[int]]) -> list[str]:
    """`seqs` decoded by the tokenizer itself, in one call where it has a batch decode."""
    if not seqs:
        return []
    method = getattr(tokenizer, "batch_decode", None)
    # Spaces must come back as they were tokenized, or the trace would not show what the model saw.
    kwargs: dict[str, Any] = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    if method is None:
        method = getattr(tokenizer, "decode_batch", None)
        kwargs = {"skip_special_tokens": False}
    if method is None:
        decode = getattr(tokenizer, "decode", None)
        if decode is None:
            raise TypeError(
                f"tokenizer: {type(tokenizer).__name__} has none of batch_decode, decode_batch or decode"
            )
        try:
            return [str(decode(seq, skip_special_tokens=False)) for seq in seqs]
        except TypeError:
            return [str(decode(seq)) for seq in seqs]
    try:
        texts = method(seqs, **kwargs)
    except TypeError:
        # A tokenizer-like object that does not take these keywords: decode with its defaults.
        texts = method(seqs)
    return [str(text) for text in texts]


class TextBatch:
    """Collects token sequences to decode in one call; shared ones (prompts) are decoded once."""

    __slots__ = ("_index", "_seqs")

    def __init__(self) -> None:
        self._index: dict[tuple[int, ...], int] = {}
        self._seqs: list[list[int]] = []

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, tokens: list[int], shared: bool = False) -> int:
        """Queue `tokens` for decoding; returns the handle of its text.

        `shared=True` looks for an identical sequence queued before: the samples of one GRPO
        group share their prompt token for token, so each distinct prompt is decoded once.
        Responses are almost never identical, so they skip the lookup and its hashing.
        """
        if not shared:
            self._seqs.append(tokens)
            return len(self._seqs) - 1
        key = tuple(tokens)
        handle = self._index.get(key)
        if handle is None:
            handle = self._index[key] = len(self._seqs)
            self._seqs.append(tokens)
        return handle

    def decode(self, tokenizer: Any) -> list[str]:
        """Decode everything queued; the text of handle `h` is at index `h`."""
        return batch_decode(tokenizer, self._seqs)


class SpanBatch:
    """Collects turns given as spans of one flat token array, to decode them in one go.

    The tensor path keeps every row's real tokens in one flat CPU array (numpy, or a CPU
    tensor), row after row; a turn is a `[start, end)` span of it. A byte-level tokenizer
    decodes all spans at once from the array (no Python list per token); any other goes
    through a `TextBatch` (shared spans decoded once).
    """

    __slots__ = ("_bounds", "_flat", "_shared")

    def __init__(self, flat: Any) -> None:
        self._flat = flat
        self._bounds: list[int] = []
        self._shared: list[bool] = []

    def add(self, start: int, end: int, shared: bool = False) -> int:
        """Queue the span `[start, end)`; returns the handle of its text (see `TextBatch.add`)."""
        self._bounds += (start, end)
        self._shared.append(shared)
        return len(self._shared) - 1

    def decode(self, tokenizer: Any) -> list[str]:
        """Decode every queued span; the text of handle `h` is at index `h`."""
        if not self._shared:
            return []
        table = byte_table(tokenizer, lambda check: tokenizer_decode(tokenizer, check))
        if table is not None:
            texts = table.decode_spans(self._flat, self._bounds)
            if texts is not None:
                return texts
        tokens = self._flat.tolist()
        batch = TextBatch()
        bounds = self._bounds
        handles = [
            batch.add(tokens[bounds[2 * k] : bounds[2 * k + 1]], shared)
            for k, shared in enumerate(self._shared)
        ]
        decoded = batch.decode(tokenizer)
        return [decoded[h] for h in handles]
