"""The Trackio writer process: it imports this asynctrace, and it ends when its trainer dies."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

import asynctrace as at
from tests._util import read_traces, sample
from tests.faults import _harness as h


@pytest.mark.anyio
async def test_writer_ignores_an_asynctrace_in_the_current_directory(
    project: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer run from a directory holding another `asynctrace/` still gets a writer running this one."""
    shadow = tmp_path / "asynctrace"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the shadowing copy was imported')\n")
    monkeypatch.chdir(tmp_path)
    policy = at.RetryPolicy(max_attempts=1, attempt_timeout=30)
    async with at.TraceSession(project, run="r", retry=policy) as session:
        await session.log_samples([sample(i) for i in range(3)], step=0)
    stats = session.stats()
    assert stats.written == 3 and stats.failed == 0, stats.sinks["trackio"].last_error
    assert len(read_traces(project, "r")) == 3


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill_trainer_leaving_a_holder(backend: str, how: str) -> tuple[str, dict[str, int], float]:
    """Run a trainer that leaves a child holding what it inherited and SIGKILLs itself; returns
    the project, what it printed, and how long its writer outlived it (at most 10 s)."""
    project = f"hold-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.sinks._children", "die-holding-pipe", project, backend, how],
        stdout=subprocess.PIPE,
        text=True,
        env=h.env(),
        cwd=h.ROOT,
    )
    out, _ = proc.communicate(timeout=60)
    died = time.monotonic()
    printed = {k: int(v) for k, v in (line.split() for line in out.splitlines() if line[:1].isupper())}
    assert proc.returncode == -9 and "WRITER" in printed and "HOLDER" in printed, out
    try:
        while not _gone(printed["WRITER"]) and time.monotonic() - died < 10:
            time.sleep(0.05)
        return project, printed, time.monotonic() - died
    finally:
        psutil.Process(printed["HOLDER"]).kill()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_forked_child_does_not_keep_the_writer_of_a_killed_trainer(backend: str) -> None:
    """A child forked by the trainer holds no end of the writer's pipe, so when the trainer is
    SIGKILLed its writer finishes the run and exits at once, while the child lives on."""
    project, printed, outlived = _kill_trainer_leaving_a_holder(backend, "fork")
    assert printed["HOLDS"] == 0
    assert outlived < 3.0
    assert len(read_traces(project, "r")) == 4


def test_writer_exits_when_its_parent_dies_even_if_another_process_holds_its_pipe() -> None:
    """A process that inherited the writer's stdin pipe (pass_fds, no fork hook) does not keep
    the writer of a SIGKILLed trainer alive: the writer notices its parent is gone."""
    project, _, outlived = _kill_trainer_leaving_a_holder("asyncio", "exec")
    assert outlived < 3.0
    assert len(read_traces(project, "r")) == 4


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # asyncio closes a dead child's pipes itself
async def test_fork_hook_leaves_a_reused_descriptor_alone(project: str) -> None:
    """After the writer process died on its own (its pipes closed by the event loop), a fork does
    not redirect an unrelated pipe that reused their descriptor numbers in the child."""
    import os
    import signal

    import anyio

    sink = at.TrackioSink(project, "r")
    await sink.open()
    try:
        assert sink._proc is not None and sink._pipe_fds
        numbers = {fd for fd, _ in sink._pipe_fds}
        os.kill(sink._proc.pid, signal.SIGKILL)

        def all_closed() -> bool:
            for fd in numbers:
                try:
                    os.fstat(fd)
                except OSError:
                    continue
                return False
            return True

        with anyio.fail_after(10):
            while not all_closed():
                await anyio.sleep(0.05)
        pipes = [os.pipe() for _ in range(2)]  # unrelated pipes, on the freed numbers
        reused = {fd for pair in pipes for fd in pair} & numbers
        assert reused
        pid = os.fork()
        if pid == 0:
            try:
                for _, w in pipes:
                    os.write(w, b"hello from child")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        for r, w in pipes:
            os.close(w)
            assert os.read(r, 100) == b"hello from child"
            os.close(r)
    finally:
        with contextlib.suppress(Exception):
            await sink.close()
