"""Exact fast decoding for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen style).

A `ByteLevel` decoder works in three steps: each id becomes its token string (added tokens
first; unknown ids are dropped), each token becomes bytes (one byte per character of a byte-level
token, UTF-8 for any other token, such as an added `"<think>\\n"`), and the sequence's bytes
become text, with every invalid UTF-8 stretch as U+FFFD (Python's `errors="replace"`).

The first two steps depend on the id alone, so a table id -> bytes, built once per tokenizer,
reproduces the decoder exactly at a fraction of its cost. It is used only for a decoder that is
exactly `ByteLevel`, after a self-check: a few hundred random sequences (added tokens and bytes
that split characters included) must decode the same both ways, or the tokenizer keeps its own
decode for good. Ids the table cannot answer exactly go to the tokenizer too.
"""

from __future__ import annotations

import random
import re
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["ByteTable", "TokenBytes", "byte_table", "char_bytes"]

_CHUNK = 1 << 18
"""Tokens gathered per step in `decode_spans`, which bounds its scratch memory (~10 MB)."""


def char_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character that stands for each byte -> the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class TokenBytes(NamedTuple):
    """Tokens' bytes one after another (`raw`), and where each token's end (`ends`, numpy int64)."""

    raw: bytes
    ends: Any


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with the dev and torch setups
        return None
    return numpy


