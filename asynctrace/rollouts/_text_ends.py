"""Where each token's text ends in its sample's text: the `text_ends` token field.

A decoded sample's messages hold the text of its turns, each decoded on its own from its tokens,
so their contents joined are the text of all its tokens, in order. `text_ends[i]` is how many
characters of that joined text tokens 0..i wrote: token i's text is ``joined[ends[i-1]:ends[i]]``.
With byte-level BPE a token may end inside a multi-byte UTF-8 character (an emoji is often two or
three tokens): a character belongs to the token that holds its last byte, and the tokens before
it have no text of their own (their end does not move). Bytes that are not UTF-8 (a generation
cut inside a character) are one U+FFFD per stretch in the text, as the tokenizer writes them,
and that character too belongs to the token holding the stretch's last byte.

The ends come from the byte table that decoded the text (`_bytelevel`, byte-level BPE only): for
any other tokenizer, or an id outside the table, a sample gets none. Computed with numpy for the
whole batch at once, with no Python step per token: this runs in the training loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._bytelevel import byte_table
from ._text import tokenizer_decode

__all__ = ["RowText", "flatten", "text_ends"]

_LIMIT = 2**31  # ends are kept as int32


@dataclass(frozen=True, slots=True)
class RowText:
    """One sample in the flat token array: its tokens `[offset, offset + length)`, its turns'
    token spans (from 0, covering its tokens in order) and each turn's decoded text."""

    offset: int
    length: int
    spans: Sequence[tuple[int, int]]
    texts: Sequence[str]


def flatten(rows: Sequence[Sequence[int]]) -> Any:
    """Token lists one after another as one numpy int64 array; None without numpy or for values
    that are not token ids (the rows then get no `text_ends`)."""
    try:
        import numpy as np

        total = sum(len(row) for row in rows)
        return np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)
    except (ImportError, TypeError, ValueError, OverflowError):
        return None


def text_ends(tokenizer: Any, flat: Any, rows: Sequence[RowText]) -> list[bytes | None]:
    """Each row's `text_ends` as little-endian int32 bytes, from the tokens of `flat` (a 1-D
    integer array: numpy or a CPU tensor); None for every row where the byte table cannot say."""
    none: list[bytes | None] = [None] * len(rows)
    table = byte_table(tokenizer, lambda check: tokenizer_decode(tokenizer, check)) if rows else None
    got = table.token_bytes(flat) if table is not None and flat is not None else None
    if got is None:
        return none
    import numpy as np

    ends = np.asarray(got.ends, dtype=np.int64)
    # The turns of every row, in the flat array's order: (first token, end token, row, chars before).
    turns: list[tuple[int, int, int, int]] = []
    texts: list[str] = []
    position = 0
    for j, row in enumerate(rows):
        if row.offset != position or len(row.spans) != len(row.texts):
            return none
        before = 0
        for (start, stop), text in zip(row.spans, row.texts, strict=True):
            if start != position - row.offset or stop < start:
                return none
            if stop > start:
                turns.append((row.offset + start, row.offset + stop, j, before))
                texts.append(text)
            position = row.offset + stop
            before += len(text)
        if position != row.offset + row.length:
            return none
    if position != ends.size:
        return none
    data = np.frombuffer(got.raw, dtype=np.uint8)
    bounds = np.concatenate((np.zeros(1, np.int64), ends))
    spans = np.asarray([(t[0], t[1]) for t in turns], dtype=np.int64).reshape(-1, 2)
    first_byte, stop_byte = bounds[spans[:, 0]], bounds[spans[:, 1]]
    # Characters (and U+FFFDs) ending in each turn's bytes up to each token's end.
    count = np.zeros(data.size + 1, dtype=np.int64)
    np.cumsum(_last_bytes(np, data, np.repeat(stop_byte, stop_byte - first_byte)), out=count[1:])
    sizes = spans[:, 1] - spans[:, 0]
    earlier = np.asarray([t[3] for t in turns], dtype=np.int64)  # the row's characters before each turn
    chars = count[ends] - np.repeat(count[first_byte] - earlier, sizes)
    out = none[:]
    for j, row in enumerate(rows):
        part = chars[row.offset : row.offset + row.length]
        out[j] = part.astype("<i4").tobytes() if not part.size or int(part.max()) < _LIMIT else None
    for (_, last, j, before), text in zip(turns, texts, strict=True):
        if int(chars[last - 1]) - before != len(text):
            out[j] = None  # the text is not what these bytes decode to: no ends rather than wrong ones
    return out


def _last_bytes(np: Any, data: Any, stop: Any) -> Any:
    """Whether each byte is the last of a character, or of a stretch the decoder replaces by one
    U+FFFD, reading each turn's bytes (`stop`: where its turn ends) as Python's UTF-8 decoder does
    with ``errors="replace"``: a lead byte takes the continuation bytes its sequence allows (the
    second byte's range depends on the lead), up to the first one that does not fit, and that
    stretch is one character, whole or not; any byte no sequence took is one on its own."""
    n = data.size
    last = np.zeros(n, dtype=bool)
    if not n:
        return last
    follows = (data & 0xC0) == 0x80
    need = np.ones(n, dtype=np.int64)  # ASCII, C0, C1, F5..FF and continuation bytes: alone
    need[(data >= 0xC2) & (data <= 0xDF)] = 2
    need[(data >= 0xE0) & (data <= 0xEF)] = 3
    need[(data >= 0xF0) & (data <= 0xF4)] = 4
    # The second byte's range: 80..BF, except after E0 (A0..), ED (..9F), F0 (90..) and F4 (..8F).
    low = np.where(data == 0xE0, 0xA0, np.where(data == 0xF0, 0x90, 0x80))
    high = np.where(data == 0xED, 0x9F, np.where(data == 0xF4, 0x8F, 0xBF))
    leads = np.flatnonzero(need > 1)
    taken = np.ones(leads.size, dtype=np.int64)
    going = np.ones(leads.size, dtype=bool)
    for i in (1, 2, 3):
        at = leads + i
        inside = np.minimum(at, n - 1)
        fits = (data[inside] >= low[leads]) & (data[inside] <= high[leads]) if i == 1 else follows[inside]
        going &= (i < need[leads]) & (at < stop[leads]) & fits
        taken += going
    last[leads + taken - 1] = True
    alone = ~follows & (need == 1)
    taken_by_lead = np.zeros(n, dtype=bool)
    for i in (1, 2, 3):
        took = leads[taken > i] + i
        taken_by_lead[took] = True
    last |= alone | (follows & ~taken_by_lead)
    return last
