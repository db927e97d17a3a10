"""What every adapter needs: read a field by name from a dict or an object, and tidy values."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

from .._records.tokens import decode_token_fields
from .._records.types import Sample
from ..rollouts._mapping import field
from ..rollouts._text import TextBatch

__all__ = [
    "Message",
    "SampleBuilder",
    "as_sequence",
    "chat_messages",
    "field",
    "jsonable",
    "plain_tokens",
    "role_name",
    "token_list",
]


def as_sequence(value: Any, name: str) -> Sequence[Any]:
    """A required per-sample column as a sequence (tensors and arrays become lists)."""
    if value is None:
        raise ValueError(f"{name}: is required")
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ValueError(f"{name}: expected a sequence, got {type(value).__name__}")
    return value


def token_list(value: Any) -> list[int]:
    """Token ids from a list, a tuple, a 1-D tensor or an array."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [int(t) for t in value]


def plain_tokens(samples: list[Sample]) -> list[Sample]:
    """The samples with their token fields as plain lists of numbers, as every adapter's
    `to_samples` returns them; a field still in its compact JSON form (``{"dtype", "b64"}``, as
    `decode_rollouts` keeps it for a hook, which hands it on as it is) is decoded, exactly."""
    for sample in samples:
        if sample.tokens:
            sample.tokens = {
                name: decode_token_fields({name: value})[name] if isinstance(value, Mapping) else value
                for name, value in sample.tokens.items()
            }
    return samples


def role_name(role: Any) -> str:
    """A role as a plain string (frameworks use enums such as `Role.USER`)."""
    if isinstance(role, enum.Enum):
        role = role.value
    return str(role)


def jsonable(value: Any) -> Any:
    """`value` if it is plain JSON data (scalars, lists, str-keyed dicts), else its `str()`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return jsonable(value.tolist())
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: jsonable(v) for k, v in value.items()}
    return str(value)


def chat_messages(value: Any, role: str, name: str) -> list[dict[str, Any]]:
    """A string as one message of `role`, a conversation as fresh copies of its messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, Sequence):
        raise ValueError(f"{name}: expected a string or a list of messages, got {type(value).__name__}")
    out = []
    for j, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise ValueError(f"{name}[{j}]: expected a message (a dict), got {type(message).__name__}")
        copy = {str(k): jsonable(v) for k, v in dict(message).items()}
        copy["role"] = role_name(message.get("role", role))
        out.append(copy)
    return out


Message = dict[str, Any] | tuple[str, int]
"""A ready message, or `(role, handle)` whose text comes from the builder's one decode call."""


class SampleBuilder:
    """Collects samples whose text is partly still tokens, then decodes all of it in one call."""

    __slots__ = ("_pending", "texts")

    def __init__(self) -> None:
        self.texts = TextBatch()
        self._pending: list[tuple[list[Message], dict[str, Any]]] = []

    def add(self, messages: list[Message], metadata: dict[str, Any]) -> None:
        """Queue one sample."""
        self._pending.append((messages, metadata))

    def build(self, tokenizer: Any, where: str) -> list[Sample]:
        """Decode every queued token sequence at once and return the samples in order."""
        if len(self.texts) and tokenizer is None:
            raise ValueError(f"tokenizer: {where} needs one to decode token ids (no text was given)")
        decoded = self.texts.decode(tokenizer) if len(self.texts) else []
        return [
            Sample(
                messages=[
                    m if isinstance(m, dict) else {"role": m[0], "content": decoded[m[1]]} for m in messages
                ],
                metadata=metadata,
            )
            for messages, metadata in self._pending
        ]
