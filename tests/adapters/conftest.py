from __future__ import annotations

import logging

# Made before any test module imports AReaL (see LOGGING below), so the hooks' logger is the
# one the rest of the suite and pytest's caplog see.
import asynctrace.adapters  # noqa: F401
from tests.rollouts._helpers import tokenizer as tokenizer

LOGGING = (logging.Logger.manager, logging.Logger.root)
"""The logging module's manager and root before AReaL: `areal.utils.logging.getLogger` swaps
both for new ones (at import and on every call), detaching loggers made afterwards from the
root that caplog listens on. test_areal puts these back."""
