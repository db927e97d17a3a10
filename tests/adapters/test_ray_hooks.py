"""OpenRLHF's and slime's hooks inside real local Ray actors, where those frameworks run them.

OpenRLHF's `PPOTrainer` and slime's `RolloutManager` are Ray actors, so the session a hook
opens lives in the actor's process (tests/adapters/_ray_hooked.py). Two actors run both: one
whose work ends and which Ray then ends gracefully (its last handle dropped, as the
frameworks' drivers drop theirs), where the sessions' exit hook writes every record; and one
killed (`ray.kill`), whose records, spooled, are replayed by the next session on the spool.
The last step's records are held by the session's `top_bottom` sampler until the step closes,
so they reach Trackio only through that exit hook, or that replay.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import asynctrace as at
from asynctrace.rollouts import toy_tokenizer
from tests._util import read_traces
from tests.adapters._ray_hooked import Host

ray = pytest.importorskip("ray")

PROMPTS = [
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nSpell 'cat' backwards.<|im_end|>\n<|im_start|>assistant\n",
]
# OpenRLHF's scripted step: two prompts, two rollouts each, one turn a rollout.
OPENRLHF = {
    "n": 2,
    "prompts": PROMPTS,
    "labels": ["391", "tac"],
    "turns": [
        [["The answer is 391.<|im_end|>"], ["It is 381.<|im_end|>"]],
        [["tac<|im_end|>"], ["act<|im_end|>"]],
    ],
    "gen": {"max_len": 256, "temperature": 1.0, "n_samples_per_prompt": 2},
}
ROWS = len(PROMPTS) * 2


@dataclass
class Ended:
    """Where each framework's sessions wrote: the graceful actor's project, the killed one's, and
    the killed one's spool, by framework."""

    projects: dict[str, str]
    killed: dict[str, str]
    spools: dict[str, Path]
    killed_before: dict[str, list[int]]


def _exited(pid: int, timeout: float = 120.0) -> None:
    """Wait until process `pid` is gone: Ray reports an actor dead before its exit hooks ran."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not exit within {timeout}s")


def _steps(project: str, run: str = "grpo-tool") -> list[int]:
    """The step of every trace of the run in Trackio, each record's once (by its id)."""
    traces = read_traces(project, run)
    ids = [t["metadata"]["asynctrace_id"] for t in traces]
    assert len(ids) == len(set(ids)), "a record written twice"
    return sorted(t["step"] for t in traces)


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory, ray_cluster: None) -> Ended:
    """Two actors run OpenRLHF's trainer and slime's rollout manager through their hooks, with
    the sessions those hooks open; then one is ended gracefully, its handle dropped (as
    `train_ppo_ray` drops the trainer's when `train` returns), and the other killed. Their
    sessions were opened as the pages say: the killed one's with a spool each, the graceful
    one's with a finish deadline a loaded machine meets."""
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("ray-hooks")
    checkpoint = root / "checkpoint"
    PreTrainedTokenizerFast(tokenizer_object=toy_tokenizer(), pad_token="<pad>").save_pretrained(checkpoint)
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    projects = {"openrlhf": f"orlhf-{tag}", "slime": f"slime-{tag}"}
    killed = {name: f"{project}-k" for name, project in projects.items()}
    spools = {name: root / f"spool-{name}" for name in projects}

    def host(names: dict[str, str], spooled: bool) -> dict[str, dict[str, Any]]:
        def session(name: str) -> dict[str, Any]:
            if spooled:
                return {"spool_dir": str(spools[name]), "durability": "enqueue"}
            # The exit hook's finish gets the time a loaded machine needs to start Trackio's
            # writer process (the default 10 s deadline passed there with nothing written).
            return {"finish_timeout": 60.0}

        return {
            "openrlhf": {"project": names["openrlhf"], "script": OPENRLHF, "session": session("openrlhf")},
            "slime": {"checkpoint": str(checkpoint), "project": names["slime"], "session": session("slime")},
        }

    remote = ray.remote(Host)
    graceful, doomed = remote.remote(**host(projects, False)), remote.remote(**host(killed, True))
    pids = ray.get([graceful.run.remote(), doomed.run.remote()], timeout=300)
    del graceful  # its work is done and the driver lets go of it: Ray ends it gracefully
    ray.kill(doomed, no_restart=True)
    for pid in pids:
        _exited(pid)
    return Ended(projects, killed, spools, {name: _steps(project) for name, project in killed.items()})


def _replay(project: str, spool: Path) -> at.SessionStats:
    """What the next session on the killed actor's spool delivers, as a restarted trainer's would."""
    with at.TraceSession(project, "grpo-tool", spool_dir=spool) as session:
        pass
    return session.stats()


@pytest.mark.timeout(420)
def test_openrlhf_trainer_actor_writes_every_record_when_its_work_ends(ended: Ended) -> None:
    """OpenRLHF's trainer actor ran two steps through the page's lines: the actor's session
    has written both once the actor's work ended (its exit hook closed the held last
    step); killed instead, with a spool, the next session on the spool writes the rest, each
    record once."""
    assert _steps(ended.projects["openrlhf"]) == [1] * ROWS + [2] * ROWS
    assert 2 not in ended.killed_before["openrlhf"], "the held step was written before the kill"
    stats = _replay(ended.killed["openrlhf"], ended.spools["openrlhf"])
    assert stats.replayed >= ROWS and stats.check(), stats.summary()
    assert _steps(ended.killed["openrlhf"]) == [1] * ROWS + [2] * ROWS


@pytest.mark.timeout(420)
def test_slime_rollout_manager_actor_writes_every_record_when_its_work_ends(ended: Ended) -> None:
    """slime's RolloutManager actor logged two rollouts through slime's `log_rollout_data` and the
    page's plugin: the actor's session has written both once the actor's work ended; killed
    instead, with a spool, the next session on the spool writes the rest, each record once."""
    rows = 9  # three prompts, three samples each (tests/adapters/_slime_setup.py)
    assert _steps(ended.projects["slime"]) == [0] * rows + [1] * rows
    assert 1 not in ended.killed_before["slime"], "the held rollout was written before the kill"
    stats = _replay(ended.killed["slime"], ended.spools["slime"])
    assert stats.replayed >= rows and stats.check(), stats.summary()
    assert _steps(ended.killed["slime"]) == [0] * rows + [1] * rows
