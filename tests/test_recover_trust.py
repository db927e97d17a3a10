"""A spool's setup file is data: recover imports nothing it names, makes only the sinks
asynctrace ships (and those passed in code), checks every argument and path first, and keeps the
records of a session whose setup it will not follow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import anyio
import orjson
import pyarrow.parquet as pq
import pytest

import asynctrace as at
from asynctrace._recover import RecoverReport, recover
from asynctrace.ray import SinkSpec
from tests import _recover_spools as rs
from tests.faults import _harness as h

ZEN = "Beautiful is better than ugly"


def _recover(spool: Path, **options: Any) -> RecoverReport:
    return anyio.run(lambda: recover(spool, progress=False, **options))


def test_recover_imports_no_module_a_setup_names(tmp_path: Path) -> None:
    """A setup naming `this:Zen` or a module of the spool's own is not imported: no Zen printed,
    no code run; the records stay in the spool (exit 1) and the summary says how to pass the sink."""
    spool = tmp_path / "spool"
    marker = tmp_path / "ran"
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "spoolmod.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Sink: pass\n")
    rs.set_sinks(spool, rs.leave(spool, "r1"), [{"name": "zen", "class": "this:Zen", "args": {}}], v=1)
    rs.set_sinks(spool, rs.leave(spool, "r2"), [{"name": "mine", "class": "spoolmod:Sink", "args": {}}])
    env = h.env()
    env["PYTHONPATH"] += os.pathsep + str(planted)
    result = subprocess.run(
        [sys.executable, "-m", "asynctrace", "recover", "--no-progress", str(spool)],
        capture_output=True, text=True, env=env, cwd=h.ROOT, timeout=120,
    )  # fmt: skip
    assert ZEN not in result.stdout + result.stderr and not marker.exists()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    held = "p/r1: 5 records not replayed, kept in the spool: sink 'zen': it is a sink of your own ('this:Zen"
    assert held in result.stdout, result.stdout
    assert "sinks={'mine': YourSink}" in result.stdout, result.stdout
    assert len(list(spool.glob("setup-*.json"))) == 2, "the setups stay with their records"


def test_a_sink_of_your_own_comes_back_when_passed_in_code(tmp_path: Path) -> None:
    """`recover(sinks=...)` makes a setup's own sink from the class passed (with the setup's
    arguments), from a SinkSpec as given, or leaves it out with None."""
    spool = tmp_path / "spool"
    made: list[at.testing.MemorySink] = []

    def factory(**args: Any) -> at.Sink:
        made.append(at.testing.MemorySink(**args))
        return made[-1]

    own = {"name": "mine", "class": "mymodule:Mine", "args": {"name": "mine"}}
    rs.set_sinks(spool, rs.leave(spool, "r1"), [own])
    report = _recover(spool, sinks={"mine": factory, "typo": factory})
    assert report.ok and [len(s.records) for s in made] == [5], report.lines()
    assert "  sinks passed that no setup names: 'typo'" in report.lines()
    spec_sink = at.testing.MemorySink("mine")
    rs.set_sinks(spool, rs.leave(spool, "r2"), [own])
    report = _recover(spool, sinks={"mine": SinkSpec(lambda: spec_sink)})
    assert report.ok and len(spec_sink.records) == 5
    rs.set_sinks(spool, rs.leave(spool, "r3"), [own, rs.jsonl(tmp_path / "out.jsonl")])
    report = _recover(spool, sinks={"mine": None})
    assert report.ok and sum(rs.uids(tmp_path / "out.jsonl").values()) == 5
    assert "  sink 'mine' cannot be made outside the trainer, so it gets nothing: left out by the caller" in (
        report.lines()
    )
    with pytest.raises(TypeError, match="not a MemorySink"):
        _recover(spool, sinks={"mine": at.testing.MemorySink()})  # type: ignore[dict-item]


def test_a_setup_of_the_previous_format_names_shipped_sinks_by_class(tmp_path: Path) -> None:
    """A setup written before kinds (`"class": "asynctrace.sinks._jsonl:JsonlSink"`) still makes
    its shipped sinks, looked up by name in the registry."""
    spool, out = tmp_path / "spool", tmp_path / "out.jsonl"
    spec = rs.jsonl(out)
    del spec["kind"]
    spec["class"] = "asynctrace.sinks._jsonl:JsonlSink"
    rs.set_sinks(spool, rs.leave(spool), [spec], v=1)
    report = _recover(spool)
    assert report.ok and sum(rs.uids(out).values()) == 5, report.lines()
    assert f"    writes to: jsonl: {out}" in report.lines()


def _tampered(tmp_path: Path, case: str) -> tuple[dict[str, Any], str]:
    """A JSONL or Parquet sink's spec edited as `case` says, and what the summary must say."""
    out = tmp_path / "out.jsonl"
    spec = rs.jsonl(out)
    args = spec["args"]
    if case == "unknown argument":
        args["mode"] = "w"
        return spec, "JsonlSink takes no argument 'mode' from a setup"
    if case == "relative path":
        args["path"] = "out.jsonl"
        return spec, "its path 'out.jsonl' is not an absolute path"
    if case == "control character":
        args["path"] = str(out) + "\n  p/r: 5 replayed, 5 written"
        return spec, "holds NUL or a control character"
    if case == "a file JsonlSink did not write":
        (tmp_path / ".bashrc").write_text("export PATH=$HOME/bin:$PATH\n")
        args["path"] = str(tmp_path / ".bashrc")
        return spec, "is a file that JsonlSink did not write"
    if case == "a link":
        (tmp_path / "elsewhere").write_text("")
        out.symlink_to(tmp_path / "elsewhere")
        return spec, "is not a regular file"
    if case == "a link changed":
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        (tmp_path / "archive").symlink_to(tmp_path / "b")
        directory = str(tmp_path / "archive")
        args = {"directory": directory, "max_records": 10, "max_bytes": 1000, "compression_level": None}
        resolved = {"directory": str(tmp_path / "a")}
        spec = {"name": "parquet", "kind": "parquet", "args": args, "resolved": resolved}
        return spec, "not to " + repr(str(tmp_path / "a"))
    if case == "a file for a directory":
        (tmp_path / "archive").write_text("")
        args = {"directory": str(tmp_path / "archive")}
        return {"name": "parquet", "kind": "parquet", "args": args}, "is not a directory"
    if case == "unknown kind":
        spec["kind"] = "shell"
        return spec, "its kind 'shell' is not one of asynctrace's sinks"
    assert case == "a W&B setting"
    spec = {"name": "wandb", "kind": "wandb", "args": {"project": "p", "init_kwargs": {"settings": "x"}}}
    return spec, "its init_kwargs hold 'settings', not taken from a setup"


