"""Helpers shared by the tests."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asynctrace as at


class LazyModule:
    """A module imported at the first read of one of its public attributes.

    A framework's import takes seconds and every xdist worker collects every test module:
    through this, it runs only in the worker that runs a test using it. Private names are not
    looked up: pytest's collection reads `_mock_name`, `__wrapped__` and the like on every
    module-level object, which would import the module at collection (importlib's LazyLoader
    imports on any attribute)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        return getattr(importlib.import_module(self._name), attribute)


def read_traces(project: str, run: str) -> list[dict[str, Any]]:
    """Every trace of a run, read back from Trackio's own storage."""
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_traces(project, run=run, sort="step_asc")


def as_logged(metadata: dict[str, Any]) -> dict[str, Any]:
    """A Trackio trace's metadata as the sample carried it: without the keys the Trackio sink
    adds for the dashboard (`asynctrace_id`, and `status` / `duration_ms` it derived)."""
    from asynctrace.sinks._trackio_traces import dashboard_metadata

    record_id = metadata.get("asynctrace_id")
    base = {k: v for k, v in metadata.items() if k != "asynctrace_id"}
    for derived in (("status", "duration_ms"), ("status",), ("duration_ms",), ()):
        candidate = {k: v for k, v in base.items() if k not in derived}
        if dashboard_metadata(str(record_id), candidate) == metadata:
            return candidate
    return base


def sample(i: int, *, reward: float | None = None, step: int = 0, **meta: Any) -> dict[str, Any]:
    """A small valid sample whose content identifies it."""
    return {
        "prompt": f"question {i} of step {step}",
        "response": f"answer {i}",
        "reward": float(i) if reward is None else reward,
        "uid": f"{step}:{i}",
        **meta,
    }


def stuck_spool_session(spool: Path, project: str = "p") -> at.TraceSession:
    """A session that spools on admission and whose only sink never answers: what it logs stays
    unacknowledged in `spool`."""
    import asynctrace as at

    return at.TraceSession(
        project,
        run="r",
        sinks=[at.testing.MemorySink(hang=True)],
        spool_dir=spool,
        durability="enqueue",
        finish_timeout=0.2,
    )
