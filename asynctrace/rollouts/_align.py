"""Optional per-sample columns that may be shorter than the batch: pick what is there, warn once."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Final

__all__ = ["MISSING", "Shortfall"]


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final[Any] = _Missing()
"""Stands for a value an optional column does not have (distinct from an explicit None)."""


class Shortfall:
    """Collects the optional columns that were too short for the batch; one warning per call.

    Frameworks are known to hand over optional lists shorter than the batch. Telemetry must
    never crash training over that, so the missing values are left out and the caller is
    told once, not once per sample.
    """

    __slots__ = ("_short", "_where", "n_samples")

    def __init__(self, where: str, n_samples: int) -> None:
        self._where = where
        self.n_samples = n_samples
        """The batch size the columns are checked against (settable: one call may span batches)."""
        self._short: dict[str, tuple[int, int]] = {}

    def note(self, name: str, have: int) -> None:
        """Record that column `name` holds only `have` values."""
        self._short.setdefault(name, (have, self.n_samples))

    def pick(self, column: Sequence[Any] | None, index: int, name: str) -> Any:
        """`column[index]`, or MISSING when the column is absent or too short (noted).

        An empty column counts as absent: frameworks default optional lists to `[]`.
        """
        if column is None or not len(column):
            return MISSING
        if index < len(column):
            return column[index]
        self.note(name, len(column))
        return MISSING

    def warn(self, stacklevel: int = 3) -> None:
        """Issue the one warning of this call, if any column fell short."""
        if not self._short:
            return
        parts = ", ".join(
            f"{name} has {have} value{'' if have == 1 else 's'} for {need} samples"
            for name, (have, need) in self._short.items()
        )
        warnings.warn(
            f"{self._where}: {parts}; the field is left out of the samples it does not reach",
            UserWarning,
            stacklevel=stacklevel,
        )
