"""`asynctrace demo` end to end: a real subprocess, a real tokenizer, Trackio storage in a scratch
dir, the Parquet archive read back with DuckDB, and both printed commands checked."""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from asynctrace import SessionStats
from asynctrace._demo import _problems

STEPS = 5
GROUP = 4
PROMPTS_PER_STEP = 4  # the watched prompt's group and three others
MAX_TRACES = 4  # one group of 4 a step, by reward spread
PROJECT = "demo-e2e"
RUN = "demo-e2e-run"
WATCHED = "math-05"

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
    trackio_dir: Path
    archive: Path
    env: dict[str, str]


def _env(trackio_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TRACKIO_DIR"] = str(trackio_dir)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _demo_command(archive: Path, steps: int = STEPS) -> list[str]:
    return [
        "demo", "--project", PROJECT, "--run", RUN, "--archive", str(archive), "--steps", str(steps),
        "--workers", "3", "--group-size", str(GROUP), "--prompts-per-step", str(PROMPTS_PER_STEP),
        "--max-traces", str(MAX_TRACES), "--seed", "7",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """One short demo run in its own TRACKIO_DIR and archive directory, and what Trackio stored."""
    trackio_dir = tmp_path_factory.mktemp("trackio")
    archive = tmp_path_factory.mktemp("archive")
    env = _env(trackio_dir)
    command = [sys.executable, "-m", "asynctrace", *_demo_command(archive)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
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
    return DemoRun(done.returncode, done.stdout, done.stderr, stored, trackio_dir, archive / RUN, env)


def _archived(run: DemoRun) -> list[dict[str, Any]]:
    """Every record of the demo's Parquet archive, read with DuckDB."""
    import duckdb

    rows = duckdb.execute(
        "SELECT id, step, split, reward, metadata FROM read_parquet($f)",
        {"f": str(run.archive / "*.parquet")},
    ).fetchall()
    return [
        {"id": i, "step": step, "split": split, "reward": reward, "metadata": json.loads(meta)}
        for i, step, split, reward, meta in rows
    ]


def _line(out: str, label: str) -> str:
    """The summary line that starts with `label`."""
    return next(line.strip() for line in out.splitlines() if line.strip().startswith(label))


def test_demo_exits_cleanly_with_summary(demo_run: DemoRun) -> None:
    """The demo exits 0 and prints the accounting per sink, the invariant check and both commands."""
    assert demo_run.returncode == 0, demo_run.stdout + demo_run.stderr
    out = demo_run.stdout
    submitted = STEPS * PROMPTS_PER_STEP * GROUP
    assert f"run         {RUN}" in out
    assert f"samples     {submitted} submitted" in out
    assert f"written     {submitted}" in out
    assert "failed      0" in out
    assert "pending     0" in out
    assert "dropped     none" in out
    assert "invariant   submitted" in out and ": OK" in out
    assert "trackio run finished" in out
    assert "PROBLEM" not in out
    # Each sink's count is what it holds: the archive's rows, Trackio's traces.
    archived = len(_archived(demo_run))
    assert f"parquet     {archived} written (every sample), 0 failed, to {demo_run.archive}" in out
    traces = len(demo_run.stored["traces"])
    trackio = _line(out, "trackio     ")
    assert trackio.startswith(f"trackio     {traces} written: the top 1 group(s) of {GROUP} by reward spread")
    assert f"capped {submitted - traces}; 0 failed" in trackio
    assert f"plus the watched prompt {WATCHED}" in trackio


def test_the_archive_holds_every_sample(demo_run: DemoRun) -> None:
    """The Parquet archive holds every sample the trainer logged, each Trackio trace among them."""
    assert demo_run.returncode == 0, demo_run.stdout + demo_run.stderr
    rows = _archived(demo_run)
    assert len(rows) == STEPS * PROMPTS_PER_STEP * GROUP == len({r["id"] for r in rows})
    per_step: dict[int, int] = {}
    for r in rows:
        per_step[r["step"]] = per_step.get(r["step"], 0) + 1
    assert per_step == {step: PROMPTS_PER_STEP * GROUP for step in range(STEPS)}
    ids = {r["id"] for r in rows}
    assert {t["metadata"]["asynctrace_id"] for t in demo_run.stored["traces"]} <= ids


def test_trackio_holds_the_group_pick_and_the_watched_prompt(demo_run: DemoRun) -> None:
    """At every step Trackio holds the watched prompt's group and, of the other groups, exactly
    the one with the most reward spread (GroupSampler("top", stat="spread")), each whole."""
    assert demo_run.returncode == 0, demo_run.stdout + demo_run.stderr
    rows = _archived(demo_run)
    shown = {t["metadata"]["asynctrace_id"] for t in demo_run.stored["traces"]}
    for step in range(STEPS):
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            if r["step"] == step:
                groups.setdefault(r["metadata"]["group_uid"], []).append(r)
        watched = [g for g in groups.values() if g[0]["metadata"]["prompt_id"] == WATCHED]
        others = [g for g in groups.values() if g[0]["metadata"]["prompt_id"] != WATCHED]
        assert len(watched) == 1 and len(others) == PROMPTS_PER_STEP - 1
        assert {r["id"] for r in watched[0]} <= shown  # the watch list: the whole group, every step
        picked = [g for g in others if {r["id"] for r in g} <= shown]
        left = [g for g in others if not {r["id"] for r in g} & shown]  # whole groups or none
        assert len(picked) == MAX_TRACES // GROUP and len(picked) + len(left) == len(others)

        def spread(g: list[dict[str, Any]]) -> float:
            return statistics.pstdev(r["reward"] for r in g)

        assert min(spread(g) for g in picked) >= max(spread(g) for g in left)
    assert len(shown) == STEPS * (MAX_TRACES + GROUP)


def test_demo_traces_are_in_trackio(demo_run: DemoRun) -> None:
    """Trackio's traces carry chat messages and RL metadata, with the ids the archive has."""
    assert demo_run.returncode == 0, demo_run.stdout + demo_run.stderr
    assert RUN in demo_run.stored["runs"]
    traces = demo_run.stored["traces"]
    for t in traces:
        assert t["key"] == "train/traces"
        roles = [m["role"] for m in t["messages"]]
        meta = t["metadata"]
        if meta["prompt_id"] == WATCHED:  # a prompt the policy calls a tool for, then answers
            assert roles == ["user", "assistant", "tool", "assistant"]
            (call,) = t["messages"][1]["tool_calls"]
            assert call["function"]["name"] == "calculator" == t["messages"][2]["name"]
            assert call["id"] == t["messages"][2]["tool_call_id"]
        else:
            assert roles == ["user", "assistant"]
        assert meta["model_step"] == t["step"]
        assert isinstance(meta["reward"], float) and isinstance(meta["advantage"], float)
        assert set(meta["reward_breakdown"]) == {"correct", "format", "length"}
        assert meta["stop_reason"] in {"stop", "length"}
        assert meta["status"] == {"stop": "success", "length": "truncated"}[meta["stop_reason"]]
        assert meta["duration_ms"] == round(meta["generation_time"] * 1000, 3) > 0
        assert meta["prompt_len"] > 0 and meta["response_len"] > 0
        assert meta["seq_len"] == meta["prompt_len"] + meta["response_len"]
        assert 0 <= meta["staleness"] == t["step"] - meta["policy_version"]
        assert meta["prompt_id"] == f"math-{meta['prompt_index']:02d}"


def test_the_archive_holds_what_every_view_shows(demo_run: DemoRun) -> None:
    """Every completion has its token fields (ids, loss mask, both log-prob series, text ends, one
    value a token), its text ends cut its messages, some prompts call a tool, and some groups got
    the same reward for every completion (no learning signal), as the summary says."""
    import duckdb

    assert demo_run.returncode == 0, demo_run.stdout + demo_run.stderr
    files = str(demo_run.archive / "*.parquet")
    rows = duckdb.execute(
        f"SELECT messages, token_ids, loss_mask, logprobs, ref_logprobs, text_ends FROM '{files}'"
    ).fetchall()
    assert len(rows) == STEPS * PROMPTS_PER_STEP * GROUP
    tools = 0
    for messages, ids, mask, logprobs, ref, ends in rows:
        assert len(ids) == len(mask) == len(logprobs) == len(ref) == len(ends) > 0
        texts = [m["content"] for m in json.loads(messages)]
        assert ends[-1] == len("".join(texts)) and ends == sorted(ends)
        generated = [lp for lp, m in zip(logprobs, mask, strict=True) if m]
        assert generated and all(lp <= 0 for lp in generated)
        tools += any(m["role"] == "tool" for m in json.loads(messages))
    assert 0 < tools < len(rows)
    (flat,) = duckdb.execute(
        f"""SELECT count(*) FROM (SELECT stddev_pop(reward) AS s FROM '{files}'
            GROUP BY json_extract_string(metadata, '$.group_uid')) WHERE s = 0"""
    ).fetchone()  # type: ignore[misc]
    assert flat > 0
    assert f"({flat} with zero reward spread: no learning signal)" in _line(demo_run.stdout, "rollouts    ")


def test_demo_metrics_are_in_trackio(demo_run: DemoRun) -> None:
    """Every training step logged its scalar metrics (reward mean, accuracy, staleness) to the run."""
    assert demo_run.returncode == 0, demo_run.stdout + demo_run.stderr
    rows = [m for m in demo_run.stored["metrics"] if "reward/mean" in m]
    assert sorted(m["step"] for m in rows) == list(range(STEPS))
    for m in rows:
        assert 0.0 <= m["accuracy"] <= 1.0
        assert m["staleness/max"] >= m["staleness/mean"] >= 0.0


def test_the_printed_trackio_command_opens_what_was_written(demo_run: DemoRun) -> None:
    """`trackio show` is printed with the directory and project the run was written to."""
    assert demo_run.returncode == 0, demo_run.stdout + demo_run.stderr
    lines = demo_run.stdout.splitlines()
    command = lines[lines.index(next(x for x in lines if x.startswith("Open the dashboard"))) + 1]
    assert shlex.split(command) == [
        f"TRACKIO_DIR={demo_run.trackio_dir}",
        "trackio",
        "show",
        "--project",
        PROJECT,
    ]
    assert demo_run.stored["runs"] == [RUN]  # what that project holds, read from that directory


def test_the_printed_view_command_serves_the_archive(demo_run: DemoRun, tmp_path: Path) -> None:
    """The printed `asynctrace view` command, run as printed (on a free port), serves the archive:
    every sample in the overview and the watched prompt listed first, at every step."""
    pytest.importorskip("duckdb")
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from tests.view._archive import ready
    from tests.view._html import get

    assert demo_run.returncode == 0, demo_run.stdout + demo_run.stderr
    line = _line(demo_run.stdout, "asynctrace view ")
    words = shlex.split(line)
    assert words[:2] == ["asynctrace", "view"] and words[2] == str(demo_run.archive)
    command = [sys.executable, "-m", "asynctrace", *words[1:], "--port", "0"]
    env = dict(demo_run.env, ASYNCTRACE_VIEW_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        started = proc.stdout.readline()
        assert started.startswith("asynctrace view: http://127.0.0.1:"), started
        base = started.split()[2].rstrip("/")
        overview = ready(base)
        assert overview.status == 200
        steps = [b for b in overview.blocks if "data-step" in b.attrs and b.tag == "tr"]
        assert [int(b.values["step"]) for b in steps] == list(range(STEPS))
        assert sum(int(b.values["samples"]) for b in steps) == len(_archived(demo_run))
        watched = overview.html.split('class="prompts watched"')[1].split("</ul>")[0]
        assert f"/prompt?id={WATCHED}" in watched and f"{STEPS} steps, {STEPS * GROUP} samples" in watched
        history = get(base, f"/prompt?id={WATCHED}")
        assert history.status == 200 and list(history.rows("data-step")) == [str(s) for s in range(STEPS)]
        _every_view_has_content(base, overview, steps)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _every_view_has_content(base: str, overview: Any, steps: list[Any]) -> None:
    """From the overview: a step with a zero-signal group marked, that group's completions, a
    tool-using group with its tool turn, and a completion's tokens with their text and both
    log-prob series (the pages the viewer exists for, each with something to show)."""
    from tests.view._html import get

    zero = [b for b in steps if int(b.values["zero_signal"]) > 0]
    assert zero, "no step has a zero-signal group"
    number = zero[0].values["step"]
    step = get(base, f"/step?split=train&step={number}")
    flat = [b.attrs["data-group"] for b in step.blocks if b.tag == "tr" and b.classes == "zero"]
    assert flat and "zero spread" in step.html
    group = get(base, f"/group?split=train&step={number}&group={flat[0]}")
    assert group.status == 200 and "zero spread" in group.html
    assert len([b for b in group.blocks if b.tag == "article"]) == GROUP
    watched = get(base, f"/prompt?id={WATCHED}")
    tokens_link = next(link for link in watched.links if link.startswith("/tokens?"))
    record = get(base, tokens_link.replace("/tokens?", "/record?"))
    assert (
        record.status == 200
        and "calculator" in record.html
        and '<span class="role">tool</span>' in record.html
    )
    tokens = get(base, tokens_link)
    assert tokens.status == 200 and int(tokens.values["tokens"]) > 0
    spans = re.findall(r'<span class="t[^"]*" id="t\d+" title="[^"]*">([^<]*)</span>', tokens.html)
    assert len(spans) == int(tokens.values["tokens"])
    assert (
        "tool_call" in "".join(spans)
        and 'class="disagree"' in tokens.html
        and 'class="lowest"' in tokens.html
    )


def test_without_pyarrow_the_demo_says_what_it_skipped(tmp_path: Path) -> None:
    """With pyarrow missing the demo still runs, to Trackio only, and says what it skipped and how
    to get it; no view command is printed for an archive that was not written."""
    code = (
        "import sys; sys.modules['pyarrow'] = None  # as if it were not installed\n"
        "from asynctrace.cli import main; main(sys.argv[1:])"
    )
    archive = tmp_path / "archive"
    command = [sys.executable, "-c", code, *_demo_command(archive, steps=2), "--no-progress"]
    done = subprocess.run(
        command, env=_env(tmp_path / "trackio"), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Parquet archive skipped (ParquetSink needs pyarrow" in done.stderr
    assert 'parquet     skipped: ParquetSink needs pyarrow: pip install "asynctrace[parquet]"' in done.stdout
    assert 'browse it with asynctrace view: pip install "asynctrace[parquet,view]"' in done.stdout
    assert "asynctrace view " not in done.stdout.replace("browse it with asynctrace view", "")
    assert "trackio     " in done.stdout and "PROBLEM" not in done.stdout
    assert not archive.exists()


def test_demo_rejects_a_cap_below_one_group() -> None:
    """A Trackio cap smaller than a group would keep nothing: a usage error (exit 2)."""
    from click.testing import CliRunner

    from asynctrace.cli import main

    result = CliRunner().invoke(main, ["demo", "--no-progress", "--group-size", "8", "--max-traces", "4"])
    assert result.exit_code == 2 and "--max-traces 4 keeps no group of --group-size 8" in result.output


def test_demo_refuses_an_archive_a_run_already_wrote(tmp_path: Path) -> None:
    """Reusing a run's archive folder would mix two runs in one archive: a usage error (exit 2)."""
    from click.testing import CliRunner

    from asynctrace.cli import main

    (tmp_path / RUN).mkdir()
    (tmp_path / RUN / "old.parquet").write_bytes(b"")
    result = CliRunner().invoke(main, ["demo", "--no-progress", "--run", RUN, "--archive", str(tmp_path)])
    assert result.exit_code == 2 and "already holds a run's archive" in result.output


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
