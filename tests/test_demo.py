"""`asynctrace demo` end to end: a real subprocess, a real tokenizer, Trackio storage in a scratch dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from asynctrace import SessionStats
from asynctrace._demo import _problems

STEPS = 5
MAX_TRACES = 4
PROJECT = "demo-e2e"
RUN = "demo-e2e-run"

# Trackio caches TRACKIO_DIR when it is imported, so the stored run is read back in a child
# process that sees the demo's scratch directory.
_READ_BACK = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage
project, run = sys.argv[1], sys.argv[2]
traces = SQLiteStorage.get_traces(project, run=run, sort="step_asc")
logs = SQLiteStorage.get_logs(project, run=run)
print(json.dumps({
    "runs": SQLiteStorage.get_runs(project),
    "traces": [{"step": t["step"], "key": t["key"], "messages": t["messages"], "metadata": t["metadata"]}
               for t in traces],
    "metrics": [{k: v for k, v in log.items() if isinstance(v, (int, float))} for log in logs],
}))
"""


@dataclass(frozen=True)
class DemoRun:
    returncode: int
    stdout: str
    stderr: str
    stored: dict[str, Any]


def _env(trackio_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TRACKIO_DIR"] = str(trackio_dir)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """One short demo run in its own TRACKIO_DIR, and what Trackio stored for it."""
    trackio_dir = tmp_path_factory.mktemp("trackio")
    env = _env(trackio_dir)
    command = [
        sys.executable, "-m", "asynctrace", "demo",
        "--project", PROJECT, "--run", RUN, "--steps", str(STEPS),
        "--workers", "3", "--group-size", "4", "--prompts-per-step", "2",
        "--max-traces", str(MAX_TRACES), "--seed", "7",
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=90)
    stored: dict[str, Any] = {}
    if done.returncode == 0:
        read = subprocess.run(
            [sys.executable, "-c", _READ_BACK, PROJECT, RUN],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        stored = json.loads(read.stdout.strip().splitlines()[-1])
    return DemoRun(done.returncode, done.stdout, done.stderr, stored)


def test_demo_exits_cleanly_with_summary(demo_run: DemoRun) -> None:
    """The demo exits 0 and prints the accounting, the invariant check and the dashboard command."""
    assert demo_run.returncode == 0, demo_run.stdout + demo_run.stderr
    out = demo_run.stdout
    assert f"run         {RUN}" in out
    assert f"written     {STEPS * MAX_TRACES}" in out
    assert "failed      0" in out
    assert "pending     0" in out
    assert "capped" in out
    assert "invariant   submitted" in out and ": OK" in out
    assert "trackio run finished" in out
    assert f'trackio show --project "{PROJECT}"' in out
    assert "PROBLEM" not in out


def test_demo_traces_are_in_trackio(demo_run: DemoRun) -> None:
    """Trackio holds exactly the capped number of traces per step, with chat messages and RL metadata."""
    assert demo_run.returncode == 0, demo_run.stdout + demo_run.stderr
    assert RUN in demo_run.stored["runs"]
    traces = demo_run.stored["traces"]
    per_step: dict[int, int] = {}
    for t in traces:
        per_step[t["step"]] = per_step.get(t["step"], 0) + 1
    assert per_step == {step: MAX_TRACES for step in range(STEPS)}
    for t in traces:
        assert t["key"] == "train/traces"
        assert [m["role"] for m in t["messages"]] == ["user", "assistant"]
        meta = t["metadata"]
        assert meta["model_step"] == t["step"]
        assert isinstance(meta["reward"], float) and isinstance(meta["advantage"], float)
        assert set(meta["reward_breakdown"]) == {"correct", "format", "length", "noise"}
        assert meta["stop_reason"] in {"stop", "length"}
        assert meta["status"] == {"stop": "success", "length": "truncated"}[meta["stop_reason"]]
        assert meta["duration_ms"] == round(meta["generation_time"] * 1000, 3) > 0
        assert meta["prompt_len"] > 0 and meta["response_len"] > 0
        assert meta["seq_len"] == meta["prompt_len"] + meta["response_len"]
        assert 0 <= meta["staleness"] == t["step"] - meta["policy_version"]


def test_demo_metrics_are_in_trackio(demo_run: DemoRun) -> None:
    """Every training step logged its scalar metrics (reward mean, accuracy, staleness) to the run."""
    assert demo_run.returncode == 0, demo_run.stdout + demo_run.stderr
    rows = [m for m in demo_run.stored["metrics"] if "reward/mean" in m]
    assert sorted(m["step"] for m in rows) == list(range(STEPS))
    for m in rows:
        assert 0.0 <= m["accuracy"] <= 1.0
        assert m["staleness/max"] >= m["staleness/mean"] >= 0.0


def test_demo_rejects_invalid_options() -> None:
    """A bad option is a usage error (exit 2) before anything runs."""
    done = subprocess.run(
        [sys.executable, "-m", "asynctrace", "demo", "--group-size", "1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "--group-size" in done.stderr


@pytest.mark.parametrize("args", [["--project", "a/b"], ["--run", ".."], ["--project", ""]])
def test_demo_rejects_names_trackio_cannot_store(args: list[str]) -> None:
    """A project or run name that is a path or empty is a usage error (exit 2), not a traceback."""
    from click.testing import CliRunner

    from asynctrace.cli import main

    result = CliRunner().invoke(main, ["demo", "--no-progress", *args])
    assert result.exit_code == 2 and args[0] in result.output


def test_losses_make_the_demo_fail() -> None:
    """Failed or pending samples, non-cap drops, or a broken invariant each count as a problem."""
    assert _problems(SessionStats(submitted=10, written=4, dropped={"capped": 6}), True) == []
    assert _problems(SessionStats(submitted=10, written=3, failed=1, dropped={"capped": 6}), True)
    assert _problems(SessionStats(submitted=10, written=3, pending=1, dropped={"capped": 6}), True)
    assert _problems(SessionStats(submitted=10, written=3, dropped={"capped": 6, "queue_full": 1}), True)
    assert _problems(SessionStats(submitted=11, written=4, dropped={"capped": 6}), True)
    assert _problems(SessionStats(submitted=10, written=4, dropped={"capped": 6}), False)


def test_dashboard_command_quotes_names_for_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    """The printed dashboard command is safe to paste whatever the project or directory name."""
    import shlex

    from asynctrace._demo import dashboard_command

    monkeypatch.setenv("TRACKIO_DIR", "/tmp/x")
    assert (
        dashboard_command("asynctrace-demo", "/tmp/x")
        == 'TRACKIO_DIR="/tmp/x" trackio show --project "asynctrace-demo"'
    )
    hostile = 'p"$(touch pwned)`x`'
    words = shlex.split(dashboard_command(hostile, "/tmp/dir with space"))
    assert words == ["TRACKIO_DIR=/tmp/dir with space", "trackio", "show", "--project", hostile]
