"""Per-token arrays kept with a sample (log-probs, loss mask, advantages, token ids, ...), encoded compactly.

Each array is held in the sample's JSON as ``{"dtype": "float32", "b64": "..."}``: base64 of the
little-endian array. A JSON list of float32 log-probs costs about 20 bytes a token (the shortest
decimal form of each value); this costs 5.4, keeps every value bit for bit, and is what the byte
bound counts (benchmarks/bench_token_fields.py measures both).
"""

from __future__ import annotations

import array
import base64
import binascii
import sys
from collections.abc import Mapping
from typing import Any

__all__ = [
    "TOKEN_FIELDS",
    "decode_token_fields",
    "encode_token_fields",
    "encoded",
    "raw_bytes",
    "token_bytes",
]

# The fields a sample may carry, each with the one dtype it is kept in. Floats are kept as float32,
# the dtype the frameworks compute log-probs in: float16 and bfloat16 widen to it exactly, a float64
# array is rounded to it once, here.
TOKEN_FIELDS: dict[str, str] = {
    "token_ids": "int32",
    "loss_mask": "int8",
    "logprobs": "float32",
    "advantages": "float32",
    # A second series of log-probs for the same tokens: the trainer's recomputation (beside the
    # rollout engine's `logprobs`: the training-inference mismatch) or a reference model's.
    "ref_logprobs": "float32",
    "entropy": "float32",
    # Where each token's text ends in the sample's messages joined (`rollouts/_text_ends.py`).
    "text_ends": "int32",
}
_TYPECODE = {"int32": "i", "int8": "b", "float32": "f"}
_NUMPY_DTYPE = {"int32": "<i4", "int8": "i1", "float32": "<f4"}
_RANGE = {"int32": (-(2**31), 2**31 - 1), "int8": (-128, 127)}
_ITEMSIZE = {"int32": 4, "int8": 1, "float32": 4}
_BIG_ENDIAN = sys.byteorder == "big"


def _module(value: Any) -> str:
    return type(value).__module__


def _check_range(name: str, dtype: str, low: Any, high: Any) -> None:
    lo, hi = _RANGE[dtype]
    if low < lo or high > hi:
        raise ValueError(f"{name}: values from {low} to {high} do not fit {dtype}")


def _from_tensor(name: str, dtype: str, value: Any) -> bytes:
    import torch

    if value.dim() != 1:
        raise ValueError(f"{name}: expected one value per token (1-D), got shape {tuple(value.shape)}")
    value = value.detach()
    if value.is_complex():
        # Converting would keep the real part alone, silently (numpy's complex is refused too).
        raise ValueError(f"{name}: expected real numbers, got a {value.dtype} tensor")
    if dtype in _RANGE:
        if value.is_floating_point():
            raise ValueError(f"{name}: expected integers, got a {value.dtype} tensor")
        if value.numel() and value.dtype != torch.bool:
            _check_range(name, dtype, int(value.min()), int(value.max()))
    target = {"int32": torch.int32, "int8": torch.int8, "float32": torch.float32}[dtype]
    return _from_ndarray(name, dtype, value.to("cpu", target).contiguous().numpy())


def _from_ndarray(name: str, dtype: str, value: Any) -> bytes:
    if value.ndim != 1:
        raise ValueError(f"{name}: expected one value per token (1-D), got shape {tuple(value.shape)}")
    kind = value.dtype.kind
    if dtype in _RANGE:
        if kind not in "iub":
            raise ValueError(f"{name}: expected integers, got an array of {value.dtype}")
        if value.size and kind != "b":
            _check_range(name, dtype, int(value.min()), int(value.max()))
    elif kind not in "iubf":
        raise ValueError(f"{name}: expected numbers, got an array of {value.dtype}")
    return bytes(value.astype(_NUMPY_DTYPE[dtype], copy=False).tobytes())


def _from_list(name: str, dtype: str, value: Any) -> bytes:
    try:
        packed = array.array(_TYPECODE[dtype], value)
    except OverflowError:
        raise ValueError(f"{name}: a value does not fit {dtype}") from None
    except TypeError:
        bad = next((v for v in value if not isinstance(v, (int, float))), None)
        what = type(bad).__name__ if bad is not None else "float"
        raise ValueError(
            f"{name}: expected {'integers' if dtype in _RANGE else 'numbers'}, got a {what}"
        ) from None
    if _BIG_ENDIAN:  # pragma: no cover - kept little-endian on every machine
        packed.byteswap()
    return packed.tobytes()


def _from_encoded(name: str, dtype: str, value: Mapping[str, Any]) -> bytes:
    if value.get("dtype") != dtype or not isinstance(value.get("b64"), str):
        raise ValueError(
            f"{name}: expected {{'dtype': {dtype!r}, 'b64': str}}, got dtype {value.get('dtype')!r}"
        )
    try:
        raw = base64.b64decode(value["b64"], validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{name}: b64 is not base64 ({exc})") from None
    if len(raw) % _ITEMSIZE[dtype]:
        raise ValueError(f"{name}: {len(raw)} bytes is not a whole number of {dtype} values")
    return raw


def raw_bytes(label: str, name: str, value: Any) -> bytes:
    """Field `name`'s values as little-endian bytes of its dtype; errors are named after `label`."""
    dtype = TOKEN_FIELDS.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"{name!r} is not a token field; expected one of {sorted(TOKEN_FIELDS)}")
    module = _module(value)
    if module.startswith("torch") and hasattr(value, "dim"):
        return _from_tensor(label, dtype, value)
    if module == "numpy" and hasattr(value, "ndim"):
        return _from_ndarray(label, dtype, value)
    if isinstance(value, Mapping):
        return _from_encoded(label, dtype, value)
    if isinstance(value, (list, tuple)):
        return _from_list(label, dtype, value)
    raise ValueError(f"{label}: expected a 1-D tensor, array or list, got {type(value).__name__}")


def encoded(dtype: str, raw: bytes) -> dict[str, str]:
    """The JSON form of a little-endian array of `dtype`."""
    return {"dtype": dtype, "b64": base64.b64encode(raw).decode("ascii")}


def encode_token_fields(tokens: Any) -> dict[str, dict[str, str]]:
    """`Sample.tokens` in its JSON form; a `ValueError` naming the field that is wrong."""
    if not isinstance(tokens, Mapping):
        raise ValueError(f"expected a dict of per-token arrays, got {type(tokens).__name__}")
    out: dict[str, dict[str, str]] = {}
    for name, value in tokens.items():
        out[name] = encoded(TOKEN_FIELDS.get(name, ""), raw_bytes(str(name), name, value))
    return out


def token_bytes(name: str, value: Mapping[str, Any]) -> bytes:
    """The little-endian bytes of one encoded field (as `encode_token_fields` wrote it)."""
    return _from_encoded(name, TOKEN_FIELDS[name], value)


def decode_token_fields(tokens: Mapping[str, Any]) -> dict[str, list[Any]]:
    """The encoded fields as lists of Python numbers (exact: a float32 is a Python float)."""
    out: dict[str, list[Any]] = {}
    for name, value in tokens.items():
        packed = array.array(_TYPECODE[TOKEN_FIELDS[name]])
        packed.frombytes(token_bytes(name, value))
        if _BIG_ENDIAN:  # pragma: no cover
            packed.byteswap()
        out[name] = packed.tolist()
    return out
