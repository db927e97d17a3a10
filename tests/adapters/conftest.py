from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

# Made before any test module imports AReaL (see LOGGING below), so the hooks' logger is the
# one the rest of the suite and pytest's caplog see.
import asynctrace.adapters  # noqa: F401
from asynctrace._security import logger
from tests.rollouts._helpers import tokenizer as tokenizer

LOGGING = (logging.Logger.manager, logging.Logger.root)
"""The logging module's manager and root before AReaL: `areal.utils.logging.getLogger` swaps
both for new ones (at import and on every call), detaching loggers made afterwards from the
root that caplog listens on. test_areal puts these back."""


@pytest.fixture
def hook_warnings() -> Iterator[list[str]]:
    """The warnings asynctrace's hooks log, read from their own logger (AReaL's `getLogger`
    detaches pytest's caplog from it, see LOGGING)."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Collect(logging.WARNING)
    # The logger asynctrace logs through at this moment (`logger.logger`: AReaL may have
    # replaced logging's manager, which makes a new one under the name).
    target = logger.logger
    target.addHandler(handler)
    try:
        yield seen
    finally:
        target.removeHandler(handler)


def moved(messages: list[str], where: str, tested: str, *missing: str) -> str:
    """The one message `where` gave about a framework that moved what it hooks: it names the
    version tested and each thing missing."""
    found = [m for m in messages if m.startswith(f"asynctrace: {where}:") and "does not fit" in m]
    assert len(found) == 1, messages
    assert tested in found[0] and all(name in found[0] for name in missing), found[0]
    return found[0]
