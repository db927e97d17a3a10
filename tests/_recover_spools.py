"""Spools for the recovery tests: records left by a session whose sink never answered, and the
setup file of that session rewritten to name the sinks a test wants (as a copied or edited
spool directory would)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import orjson

import asynctrace as at
from tests._util import sample


def leave(spool: Path, run: str = "r", n: int = 5, project: str = "p") -> str:
    """Leave `n` unacknowledged records of (project, run) in `spool`; returns the session's id."""
    before = set(spool.glob("setup-*.json"))
    with at.TraceSession(
        project,
        run=run,
        sinks=[at.testing.MemorySink(hang=True)],
        spool_dir=spool,
        durability="enqueue",
        finish_timeout=0.2,
    ) as s:
        s.log_samples([sample(i, run=run) for i in range(n)], step=0)
    (path,) = set(spool.glob("setup-*.json")) - before
    return path.name[len("setup-") : -len(".json")]


def set_sinks(spool: Path, session: str, sinks: list[Any], **fields: Any) -> Path:
    """Rewrite `session`'s setup file to name `sinks` (and any other `fields`)."""
    path = spool / f"setup-{session}.json"
    data = orjson.loads(path.read_bytes())
    data.update(sinks=sinks, **fields)
    path.write_bytes(orjson.dumps(data))
    return path


def jsonl(path: Path, name: str = "jsonl") -> dict[str, Any]:
    """A setup's description of a `JsonlSink` writing to `path`."""
    return {"name": name, "kind": "jsonl", "args": {"path": str(path), "rotate_every": None, "fsync": False}}


def uids(path: Path) -> collections.Counter[str]:
    """How many times each record (by run and uid) is in a JSONL file."""
    if not path.exists():
        return collections.Counter()
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    metadata = [line["sample"]["metadata"] for line in lines if "sample" in line]
    return collections.Counter(f"{m['run']}/{m['uid']}" for m in metadata)
