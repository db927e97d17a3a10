"""Trackio with its private bulk commit changed (as a later release's might be), so that
TrackioSink writes through Trackio's public API: in this process, or in the processes it starts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Holds a sitecustomize.py that changes `SQLiteStorage.bulk_log` as `change_bulk_log` does.
CHANGED = Path(__file__).resolve().parent / "trackio_changed"


def change_bulk_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """`SQLiteStorage.bulk_log` takes only ``*args, **kwargs`` from now on (until the test ends):
    Trackio's own calls still work, TrackioSink no longer recognises it."""
    from trackio.sqlite_storage import SQLiteStorage

    real = SQLiteStorage.bulk_log

    def changed(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **kwargs)

    monkeypatch.setattr(SQLiteStorage, "bulk_log", staticmethod(changed))


def changed_env() -> dict[str, str]:
    """This environment, with Trackio's bulk commit changed in every Python process started with it."""
    paths = [str(CHANGED), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def change_bulk_log_in_children(monkeypatch: pytest.MonkeyPatch) -> None:
    """The processes started from now on (until the test ends), a sink's writer among them, get
    Trackio's bulk commit changed."""
    monkeypatch.setenv("PYTHONPATH", changed_env()["PYTHONPATH"])
