"""Per-token arrays of a batch, kept with each decoded sample (``decode_rollouts(token_fields=...)``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._records.tokens import TOKEN_FIELDS, encoded, raw_bytes
from ._rows import as_tensor, python_rows, real_tokens

__all__ = ["token_columns"]

_ITEMSIZE = {"int32": 4, "int8": 1, "float32": 4}


def _check_names(token_fields: Mapping[str, Any]) -> None:
    if not isinstance(token_fields, Mapping):
        raise ValueError(
            f"token_fields: expected a dict of per-token arrays, got {type(token_fields).__name__}"
        )
    for name in token_fields:
        if name not in TOKEN_FIELDS:
            raise ValueError(
                f"token_fields: {name!r} is not a token field; expected one of {sorted(TOKEN_FIELDS)}"
            )


def _tensor_columns(
    token_fields: Mapping[str, Any], input_ids: Any, attention_mask: Any, picked: list[int]
) -> list[dict[str, dict[str, str]]]:
    import torch

    shape = tuple(input_ids.shape)
    device = input_ids.device
    index = torch.as_tensor(picked, dtype=torch.long, device=device)

    def select(value: Any, name: str) -> Any:
        if not isinstance(value, torch.Tensor):
            value = as_tensor(value, name)
        if tuple(value.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)} does not match input_ids {shape}")
        return value.index_select(0, index.to(value.device)).to(device)

    valid = select(attention_mask, "attention_mask") != 0 if attention_mask is not None else None
    lengths = valid.sum(dim=1).tolist() if valid is not None else [shape[1]] * len(picked)
    rows: list[dict[str, dict[str, str]]] = [{} for _ in picked]
    for name, value in token_fields.items():
        chosen = select(value, f"token_fields[{name!r}]")
        flat = chosen.masked_select(valid) if valid is not None else chosen.reshape(-1)
        # One conversion and one transfer for the whole batch; rows are slices of its bytes.
        raw = raw_bytes(f"token_fields[{name!r}]", name, flat)
        dtype = TOKEN_FIELDS[name]
        size = _ITEMSIZE[dtype]
        at = 0
        for j, length in enumerate(lengths):
            rows[j][name] = encoded(dtype, raw[at : at + length * size])
            at += length * size
    return rows


def _list_columns(
    token_fields: Mapping[str, Any], input_ids: Any, attention_mask: Any, picked: list[int]
) -> list[dict[str, dict[str, str]]]:
    n = len(input_ids)
    ids = python_rows(input_ids, picked, "input_ids", n)
    keep = python_rows(attention_mask, picked, "attention_mask", n) if attention_mask is not None else None
    rows: list[dict[str, dict[str, str]]] = [{} for _ in picked]
    for name, value in token_fields.items():
        label = f"token_fields[{name!r}]"
        values = python_rows(value, picked, label, n, ids)
        if keep is not None:
            values = real_tokens(values, keep)
        for j, row in enumerate(values):
            rows[j][name] = encoded(TOKEN_FIELDS[name], raw_bytes(label, name, row))
    return rows


def token_columns(
    token_fields: Mapping[str, Any], input_ids: Any, attention_mask: Any, picked: list[int], tensor: bool
) -> list[dict[str, dict[str, str]]]:
    """Each selected row's per-token arrays, over its real tokens (where `attention_mask` is set)."""
    _check_names(token_fields)
    if tensor:
        return _tensor_columns(token_fields, input_ids, attention_mask, picked)
    return _list_columns(token_fields, input_ids, attention_mask, picked)