@pytest.mark.parametrize(
    "case",
    [
        "unknown argument",
        "relative path",
        "control character",
        "a file JsonlSink did not write",
        "a link",
        "a link changed",
        "a file for a directory",
        "unknown kind",
        "a W&B setting",
    ],
)
def test_recover_refuses_what_a_setup_should_not_hold_and_keeps_the_records(
    tmp_path: Path, case: str
) -> None:
    """An argument the kind does not take, a path that is relative, holds a control character,
    names a file JsonlSink did not write or a link, or leads elsewhere than when the session
    started: that session's records stay in the spool, the summary says which sink and why, and
    no file is touched."""
    spool = tmp_path / "spool"
    spec, why = _tampered(tmp_path, case)
    rs.set_sinks(spool, rs.leave(spool), [spec])
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and spool not in p.parents}
    report = _recover(spool)
    assert not report.ok and report.left == 5 and not report.groups
    (line,) = [line for line in report.lines() if "not replayed" in line]
    assert why in line, line
    assert "\n" not in "".join(report.lines())
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and spool not in p.parents}
    assert after == before
    assert len(list(spool.glob("setup-*.json"))) == 1


def test_a_spool_lock_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    """A copied spool whose `.lock` is a link to another file (or a FIFO in its place): recover
    stops with exit 2 naming the lock, a session refuses the spool with a SpoolError, and the
    file the link leads to is neither truncated nor written; the records stay in the spool."""
    spool = tmp_path / "spool"
    rs.leave(spool)
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    (spool / ".lock").unlink()
    (spool / ".lock").symlink_to(precious)
    result = h.recover(str(spool))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stdout + result.stderr
    assert "cannot lock the spool directory" in result.stderr, result.stderr
    session = at.TraceSession("p", run="r", sinks=[at.testing.MemorySink()], spool_dir=spool)
    with pytest.raises(at.SpoolError, match="cannot lock the spool directory"), session:
        pass
    assert precious.read_text() == "keep me\n"
    (spool / ".lock").unlink()
    os.mkfifo(spool / ".lock")
    session = at.TraceSession("p", run="r", sinks=[at.testing.MemorySink()], spool_dir=spool)
    with pytest.raises(at.SpoolError, match="not a regular file"), session:
        pass
    (spool / ".lock").unlink()
    assert len(list(spool.glob("seg-*.jsonl"))) == 1


