"""A small real tokenizer trained in-process, for examples, tests and benchmarks (nothing downloaded)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["SPECIAL_TOKENS", "encode_turns", "toy_tokenizer"]

SPECIAL_TOKENS = ("<pad>", "<|im_start|>", "<|im_end|>")
"""Special tokens of the toy tokenizer, with ids 0, 1, 2 (`<pad>` is 0)."""

_CORPUS = (
    "<|im_start|>system\nYou are a helpful assistant. Think step by step.<|im_end|>\n",
    "<|im_start|>user\nWhat is 17 * 23? Show your work.<|im_end|>\n",
    "<|im_start|>assistant\nLet me compute: 17 * 23 = 17 * 20 + 17 * 3 = 340 + 51 = 391.<|im_end|>\n",
    '<|im_start|>assistant\n<tool_call>{"name": "python", "arguments": {"code": "print(17 * 23)"}}',
    "</tool_call><|im_end|>\n",
    "<|im_start|>tool\n391\n<|im_end|>\n",
    "The answer is 391. The quick brown fox jumps over the lazy dog while the reward model scores it.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n",
    "James buys 3 apples and 4 oranges; how many pieces of fruit does he have? He has 7 pieces.",
    "Error: division by zero. Retrying with a smaller step size, the search returned 12 results.",
    "Unicode works too: café, naïve, Straße, 你好, 🙂.",
)


def toy_tokenizer(
    vocab_size: int = 1000,
    *,
    corpus: Sequence[str] | None = None,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` trained in-process, by default on a few lines of
    chat, tool and code text (or on `corpus`).

    Byte-level means every string round-trips exactly through encode and decode, so it is a
    faithful stand-in for a real model's tokenizer. Needs the `tokenizers` package.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(corpus) if corpus is not None else _CORPUS * 4, trainer)
    # Registered as added tokens so that encode keeps them whole and decode writes them back.
    tokenizer.add_special_tokens(list(special_tokens))
    return tokenizer


def encode_turns(tokenizer: Any, turns: Sequence[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of `(role, text)` turns, each encoded on its own, and the matching loss mask.

    The loss mask is 1 on `assistant` tokens and 0 elsewhere, as RL trainers build it.
    """
    ids: list[int] = []
    mask: list[int] = []
    for role, text in turns:
        piece = tokenizer.encode(text).ids
        ids += piece
        mask += [int(role == "assistant")] * len(piece)
    return ids, mask
