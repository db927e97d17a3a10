"""A run with an archive far behind, a `Selected` tier and a watched prompt, SIGKILLed, then
recovered: the tier ends with exactly what one uninterrupted run would have written."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults import _harness as h
from tests.faults._ack_sinks import uids
from tests.faults._ack_trainer import PER_STEP, STEPS, WATCHED

CHILD = Path(__file__).with_name("_ack_trainer.py")
# The sinks are the test's own: recover makes them only from the factories passed in code.
RECOVER = """
import sys, anyio, asynctrace as at
from tests.faults._ack_sinks import UidFileSink
sinks = {"archive": UidFileSink, "tier": UidFileSink}
report = anyio.run(lambda: at.recover(sys.argv[1], sinks=sinks, progress=False))
print("\\n".join(report.lines()))
raise SystemExit(0 if report.ok else 1)
"""


def _run(mode: str, tmp: Path, sampler: str) -> subprocess.CompletedProcess[str]:
    args = [mode, str(tmp / "spool"), str(tmp / "archive.txt"), str(tmp / "tier.txt"), sampler]
    command = [sys.executable, str(CHILD), *args]
    return subprocess.run(command, env=h.env(), cwd=h.ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("sampler", "replay", "kill"),
    [
        ("top_bottom", "recover", "kill"),
        ("first", "restart", "kill"),
        # Every step closed by a flush before the stragglers: only the closed steps make them late.
        ("top_bottom", "recover", "kill-flushed"),
    ],
)
def test_a_recovered_tier_holds_its_selection_and_the_watched_samples(
    tmp_path: Path, sampler: str, replay: str, kill: str
) -> None:
    """Killed while the archive lags: replayed by `asynctrace.recover` (the sinks passed in code;
    the command line keeps their records) or a restarted session,
    each sink gets only what it lacked; the tier holds, in every step, the watched sample and
    exactly its own selection of the rest, each once (stragglers of a step it had closed or
    filled before the kill left out, as one uninterrupted run would); the archive every sample."""
    killed = _run(kill, tmp_path, sampler)
    assert killed.returncode == -9, killed.stderr
    if replay == "recover":
        spool = str(tmp_path / "spool")
        if kill == "kill":
            # The command line makes no sink of the test's own: the records stay for the call below.
            held = h.recover(spool)
            assert held.returncode == 1, held.stdout + held.stderr
            assert "made only when you pass it in code" in held.stdout, held.stdout
        command = [sys.executable, "-c", RECOVER, spool]
        result = subprocess.run(command, env=h.env(), cwd=h.ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "sinks: archive, tier" in result.stdout, result.stdout
    else:
        restarted = _run("restart", tmp_path, sampler)
        assert restarted.returncode == 0, restarted.stderr

    tier = collections.Counter(uids(tmp_path / "tier.txt"))
    assert not [u for u, n in tier.items() if n > 1], f"written twice to the tier: {tier}"
    by_step: dict[int, set[int]] = collections.defaultdict(set)
    for uid in tier:
        step, i = uid.split(":")
        by_step[int(step)].add(int(i))
    # The reward is the index: top_bottom keeps the two lowest and two highest, first the first 4.
    selection = {0, 1, PER_STEP - 2, PER_STEP - 1} if sampler == "top_bottom" else {0, 1, 2, 3}
    want = {step: selection | {WATCHED} for step in range(STEPS)}
    assert dict(by_step) == want
    archive = set(uids(tmp_path / "archive.txt"))
    assert archive == {f"{s}:{i}" for s in range(STEPS) for i in range(PER_STEP)} | {"3:16", "3:17"}
