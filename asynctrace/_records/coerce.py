"""How a value that is not JSON already is written in a payload: one rule, for the encoder and
for anything that must read a value as the payload will hold it (a prompt group's name)."""

from __future__ import annotations

import os
from typing import Any

import orjson

__all__ = ["DUMPS_OPTIONS", "coerce", "json_form"]

DUMPS_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def coerce(obj: Any) -> Any:
    """orjson `default`: coerce values whose JSON meaning is unambiguous; refuse everything else."""
    module = type(obj).__module__
    if module == "numpy":
        if getattr(obj, "ndim", None) == 0:
            # orjson writes numpy arrays and scalars, but not a 0-d array (what np.asarray(x)
            # or a reduction with keepdims gives): it is a scalar, as a 0-d torch tensor is.
            value = obj.item()
            if isinstance(value, complex) or getattr(getattr(obj, "dtype", None), "kind", "") == "c":
                raise TypeError(f"complex number {value!r} has no JSON form")
            if type(value).__module__ == "numpy":  # longdouble: no Python type holds it
                return float(value)
            return value
        tolist = getattr(obj, "tolist", None)
        if callable(tolist):
            # orjson writes C-contiguous arrays of native types only: a column view, a
            # transposed or a longdouble array arrives here.
            return tolist()
    if module.startswith("torch"):
        dim = getattr(obj, "dim", None)
        if callable(dim) and dim() == 0:
            return obj.item()
        if callable(dim):
            raise TypeError(
                f"torch tensor of shape {tuple(obj.shape)} is not a scalar; convert it with .tolist()"
            )
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, (set, frozenset)):
        raise TypeError(f"{type(obj).__name__} has no order; pass a list")
    raise TypeError(f"Type is not JSON serializable: {type(obj).__name__}")


def json_form(value: Any) -> Any:
    """`value` as it reads back from a payload (a torch or numpy scalar as its number, an enum as
    its value, a tuple as a list); `TypeError` when it cannot be encoded."""
    return orjson.loads(orjson.dumps(value, default=coerce, option=DUMPS_OPTIONS))