def _forge(segment: Path, kind: bytes, edit: dict[str, Any], nth: int = 0) -> None:
    """Change fields of the `nth` line of `kind` (b"h", b"r") in `segment` and seal it again with
    a matching CRC, as whoever edits a spool can."""
    lines = segment.read_bytes().split(b"\n")
    at = [i for i, line in enumerate(lines) if line.startswith(b'{"t":"' + kind + b'"')][nth]
    line = lines[at]
    cut = line.find(b',"sample":') if kind == b"r" else line.rindex(b',"c":')
    head = orjson.loads(line[:cut] + b"}")
    changed = json.dumps({**head, **edit}, separators=(",", ":")).encode()  # orjson stops at 64 bits
    body = changed[:-1] + line[cut : line.rindex(b',"c":')]
    lines[at] = body + b',"c":%d}' % zlib.crc32(body)
    segment.write_bytes(b"\n".join(lines))


def test_spool_lines_with_fields_no_session_writes_are_corrupt_not_replayed(tmp_path: Path) -> None:
    """Record lines edited with a matching CRC to hold a step past 64 bits, a time past what a
    sink's column holds, an id that is no string, and a file whose header names a path as its
    project: those lines (and that file) are counted and named, the other records reach the JSONL
    and Parquet sinks exactly once, recover goes on past them, and exits 1."""
    spool, out, archive = tmp_path / "spool", tmp_path / "out.jsonl", tmp_path / "archive"
    parquet = {"name": "parquet", "kind": "parquet", "args": {"directory": str(archive)}}
    sessions = [rs.leave(spool, run) for run in ("r1", "r2")]
    for session in sessions:
        rs.set_sinks(spool, session, [rs.jsonl(out), parquet])
    edited, headless = (next(spool.glob(f"seg-*-{s}-*.jsonl")) for s in sessions)
    for nth, edit in enumerate([{"step": 2**70}, {"ts": 1e300}, {"id": 7}]):
        _forge(edited, b"r", edit, nth)
    _forge(headless, b"h", {"project": "../elsewhere"})
    result = h.recover(str(spool))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    assert f"skipped: {edited.name}: 3 corrupt line(s) skipped" in result.stdout, result.stdout
    assert f"skipped: {headless.name}: no valid header" in result.stdout, result.stdout
    assert "stopped" not in result.stdout, result.stdout
    assert rs.uids(out) == {"r1/0:3": 1, "r1/0:4": 1}
    assert sorted(orjson.loads(m)["uid"] for m in pq.read_table(archive).column("metadata").to_pylist()) == [
        "0:3",
        "0:4",
    ]


def test_a_spool_file_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    """A spool holding, under a segment's name, a link to another spool's segment: recover
    delivers its own records only, names the link as unreadable (exit 1), and leaves the other
    spool's file as it was, its records still for that spool's recover."""
    mine, theirs, out = tmp_path / "mine", tmp_path / "theirs", tmp_path / "out.jsonl"
    rs.set_sinks(mine, rs.leave(mine, "r1"), [rs.jsonl(out)])
    rs.set_sinks(theirs, rs.leave(theirs, "r2"), [rs.jsonl(out)])
    (target,) = theirs.glob("seg-*.jsonl")
    before = target.read_bytes()
    link = mine / f"seg-{'0' * 20}-linked-0000.jsonl"
    link.symlink_to(target)
    result = h.recover(str(mine))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    assert f"skipped: {link.name}: unreadable (OSError: a link, not followed)" in result.stdout, result.stdout
    assert rs.uids(out) == {f"r1/0:{i}": 1 for i in range(5)}
    assert target.read_bytes() == before
    assert h.recover(str(theirs)).returncode == 0
    assert rs.uids(out) == {f"r{run}/0:{i}": 1 for run in (1, 2) for i in range(5)}
