"""Helpers shared by the tests."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asynctrace as at


def read_traces(project: str, run: str) -> list[dict[str, Any]]:
    """Every trace of a run, read back from Trackio's own storage."""
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_traces(project, run=run, sort="step_asc")


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
