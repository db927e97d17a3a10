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

__all__ = ["Converted", "count_invalid", "deliver", "every_row", "warn_once"]


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


def deliver(
    session: TraceSession | SyncTraceSession,
    convert: Callable[[], Converted],
    *,
    rows: int,
    step: int,
    split: str = "train",
    where: str,
) -> int:
    """Convert one batch of `rows` rows and queue it; never raises. Returns the samples accepted.

    The blocking form (`SyncTraceSession`) waits for room as its `on_full` says; an async
    session, called from the trainer's thread, is given the samples without waiting.
    """
    try:
        samples, skipped = convert()
    except Exception as exc:  # telemetry must never stop training
        warn_once(where, f"a batch of {rows} rows could not be converted ({type(exc).__name__}: {exc})")
        count_invalid(session, rows)
        return 0
    if skipped:
        warn_once(where, f"{skipped} of {rows} rows could not be converted and were left out")
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
