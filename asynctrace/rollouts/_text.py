"""Token sequences decoded together: one tokenizer call per batch, each distinct sequence once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TextBatch", "batch_decode"]


def batch_decode(tokenizer: Any, sequences: Sequence[Sequence[int]]) -> list[str]:
    """Decode `sequences` in one call, keeping special tokens, for both tokenizer families.

    transformers tokenizers spell it `batch_decode`, a `tokenizers.Tokenizer` spells it
    `decode_batch`; a tokenizer with neither is decoded one sequence at a time.
    """
    if not sequences:
        return []
    seqs = sequences if isinstance(sequences, list) else list(sequences)
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
