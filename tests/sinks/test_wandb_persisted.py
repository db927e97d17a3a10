"""W&B's "written" means in the run's `.wandb` file: a trainer in a subprocess, its own real
`wandb-core` stopped (SIGSTOP) or killed (SIGKILL) by the test, the log read back from disk."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from tests.sinks._wandb_log import increments

# Seconds a test waits for the subprocess to do something (its first W&B run starts a service).
PATIENCE = 60.0
# wandb-core writes the `.wandb` file this often: long enough that the rows logged before a
# kill are not in it, so the kill certainly loses them.
NEVER = 600.0


class Trainer:
    """`tests/sinks/_wandb_child.py` running, and its replies read line by line."""

    def __init__(
        self,
        root: Path,
        run: str,
        interval: float,
        spool: Path | None = None,
        *,
        samples: int = 5,
        flush: float = 2.0,
        attach: bool = False,
    ) -> None:
        args = [sys.executable, "-m", "tests.sinks._wandb_child", str(root), run, str(interval)]
        if spool is not None:
            args.append(str(spool))
        # Not this process's W&B service (wandb.setup() names it in WANDB_SERVICE): its own.
        env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
        env.update(SAMPLES=str(samples), FLUSH=str(flush), ATTACH="1" if attach else "0")
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=Path(__file__).parents[2]
        )
        # Stage 1: the run is open.
        self.opened = self._reply()
        self.log = Path(self.opened["log"])
        self.service = self._service()

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        # No deadline needed here: the child's own waits are bounded (60 s at most).
        line = self.proc.stdout.readline()
        assert line, f"the trainer ended without replying (exit status {self.proc.wait(PATIENCE)})"
        reply: dict[str, Any] = orjson.loads(line)
        return reply

    def next(self) -> dict[str, Any]:
        """Let the trainer go on to its next stage; its reply."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()
        return self._reply()

    def _service(self) -> psutil.Process:
        (core,) = [
            p for p in psutil.Process(self.proc.pid).children(recursive=True) if p.name() == "wandb-core"
        ]
        return core

    def end(self) -> None:
        """Kill the trainer and its service, whatever state they are in."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(PATIENCE)
        with contextlib.suppress(psutil.NoSuchProcess):
            if self.service.is_running():
                self.service.send_signal(signal.SIGCONT)
                kill(self.service)


@pytest.fixture
def trainers() -> Iterator[list[Trainer]]:
    """Trainers a test started: killed with their services after it."""
    started: list[Trainer] = []
    yield started
    for trainer in started:
        trainer.end()


def kill(core: psutil.Process) -> None:
    """SIGKILL `core` and wait until it is dead (a zombie until the trainer, its parent, reaps it)."""
    core.kill()
    deadline = time.monotonic() + PATIENCE
    with contextlib.suppress(psutil.NoSuchProcess):
        while core.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "wandb-core outlived its SIGKILL"
            time.sleep(0.01)


def test_a_confirmed_flush_is_in_the_wandb_file_when_the_service_is_killed(
    tmp_path: Path, trainers: list[Trainer]
) -> None:
    """flush() → True, then SIGKILL wandb-core at once: the `.wandb` file holds every row counted written."""
    trainer = Trainer(tmp_path, "kept", 0.2, flush=30.0)
    trainers.append(trainer)
    logged = trainer.next()
    kill(trainer.service)
    assert logged["flushed"] and logged["written"] == 5, logged
    assert increments(trainer.log) == 1, "the rows counted written must be in the log"


@pytest.mark.parametrize("attach", [False, True], ids=["own-run", "attached"])
def test_rows_a_killed_service_never_wrote_count_as_failed(
    tmp_path: Path, trainers: list[Trainer], attach: bool
) -> None:
    """Rows handed to wandb-core but not in its `.wandb` file when it is killed are never counted
    written: flush() says so, and they end as failed, with the reason, in the spool's dead letters
    (attached: once the trainer has moved on, so that the rows wait on wandb-core alone)."""
    trainer = Trainer(tmp_path, "lost", NEVER, tmp_path / "spool", attach=attach)
    trainers.append(trainer)
    logged = trainer.next()
    assert not logged["flushed"] and logged["written"] == 0, logged
    kill(trainer.service)
    assert increments(trainer.log) == 0, "the service had not written the rows: the kill lost them"
    last = trainer.next()
    assert last["written"] == 0 and last["failed"] == 5 and last["dead_letters"] == 5 and last["check"], last
    assert "W&B service process is gone" in last["error"]
    assert trainer.proc.wait(PATIENCE) == 0


def test_a_stopped_service_acknowledges_nothing_until_it_writes(
    tmp_path: Path, trainers: list[Trainer]
) -> None:
    """With wandb-core stopped (SIGSTOP) nothing counts as written; once it goes on and writes
    its log, everything does."""
    trainer = Trainer(tmp_path, "stopped", 0.2)
    trainers.append(trainer)
    trainer.service.send_signal(signal.SIGSTOP)
    try:
        logged = trainer.next()
    finally:
        trainer.service.send_signal(signal.SIGCONT)
    assert not logged["flushed"] and logged["written"] == 0, logged
    last = trainer.next()
    assert last["flushed"] and last["written"] == 5 and last["check"], last
    assert trainer.proc.wait(PATIENCE) == 0
    assert increments(trainer.log) == 1


def _replayed_by_the_next_session(
    tmp_path: Path, name: str, spool: Path, trainers: list[Trainer], *, attach: bool = False
) -> None:
    """A new session on `spool` replays the 5 rows into its own run, whose `.wandb` file holds
    them, and its accounting checks."""
    again = Trainer(tmp_path, name, 0.2, spool, samples=0, flush=30.0, attach=attach)
    trainers.append(again)
    assert again.opened["replayed"] == 5
    replayed = again.next()
    assert replayed["flushed"] and replayed["written"] == 5, replayed
    assert increments(again.log) == 1
    last = again.next()
    assert last["check"] and last["failed"] == 0, last


def test_a_spooled_run_killed_with_its_service_is_replayed(tmp_path: Path, trainers: list[Trainer]) -> None:
    """Rows wandb-core had not written stay in the spool: after a SIGKILL of the trainer and its
    service, the next session replays them into a new run, whose `.wandb` file holds them."""
    spool = tmp_path / "spool"
    trainer = Trainer(tmp_path, "spooled", NEVER, spool)
    trainers.append(trainer)
    logged = trainer.next()
    assert not logged["flushed"] and logged["written"] == 0, logged
    # The trainer first, so that it cannot see its service die and give the rows up.
    trainer.proc.kill()
    trainer.proc.wait(PATIENCE)
    kill(trainer.service)
    assert increments(trainer.log) == 0

    _replayed_by_the_next_session(tmp_path, "spooled", spool, trainers)


def test_an_attached_runs_rows_count_once_its_log_holds_them(tmp_path: Path, trainers: list[Trainer]) -> None:
    """Attached to the trainer's run (the default), rows handed to wandb-core are not counted
    written until its `.wandb` file holds them: with its service killed before it wrote them,
    they stay in the spool and the next session logs them into its own trainer's run."""
    spool = tmp_path / "spool"
    trainer = Trainer(tmp_path, "attached", NEVER, spool, attach=True)
    trainers.append(trainer)
    logged = trainer.next()
    # The trainer has moved on to its next step, so W&B would write them, but not in 600 s.
    assert not logged["flushed"] and logged["written"] == 0 and logged["failed"] == 0, logged
    trainer.proc.kill()
    trainer.proc.wait(PATIENCE)
    kill(trainer.service)
    assert increments(trainer.log) == 0

    _replayed_by_the_next_session(tmp_path, "attached", spool, trainers, attach=True)
