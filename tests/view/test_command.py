"""`asynctrace view` as a process: a busy port exits 1 with a message, Ctrl-C (a real SIGINT) exits 130
during the indexing and after it, never an abort; the command answers only its own address."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import anyio

import asynctrace as at

from . import _archive
from .test_safety import _request

_WORDS = ["reward", "policy", "token", "rollout", "answer", "prime", "divisor", "equation", "proof", "sum"]


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40,960 records with 1 KB of text each, through a real session: long enough to index that a
    signal lands while DuckDB is at work."""
    directory = tmp_path_factory.mktemp("large") / "archive"

    async def main() -> None:
        # In-process writer: the files are what is read here; tests/sinks/ test the writer process.
        async with at.TraceSession(
            "view-large", run="r", sinks=[at.ParquetSink(directory, process=False)], health_metrics=False
        ) as s:
            for step in range(40):
                batch = [
                    at.Sample(
                        messages=[
                            {"role": "user", "content": f"problem {i % 97}"},
                            {
                                "role": "assistant",
                                "content": " ".join(_WORDS[(i + k) % 10] + str(k) for k in range(150)),
                            },
                        ],
                        metadata={
                            "prompt_id": f"p{i % 97}",
                            "group_uid": f"{step}-{i // 8}",
                            "reward": float(i % 3),
                        },
                    )
                    for i in range(1024)
                ]
                await s.log_samples(batch, step=step)

    anyio.run(main)
    return directory


def _view(archive: Path, cache: Path, *args: str, sigint: Any = signal.SIG_DFL) -> subprocess.Popen[str]:
    env = dict(os.environ, ASYNCTRACE_VIEW_CACHE=str(cache))
    command = [sys.executable, "-m", "asynctrace", "view", str(archive), *args]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # The disposition a terminal gives, whatever the runner of this suite left to it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
    )


def _url(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("asynctrace view: http://"), line + (proc.stderr.read() if proc.stderr else "")
    return line.split()[2].rstrip("/")


def _interrupt(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err


def test_a_busy_port_exits_1_with_a_message(agentic_archive: tuple[Path, Path], tmp_path: Path) -> None:
    """A port another process listens on: the message, status 1, no abort and no indexing begun."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _view(agentic_archive[0], tmp_path / "cache", "--port", str(port))
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert err == f"Error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    assert not (tmp_path / "cache").exists()


def test_ctrl_c_during_indexing_exits_130(large: Path, tmp_path: Path) -> None:
    """SIGINT while the archive is still being indexed (its text index not kept yet): "stopped",
    status 130, no abort from DuckDB's threads."""
    proc = _view(large, tmp_path / "cache", "--port", "0")
    try:
        _url(proc)
        assert not list((tmp_path / "cache").glob("text-1/*.parquet")), (
            "indexed before the signal: a larger archive"
        )
        status, err = _interrupt(proc)
    finally:
        proc.kill()
    assert (status, err) == (130, "asynctrace view: stopped\n")


def test_ctrl_c_while_serving_exits_130_and_only_its_address_is_answered(
    agentic_archive: tuple[Path, Path], tmp_path: Path
) -> None:
    """Once indexed: the command answers its loopback names on its port and refuses any other
    name or port (421); SIGINT then exits 130."""
    parquet = _archive.without_sidecars(agentic_archive[0], tmp_path / "archive")
    proc = _view(parquet, tmp_path / "cache", "--port", "0")
    try:
        url = _url(proc)
        _archive.ready(url)
        deadline = time.monotonic() + 30
        while len(list((tmp_path / "cache").glob("text-1/*.parquet"))) < len(list(parquet.glob("*.parquet"))):
            assert time.monotonic() < deadline, "the text index was not kept"
            time.sleep(0.05)
        port = int(url.rsplit(":", 1)[1])
        for host, status in {
            f"127.0.0.1:{port}": 200,
            f"localhost:{port}": 200,
            f"localhost:{port + 1}": 421,
            "localhost": 421,
            f"attacker.example:{port}": 421,
        }.items():
            assert _request(url, "/", host)[0] == status, host
        status, err = _interrupt(proc)
    finally:
        proc.kill()
    assert (status, err) == (130, "asynctrace view: stopped\n")


def test_ctrl_c_exits_130_when_started_with_sigint_ignored(
    agentic_archive: tuple[Path, Path], tmp_path: Path
) -> None:
    """Started as a shell's background job (SIGINT ignored), a SIGINT sent to it still stops it with
    "stopped" and status 130, not a silent 0."""
    proc = _view(agentic_archive[0], tmp_path / "cache", "--port", "0", sigint=signal.SIG_IGN)
    try:
        _archive.ready(_url(proc))
        status, err = _interrupt(proc)
    finally:
        proc.kill()
    assert (status, err) == (130, "asynctrace view: stopped\n")
