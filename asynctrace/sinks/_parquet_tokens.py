"""ParquetSink's token fields: found in a payload's bytes and decoded, without decoding its JSON.

A payload with token fields ends ``,"tokens":{"<name>":{"dtype":"<dtype>","b64":"..."},...}}``, as
`_records.tokens.encode_token_fields` writes it. `token_spans` walks back from the payload's end
to where each field's base64 lies (single-byte searches over the base64, which holds no quote);
`Decoder` turns a field's base64 into its little-endian bytes, with SIMD where pybase64 is there.
"""

from __future__ import annotations

import binascii
from collections.abc import Callable
from typing import Any

from .._records.tokens import TOKEN_FIELDS

__all__ = ["TOKENS_KEY", "Decoder", "token_spans"]

TOKENS_KEY = b',"tokens":{'
_ITEMSIZE = {"int32": 4, "int8": 1, "float32": 4}
# What precedes each field's base64: its key, and its dtype, the one the field is kept in.
_HEADERS = [
    (name, b'"%s":{"dtype":"%s","b64":"' % (name.encode(), dtype.encode()))
    for name, dtype in TOKEN_FIELDS.items()
]
_QUOTE, _COMMA, _BRACE = ord('"'), ord(","), ord("}")


def token_spans(chunk: bytes, start: int, close: int) -> tuple[int, dict[str, tuple[int, int]]] | None:
    """The token fields of the payload from `start` to its closing brace at `close`: where its
    ``,"tokens":{`` key begins, and each field's base64 (from, to); None where the payload does not
    end in token fields of that exact form (its tokens are then decoded with its JSON).

    The walk is structural: a JSON string holds no unescaped quote, so the quotes and braces
    matched here are the payload's own, and the object they close is its last member's value.
    """
    fields: dict[str, tuple[int, int]] = {}
    # Backwards from the payload's close: `}` of the tokens object, then each field's `"}`.
    if chunk[close - 1] != _BRACE:
        return None
    end = close - 1  # the byte after the last field's object
    while True:
        if end - 2 <= start or chunk[end - 1] != _BRACE or chunk[end - 2] != _QUOTE:
            return None
        last = end - 2  # the base64's closing quote
        first = chunk.rfind(b'"', start, last) + 1
        if first <= 0:
            return None
        name, header = next(((n, h) for n, h in _HEADERS if chunk.endswith(h, start, first)), ("", b""))
        if not name or name in fields:
            return None
        fields[name] = (first, last)
        head = first - len(header)
        if chunk[head - 1] == _COMMA:
            end = head - 1
            continue
        if chunk.endswith(TOKENS_KEY, start, head):
            return head - len(TOKENS_KEY), fields
        return None


def _decoder() -> tuple[str, Callable[[Any], bytes]]:
    try:
        import pybase64
    except ImportError:
        return "binascii", lambda data: binascii.a2b_base64(data, strict_mode=True)

    def decode(data: Any) -> bytes:
        return pybase64.b64decode(data, validate=True)

    return "pybase64", decode


class Decoder:
    """Base64 to a field's bytes; None where it is not base64 of whole values of its dtype (the
    exact way then names what is wrong). `name`: the module that decodes."""

    def __init__(self) -> None:
        self.name, self._decode = _decoder()

    def field(self, name: str, data: Any) -> bytes | None:
        try:
            raw = self._decode(data)
        except (binascii.Error, ValueError):
            return None
        if len(raw) % _ITEMSIZE[TOKEN_FIELDS[name]]:
            return None
        return raw
