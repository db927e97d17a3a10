"""Rows of token data as plain Python, shared by the decoder and the per-token columns."""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["as_python", "as_tensor", "check_rows", "is_tensor", "python_rows", "real_tokens"]


def is_tensor(value: Any) -> bool:
    # A tensor can only exist once torch is imported, so looking it up never imports it.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def as_tensor(value: Any, name: str) -> Any:
    """`value` (a numpy array, a list) as a tensor, on its memory where it can; a ValueError naming
    `name` where it cannot be read as one."""
    import torch

    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name}: cannot be read as a tensor ({exc})") from None


def as_python(value: Any) -> Any:
    """numpy arrays (anything with `tolist` that is not a tensor) become lists; the rest is kept."""
    if not is_tensor(value) and hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    return value


def check_rows(rows: Sequence[int] | None, n: int) -> list[int]:
    """The row numbers `rows` picks (every row when None), each checked against `n`."""
    if rows is None:
        return list(range(n))
    if hasattr(rows, "tolist"):
        rows = rows.tolist()
    picked: list[int] = []
    for item in rows:
        # An int, or an integer scalar such as numpy's; a bool is not a row number.
        if isinstance(item, bool) or not hasattr(item, "__index__"):
            raise ValueError(f"rows: expected ints, got {type(item).__name__}")
        row = operator.index(item)
        if not 0 <= row < n:
            raise ValueError(f"rows: {row} is out of range for {n} samples")
        picked.append(row)
    return picked


def python_rows(
    value: Any, picked: list[int], name: str, n: int, ids: list[list[Any]] | None = None
) -> list[list[Any]]:
    """The `picked` rows of a list-like `value` as Python lists, checked against `n` rows (and,
    given the picked rows of `ids`, each against its row's number of tokens)."""
    value = as_python(value)
    if is_tensor(value):
        raise ValueError(
            f"{name}: input_ids is a list, so {name} must be a list too (or use tensors for all)"
        )
    if len(value) != n:
        raise ValueError(f"{name}: has {len(value)} rows but input_ids has {n}")
    rows = [list(as_python(value[r])) for r in picked]
    for j, (row, tokens) in enumerate(zip(rows, ids or (), strict=False)):
        if len(row) != len(tokens):
            raise ValueError(
                f"{name}: row {picked[j]} has {len(row)} values but input_ids has {len(tokens)} tokens"
            )
    return rows


def real_tokens(rows: list[list[Any]], attention: list[list[Any]]) -> list[list[Any]]:
    """The values of each row where the attention mask is set."""
    return [
        [x for x, m in zip(row, mask, strict=True) if m] for row, mask in zip(rows, attention, strict=True)
    ]
