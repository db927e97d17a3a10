"""The session's sinks, remembered in the spool directory for `asynctrace recover`.

Each session with a spool writes ``setup-<session>.json`` when it opens: its project, run and
a spec of each sink (see `asynctrace.sinks._spec`: classes and non-secret arguments), scrubbed
of any credential the environment holds. Segment headers name the session, so recover knows
which sinks each record was meant for. The file goes when its session finished with nothing
of its own left in the spool, or when recover delivered everything of it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from .._security import describe, logger, scrub_bytes, secret_bytes

__all__ = ["Setup", "read_setups", "remove_setup", "write_setup"]

PREFIX = "setup-"
SUFFIX = ".json"
VERSION = 1


@dataclass(frozen=True, slots=True)
class Setup:
    """What one session's setup file says."""

    session: str
    project: str
    run: str
    sinks: list[dict[str, Any]]
    path: Path

    @property
    def key(self) -> bytes:
        """Equal for sessions whose sinks are alike (then replayed together)."""
        return orjson.dumps(self.sinks, option=orjson.OPT_SORT_KEYS)


def _path(directory: Path, session: str) -> Path:
    return directory / f"{PREFIX}{session}{SUFFIX}"


def write_setup(
    directory: Path, session: str, project: str, run: str, sinks: Sequence[Mapping[str, Any]]
) -> None:
    """Write the file atomically (0600); a failure is logged, never raised: the records are
    still spooled, only recover would not know the sinks."""
    body = orjson.dumps({"v": VERSION, "session": session, "project": project, "run": run, "sinks": sinks})
    body = scrub_bytes(body, secret_bytes())
    final = _path(directory, session)
    temporary = final.with_name(f".{final.name}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        os.replace(temporary, final)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        logger.warning(
            "asynctrace: cannot record the session's sinks in %s (%s); `asynctrace recover` "
            "would deliver its records to Trackio only",
            directory,
            describe(exc),
        )


def remove_setup(directory: Path, session: str) -> None:
    with contextlib.suppress(OSError):
        _path(directory, session).unlink()


def read_setups(directory: Path) -> tuple[dict[str, Setup], list[tuple[str, str]]]:
    """Every setup file of the directory by session, and (file name, problem) for unreadable ones."""
    setups: dict[str, Setup] = {}
    problems: list[tuple[str, str]] = []
    for path in sorted(directory.glob(f"{PREFIX}*{SUFFIX}")):
        try:
            data = orjson.loads(path.read_bytes())
            fields = (str(data["session"]), str(data["project"]), str(data["run"]), list(data["sinks"]))
            setup = Setup(*fields, path)
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
            problems.append((path.name, f"unreadable sink setup ({type(exc).__name__})"))
            continue
        setups[setup.session] = setup
    return setups, problems
