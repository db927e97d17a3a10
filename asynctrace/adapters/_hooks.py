"""What every framework hook shares: a batch is logged, or counted, and training never sees an error.

Whatever goes wrong while converting or queueing a batch is counted as dropped ("invalid"), with
one warning per hook (docs/adapters.md, "What every adapter does the same way").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._records.types import Sample
from .._security import logger
from .._sync import SyncTraceSession
from ..exceptions import RecordError, SessionClosedError

if TYPE_CHECKING:
    from .._session import TraceSession

__all__ = ["Converted", "count_invalid", "count_rows", "deliver", "every_row", "warn_once"]


Converted = tuple[Sequence[Sample], int]
"""What a hook's conversion returns: the samples, and how many rows it had to leave out."""


def every_row(
    convert: Callable[..., Sequence[Sample]], /, *args: Any, **kwargs: Any
) -> Callable[[], Converted]:
    """`convert(*args, **kwargs)` as a hook's conversion, for converters that leave no row out."""
    return lambda: (convert(*args, **kwargs), 0)


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(where: str, message: str) -> None:
    with _warned_lock:
        if where in _warned:
            return
        _warned.add(where)
    logger.warning("asynctrace: %s: %s; counted in session.stats().dropped['invalid']", where, message)


def count_rows(*columns: Callable[[], Any]) -> int | None:
    """The length of the first column that has one (or a count given as an int), each read by a
    call; None when none has.

    A hook counts a batch's rows before converting it, so that a batch it cannot convert is
    counted in full; reading one column only, a renamed field made it count 0 rows. Give the
    columns that hold one entry per row, most reliable first.
    """
    for column in columns:
        try:
            value = column()
            if value is None or isinstance(value, (str, bytes, bool)):
                continue
            if isinstance(value, int):
                return value
            shape = getattr(value, "shape", None)
            return int(shape[0]) if shape is not None and len(shape) else len(value)
        except Exception:  # a column this version does not have, or cannot size: try the next
            continue
    return None


def deliver(
    session: TraceSession | SyncTraceSession,
    convert: Callable[[], Converted],
    *,
    rows: int | None,
    step: int,
    split: str = "train",
    where: str,
    one_per_row: bool = True,
) -> int:
    """Convert one batch of `rows` rows and queue it; never raises. Returns the samples accepted.

    `rows` is None when the hook could not count them: a batch that then fails to convert
    counts as one row (at least one was lost), and the warning says its size is unknown.
    With `one_per_row` (each row becomes one sample unless the conversion reports it
    skipped), rows a conversion returned no sample for are counted too, never lost silently.
    The blocking form (`SyncTraceSession`) waits for room as its `on_full` says; an async
    session, called from the trainer's thread, is given the samples without waiting.
    """
    try:
        samples, skipped = convert()
    except Exception as exc:  # telemetry must never stop training
        size = "of unknown size (counted as 1 row)" if rows is None else f"of {rows} rows"
        warn_once(where, f"a batch {size} could not be converted ({type(exc).__name__}: {exc})")
        count_invalid(session, 1 if rows is None else rows)
        return 0
    if one_per_row and rows is not None and len(samples) + skipped < rows:
        skipped = rows - len(samples)
    if skipped:
        of = "" if rows is None else f" of {rows}"
        warn_once(where, f"{skipped}{of} rows could not be converted and were left out")
        count_invalid(session, skipped)
    try:
        if isinstance(session, SyncTraceSession):
            return session.log_samples(samples, step=step, split=split)
        return session.log_samples_nowait(samples, step=step, split=split)
    except SessionClosedError:
        # Finished under us (training outlived the session): counted as "closed", never raised.
        try:
            return int(session.log_samples_nowait(samples, step=step, split=split))
        except Exception:
            count_invalid(session, len(samples))
            return 0
    except (RecordError, ValueError, TypeError) as exc:
        warn_once(where, f"the session refused a batch of {len(samples)} samples ({exc})")
        count_invalid(session, len(samples))
        return 0


def count_invalid(session: Any, n: int) -> None:
    """Count `n` rows as dropped ("invalid") in `session`; never raises."""
    try:
        session.record_invalid(n)
    except Exception:  # a session in a state that cannot count: nothing more to do
        logger.debug("asynctrace: could not count %d invalid rows", n, exc_info=True)
