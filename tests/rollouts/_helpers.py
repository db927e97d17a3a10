"""Rollout fixtures built with a real tokenizer: conversations, their tokens, padded tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from asynctrace.rollouts import toy_tokenizer
from asynctrace.rollouts._toy import encode_turns

Turn = tuple[str, str]

# Each conversation alternates between what the policy wrote (assistant) and what it was given,
# so every turn is one loss-mask run and must come back as one message, text for text.
CONVERSATIONS: list[list[Turn]] = [
    [
        ("user", "<|im_start|>user\nWhat is 17 * 23? Show your work.<|im_end|>\n"),
        ("assistant", '<tool_call>{"name": "python", "arguments": {"code": "print(17 * 23)"}}</tool_call>'),
        ("tool", "<|im_start|>tool\n391\n<|im_end|>\n"),
        ("assistant", "The answer is 391.<|im_end|>"),
    ],
    [
        ("user", "Say hello in two languages, please."),
        ("assistant", "Hello! 你好 🙂"),
    ],
    [
        ("user", "  leading spaces\nand a newline"),
        ("assistant", "Let me search."),
        ("tool", "Error: division by zero."),
        ("assistant", "Retrying with a smaller step size."),
        ("tool", "the search returned 12 results"),
        ("assistant", "Done: café, naïve, Straße."),
    ],
    [
        ("user", "def add(a, b):"),
        ("assistant", "\n    return a + b\n"),
    ],
]


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """A byte-level BPE tokenizer trained in-process (nothing downloaded)."""
    return toy_tokenizer()


def encode(tokenizer: Any, conversation: Sequence[Turn]) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and its loss mask (1 on assistant tokens)."""
    return encode_turns(tokenizer, conversation)


def expected_messages(conversation: Sequence[Turn], env_role: str = "tool") -> list[dict[str, str]]:
    """The messages decoding must give back: the first turn is the user prompt."""
    out = []
    for i, (role, text) in enumerate(conversation):
        if role != "assistant":
            role = "user" if i == 0 else env_role
        out.append({"role": role, "content": text})
    return out


def pad(rows: Sequence[Sequence[int]], width: int, side: str = "right", fill: int = 0) -> Any:
    """A [len(rows), width] long tensor with each row padded on `side` by `fill`."""
    import torch

    out = torch.full((len(rows), width), fill, dtype=torch.long)
    for r, row in enumerate(rows):
        if row:
            values = torch.tensor(list(row), dtype=torch.long)
            if side == "right":
                out[r, : len(row)] = values
            else:
                out[r, width - len(row) :] = values
    return out


def padded_batch(
    tokenizer: Any, conversations: Sequence[Sequence[Turn]], side: str = "right"
) -> dict[str, Any]:
    """An AReaL-style tensor batch: input_ids, attention_mask, loss_mask, versions (-1 on prompt)."""
    encoded = [encode(tokenizer, c) for c in conversations]
    width = max(len(ids) for ids, _ in encoded) + 5
    ids = [e[0] for e in encoded]
    masks = [e[1] for e in encoded]
    versions = [[(3 + r) if m else -1 for m in mask] for r, mask in enumerate(masks)]
    pad_id = tokenizer.token_to_id("<pad>")
    return {
        "input_ids": pad(ids, width, side, fill=pad_id),
        "attention_mask": pad([[1] * len(x) for x in ids], width, side).bool(),
        "loss_mask": pad(masks, width, side),
        "versions": pad(versions, width, side, fill=-1),
    }


def check_text_ends(
    messages: Sequence[dict[str, Any]], token_ids: Sequence[int], ends: Sequence[int], decode: Any
) -> None:
    """`ends` (a sample's text_ends) cut its messages joined into each token's text: the text of
    tokens 0..i is `decode` of them (less the U+FFFD of a character they end inside)."""
    joined = "".join(m["content"] for m in messages)
    assert len(ends) == len(token_ids) and ends[-1] == len(joined)
    for i in range(len(token_ids)):
        assert joined[: ends[i]] == decode(list(token_ids[: i + 1])).removesuffix("\ufffd"), i
