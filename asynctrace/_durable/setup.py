"""The session's sinks, remembered in the spool directory for `asynctrace recover`.

Each session with a spool writes ``setup-<session>.json`` when it opens: its project, run and
a spec of each sink (see `asynctrace.sinks._spec`: kinds and non-secret arguments), scrubbed
of any credential the environment holds. Segment headers name the session, so recover knows
which sinks each record was meant for. The file goes when its session finished with nothing
of its own left in the spool, or when recover delivered everything of it.

Reading one trusts nothing in it: a file that is not a regular file, too large, not JSON of
this shape, of a newer format, or naming another session than its file name is unreadable,
and reported with its file's name.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .._security import describe, logger, scrub_bytes, secret_bytes

__all__ = ["Setup", "SetupFiles", "read_setups", "remove_setup", "write_setup"]

PREFIX = "setup-"
SUFFIX = ".json"
VERSION = 2  # 2: sinks named by kind; 1 (still read): by class
MAX_BYTES = 1 << 20  # far more than any session's sinks take


@dataclass(frozen=True, slots=True)
class Setup:
    """What one session's setup file says."""

    session: str
    project: str
    run: str
    sinks: list[Any]
    path: Path

    @property
    def key(self) -> bytes:
        """Equal for sessions whose sinks are alike (then replayed together)."""
        return orjson.dumps(self.sinks, option=orjson.OPT_SORT_KEYS)


@dataclass(slots=True)
class SetupFiles:
    """The setup files of a spool directory: readable ones by session, and the problem of each
    unreadable one by the session its file name gives."""

    setups: dict[str, Setup] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)


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


def read_setups(directory: Path) -> SetupFiles:
    """Every setup file of the directory (see the module docstring)."""
    found = SetupFiles()
    for path in sorted(directory.glob(f"{PREFIX}*{SUFFIX}")):
        session = path.name[len(PREFIX) : -len(SUFFIX)]
        try:
            found.setups[session] = _read(path, session)
        except (OSError, ValueError) as exc:
            why = str(exc) if isinstance(exc, ValueError) else describe(exc)
            found.unreadable[session] = f"{path.name}: unreadable sink setup ({why})"
    return found


def _read(path: Path, session: str) -> Setup:
    info = path.lstat()
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("not a regular file")
    if info.st_size > MAX_BYTES:
        raise ValueError(f"{info.st_size} bytes, more than a setup holds")
    try:
        data = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    version = data.get("v")
    if version not in (1, VERSION):
        raise ValueError(f"format {version!r}, not one this version of asynctrace reads")
    fields = data.get("session"), data.get("project"), data.get("run")
    if not all(isinstance(f, str) for f in fields):
        raise ValueError("its session, project or run is not a string")
    if data["session"] != session:
        raise ValueError("it names another session than its file name")
    if not isinstance(data.get("sinks"), list):
        raise ValueError("its sinks are not a list")
    return Setup(session, data["project"], data["run"], data["sinks"], path)
