"""`asynctrace recover` on the command line: its summary and its exit status."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

import asynctrace as at
from asynctrace.cli import main
from tests._util import read_traces, sample


def test_recover_delivers_a_spool_and_prints_a_summary(tmp_path: Path, project: str) -> None:
    """Records left in a spool are delivered; the summary says how many; exit status 0."""
    spool = tmp_path / "spool"
    with at.TraceSession(
        project, run="r", sinks=[at.testing.MemorySink(hang=True)], spool_dir=spool, finish_timeout=0.2
    ) as s:
        s.log_samples([sample(i) for i in range(6)], step=0)
    result = CliRunner().invoke(main, ["recover", str(spool), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert f"{project}/r: 6 replayed, 6 written" in result.output
    assert len(read_traces(project, "r")) == 6
    again = CliRunner().invoke(main, ["recover", str(spool), "--no-progress"])
    assert again.exit_code == 0 and "nothing to replay" in again.output


def test_recover_refuses_a_spool_in_use_or_missing(tmp_path: Path) -> None:
    """A spool held by a live session, or no spool at all, is exit status 2 with a clear message."""
    spool = tmp_path / "spool"
    with at.TraceSession("p", run="r", sinks=[at.testing.MemorySink()], spool_dir=spool):
        result = CliRunner().invoke(main, ["recover", str(spool), "--no-progress"])
    assert result.exit_code == 2 and "in use by another session" in result.output
    missing = CliRunner().invoke(main, ["recover", str(tmp_path / "nope"), "--no-progress"])
    assert missing.exit_code == 2 and "no spool directory" in missing.output
