"""From token runs to chat turns: the loss mask says who produced each stretch of tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._text import SpanBatch, TextBatch

__all__ = ["Run", "Turns", "mask_runs", "split_span_turns", "split_turns"]

Run = tuple[int, int, bool]
"""`(start, end, generated)`: a maximal stretch of tokens with the same loss-mask value."""


def mask_runs(mask: Sequence[Any]) -> list[Run]:
    """Maximal runs of equal truthiness in `mask` (nonzero means the policy generated the token)."""
    runs: list[Run] = []
    if not mask:
        return runs
    start = 0
    current = bool(mask[0])
    for i, value in enumerate(mask):
        flag = bool(value)
        if flag is not current:
            runs.append((start, i, current))
            start, current = i, flag
    runs.append((start, len(mask), current))
    return runs


@dataclass(slots=True, eq=False)
class Turns:
    """The turns of one sample, each a role and a handle into a `TextBatch`, plus its token counts.

    `spans[k]` is turn k's `[start, end)` in the sample's tokens: the turns cover them in order."""

    turns: list[tuple[str, int]]
    prompt_len: int
    seq_len: int
    num_turns: int
    spans: list[tuple[int, int]]

    def messages(self, texts: Sequence[str]) -> list[dict[str, Any]]:
        """Chat messages once the batch is decoded."""
        return [{"role": role, "content": texts[handle]} for role, handle in self.turns]


def _split(
    n: int,
    runs: list[Run] | None,
    prompt_len: int | None,
    env_role: str,
    add: Callable[[int, int, bool], int],
) -> Turns:
    """Cut a sample of `n` tokens into turns, queueing each `[start, end)` span with `add`.

    Without `prompt_len`, a leading run the policy did not generate is the user prompt; with
    it, the first `prompt_len` tokens are. After the prompt, generated runs are `assistant`
    turns and the others `env_role` turns (tool results or user feedback). No runs at all
    means the tokens were all generated. Nothing after a prompt is one empty `assistant` turn,
    so a prompt always gets its (possibly empty) answer. The prompt is queued as shared: the
    samples of a group decode their common prompt once.
    """
    if runs is None:
        runs = [(0, n, True)] if n else []
    turns: list[tuple[str, int]] = []
    spans: list[tuple[int, int]] = []
    if prompt_len is not None:
        cut = min(max(prompt_len, 0), n)
        if cut:
            turns.append(("user", add(0, cut, True)))
            spans.append((0, cut))
        runs = [(max(start, cut), end, gen) for start, end, gen in runs if end > cut]
    elif runs and not runs[0][2]:
        start, cut, _ = runs[0]
        turns.append(("user", add(start, cut, True)))
        spans.append((start, cut))
        runs = runs[1:]
    else:
        cut = 0
    if turns and not runs:
        # Nothing after the prompt: the policy's answer was empty (an aborted or zero-length
        # generation), which is still an answer to log. A row with no tokens at all stays empty.
        runs = [(cut, cut, True)]
    num_turns = 0
    for start, end, gen in runs:
        num_turns += gen
        turns.append(("assistant" if gen else env_role, add(start, end, False)))
        spans.append((start, end))
    return Turns(turns, prompt_len=cut, seq_len=n, num_turns=num_turns, spans=spans)


def split_turns(
    tokens: list[int], runs: list[Run] | None, prompt_len: int | None, env_role: str, texts: TextBatch
) -> Turns:
    """Cut one sample's tokens into turns and queue each turn's text in `texts` (see `_split`)."""
    return _split(
        len(tokens), runs, prompt_len, env_role, lambda a, b, shared: texts.add(tokens[a:b], shared)
    )


def split_span_turns(
    offset: int, n: int, runs: list[Run] | None, prompt_len: int | None, env_role: str, texts: SpanBatch
) -> Turns:
    """`split_turns` for a sample whose `n` tokens start at `offset` of the flat array of `texts`."""
    return _split(
        n, runs, prompt_len, env_role, lambda a, b, shared: texts.add(offset + a, offset + b, shared)
    )