class ByteTable:
    """Token id -> the bytes the ByteLevel decoder writes for it; decodes sequences exactly.

    `check` holds sequences and the tokenizer's text for them: the numpy decoder must give the
    same text on its first use, or it stays off (numpy is only imported when spans are decoded).
    """

    __slots__ = ("_arrays", "_check", "_spans_ok", "pieces")

    def __init__(self, pieces: list[bytes], check: tuple[list[list[int]], list[str]] | None = None) -> None:
        self.pieces = pieces
        """`pieces[i]`: the bytes of id `i` (empty for an id no token has: decode drops it)."""
        self._check = check
        self._spans_ok: bool | None = None
        self._arrays: tuple[Any, Any, Any] | None = None

    def decode(self, sequences: Sequence[Sequence[int]]) -> list[str] | None:
        """Each sequence's text, as the tokenizer writes it; None if some id needs the tokenizer."""
        get = self.pieces.__getitem__
        out: list[str] = []
        try:
            for seq in sequences:
                # A negative index would wrap around here, where the tokenizer rejects it.
                if seq and min(seq) < 0:
                    return None
                out.append(b"".join(map(get, seq)).decode("utf-8", "replace"))
        except (IndexError, TypeError, ValueError):
            return None
        return out

    def _numpy_arrays(self, np: Any) -> tuple[Any, Any, Any]:
        if self._arrays is None:
            lengths = np.fromiter(map(len, self.pieces), dtype=np.int64, count=len(self.pieces))
            starts = np.zeros_like(lengths)
            if len(lengths) > 1:
                np.cumsum(lengths[:-1], out=starts[1:])
            blob = np.frombuffer(b"".join(self.pieces) or b"\0", dtype=np.uint8)
            self._arrays = (lengths, starts, blob)
        return self._arrays

    def decode_spans(self, flat: Any, bounds: Sequence[int]) -> list[str] | None:
        """The text of each span `flat[bounds[2k]:bounds[2k+1]]`, vectorised with numpy.

        `flat` is a 1-D integer array (a CPU tensor or a numpy array) holding every span's ids.
        None when numpy is missing or some id is out of the table: the caller falls back.
        """
        np = _numpy()
        ids = self._ids(np, flat)
        if ids is None:
            return None
        if not ids.size:
            return [""] * (len(bounds) // 2)
        return self._spans(np, ids, bounds)

    def token_bytes(self, flat: Any) -> TokenBytes | None:
        """The bytes of the tokens of `flat` (a 1-D integer array) one after another, and where
        each token's bytes end in them; None where `decode_spans` would be (the caller then has
        no bytes to go by)."""
        np = _numpy()
        ids = self._ids(np, flat)
        if ids is None:
            return None
        lengths, starts, blob = self._numpy_arrays(np)
        size = lengths.take(ids)
        ends = np.cumsum(size)
        # Ids with no token add no bytes (the tokenizer drops them): `_gather` takes the others.
        keep = size > 0
        first, part, sums = starts.take(ids[keep]), size[keep], ends[keep]
        raw = b"".join(
            _gather(np, blob, first[a : a + _CHUNK], part[a : a + _CHUNK], sums[a : a + _CHUNK])
            for a in range(0, int(part.size), _CHUNK)
        )
        return TokenBytes(raw, ends)

    def _ids(self, np: Any, flat: Any) -> Any:
        """`flat` as a 1-D numpy integer array of ids the table holds, once the numpy decoder
        passed its check; None when it cannot be."""
        if np is None:
            return None
        if self._spans_ok is None:
            self._spans_ok = self._check_spans(np)
        if not self._spans_ok:
            return None
        try:
            ids = flat.numpy() if hasattr(flat, "numpy") else np.asarray(flat)
        except (RuntimeError, TypeError, ValueError):
            return None
        if ids.ndim != 1:
            return None
        if not ids.size:
            return ids.astype(np.int64)
        if ids.dtype.kind not in "iu" or int(ids.min()) < 0 or int(ids.max()) >= len(self.pieces):
            return None
        return ids

    def _spans(self, np: Any, ids: Any, bounds: Sequence[int]) -> list[str]:
        lengths, starts, blob = self._numpy_arrays(np)
        size = lengths.take(ids)
        # ends[i]: where the bytes of token i end in the bytes of the whole array.
        ends = np.cumsum(size)
        offsets = np.concatenate((np.zeros(1, dtype=ends.dtype), ends))
        if not bool(size.all()):
            # Ids with no token add no bytes (the tokenizer drops them); leave them out.
            keep = size > 0
            ids, size = ids[keep], size[keep]
            ends = np.cumsum(size)
        first = starts.take(ids)
        raw = b"".join(
            _gather(np, blob, first[a : a + _CHUNK], size[a : a + _CHUNK], ends[a : a + _CHUNK])
            for a in range(0, ids.size, _CHUNK)
        )
        edges = offsets.take(np.asarray(bounds, dtype=np.intp)).tolist() if len(bounds) else []
        return [raw[edges[k] : edges[k + 1]].decode("utf-8", "replace") for k in range(0, len(edges), 2)]

    def _check_spans(self, np: Any) -> bool:
        if self._check is None:
            return True
        seqs, expected = self._check
        flat = [i for seq in seqs for i in seq]
        bounds: list[int] = []
        position = 0
        for seq in seqs:
            bounds += (position, position + len(seq))
            position += len(seq)
        return bool(self._spans(np, np.asarray(flat, dtype=np.int64), bounds) == expected)


def _gather(np: Any, blob: Any, first: Any, size: Any, ends: Any) -> bytes:
    """The bytes `blob[first[i] : first[i] + size[i]]` of every token i, joined.

    `size` is positive and `ends` its running sum (from any base). Byte positions in `blob` go
    up by one inside a token and jump at the first byte of the next: a running sum of ones
    with those jumps gives every position at once.
    """
    if not size.size:
        return b""
    ends = ends - (ends[0] - size[0])
    src = np.ones(int(ends[-1]), dtype=np.intp)
    src[0] = first[0]
    src[ends[:-1]] = first[1:] - (first[:-1] + size[:-1] - 1)
    np.cumsum(src, out=src)
    return bytes(blob.take(src).tobytes())


def _backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` doing the work: the tokenizer itself, or a wrapper's backend."""
    tk = sys.modules.get("tokenizers")
    if tk is None:
        # Without the package imported there can be no `tokenizers.Tokenizer`.
        return None
    if isinstance(tokenizer, tk.Tokenizer):
        return tokenizer
    try:
        inner = getattr(tokenizer, "backend_tokenizer", None)
    except Exception:  # a property that fails: not a tokenizer we can reason about
        return None
    return inner if isinstance(inner, tk.Tokenizer) else None


def _is_byte_level(backend: Any) -> bool:
    tk = sys.modules["tokenizers"]
    # Exact type: a Sequence, a custom Python decoder or any other decoder wraps differently.
    return type(backend.decoder) is tk.decoders.ByteLevel


def _build_pieces(backend: Any) -> list[bytes]:
    vocab = backend.get_vocab(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    size = max([*vocab.values(), *added.keys(), -1]) + 1
    mapping = char_bytes()
    to_latin1 = str.maketrans({c: chr(b) for c, b in mapping.items()})
    other = re.compile("[^" + re.escape("".join(mapping)) + "]")
    pieces: list[bytes] = []
    for i in range(size):
        # id_to_token looks ids up as decode does: added tokens first, then the model.
        token = backend.id_to_token(i)
        if token is None:
            pieces.append(b"")
        elif other.search(token):
            # A character that stands for no byte: the decoder keeps the token's UTF-8 as it is.
            pieces.append(token.encode("utf-8"))
        else:
            pieces.append(token.translate(to_latin1).encode("latin-1"))
    return pieces


def _check_sequences(pieces: list[bytes], special: list[int], seed: int = 0x5EED) -> list[list[int]]:
    """Id sequences that exercise what can go wrong: added tokens, split and broken characters."""
    rng = random.Random(seed)
    size = len(pieces)
    # Ids whose bytes are not valid UTF-8 on their own: lone bytes of multi-byte characters.
    partial: list[int] = []
    single: dict[int, int] = {}
    for i, piece in enumerate(pieces):
        if len(piece) == 1 and piece[0] not in single:
            single[piece[0]] = i
        try:
            piece.decode("utf-8")
        except UnicodeDecodeError:
            partial.append(i)
    pools: list[Sequence[int]] = [range(size)]
    pools += [p for p in (special, partial) if p]
    seqs: list[list[int]] = [[], *([i] for i in special)]
    for _ in range(300):
        length = rng.randrange(1, 40)
        seqs.append([rng.choice(rng.choice(pools)) for _ in range(length)])
    # Characters split byte by byte, whole and cut short, between ordinary tokens.
    text = "é 你好 🙂 naïve Straße \u0800\uffff\U0010ffff"
    data = text.encode("utf-8")
    if all(b in single for b in data):
        ids = [single[b] for b in data]
        seqs.append(ids)
        for _ in range(60):
            cut = sorted(rng.sample(range(len(ids) + 1), 2))
            seqs.append(ids[: cut[0]] + ids[cut[1] :])
            seqs.append([rng.randrange(size), *ids[cut[0] : cut[1]], rng.randrange(size)])
    # Every lone byte, between the bytes of a complete character.
    whole = "é".encode()
    if all(b in single for b in whole):
        seqs += [[single[b], *(single[x] for x in whole), single[b]] for b in single]
    return seqs


def _checked_table(
    pieces: list[bytes], reference: Callable[[list[list[int]]], list[str]], special: list[int]
) -> ByteTable | None:
    """The table, if it decodes the check sequences exactly as `reference` does; else None."""
    seqs = _check_sequences(pieces, special)
    try:
        expected = reference(seqs)
    except Exception:  # the tokenizer cannot decode its own ids: leave it to itself
        return None
    table = ByteTable(pieces, (seqs, expected))
    return table if table.decode(seqs) == expected else None


@dataclass(slots=True, eq=False)
class _Entry:
    fingerprint: int
    table: ByteTable | None
    owner: Any = None


_CACHE: weakref.WeakKeyDictionary[Any, _Entry] = weakref.WeakKeyDictionary()
_STRONG: dict[int, _Entry] = {}
"""Tokenizers that take no weak reference, by id; each entry holds its tokenizer, so the id stays its own."""
_STRONG_MAX = 8


def _lookup(tokenizer: Any) -> _Entry | None:
    try:
        return _CACHE.get(tokenizer)
    except TypeError:
        entry = _STRONG.get(id(tokenizer))
        return entry if entry is not None and entry.owner is tokenizer else None


def _store(tokenizer: Any, entry: _Entry) -> None:
    try:
        _CACHE[tokenizer] = entry
    except TypeError:
        entry.owner = tokenizer
        if len(_STRONG) >= _STRONG_MAX:
            _STRONG.pop(next(iter(_STRONG)))
        _STRONG[id(tokenizer)] = entry


def byte_table(tokenizer: Any, reference: Callable[[list[list[int]]], list[str]]) -> ByteTable | None:
    """The exact byte table of `tokenizer`, or None when its own decode must be used.

    `reference` decodes sequences the way the caller would without the table (the tokenizer's
    batch decode with the caller's options); the table must agree with it on the self-check.
    Tables are cached per tokenizer and rebuilt when its vocabulary grows (tokens added).
    """
    backend = _backend(tokenizer)
    if backend is None or not _is_byte_level(backend):
        return None
    # Adding tokens is what changes a tokenizer's decoding in practice; it changes the size.
    fingerprint = int(backend.get_vocab_size(with_added_tokens=True))
    entry = _lookup(tokenizer)
    if entry is not None and entry.fingerprint == fingerprint:
        return entry.table
    table = _checked_table(_build_pieces(backend), reference, sorted(backend.get_added_tokens_decoder()))
    _store(tokenizer, _Entry(fingerprint, table))
    return table
