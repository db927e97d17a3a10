"""Every script in `examples/` that runs in one process runs to its end, as its docstring says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# These two need a launcher: torchrun's ranks, a Ray cluster. What they do runs in
# tests/distributed/ (test_torch_distributed.py, test_ray.py) with the same classes.
LAUNCHED = {"torchrun_global_reduce", "ray_rollout_actors"}
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py") if p.stem not in LAUNCHED)


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """Run them all once, in one child process (see tests/_examples_runner.py)."""
    work = tmp_path_factory.mktemp("examples")
    out = work / "results.json"
    subprocess.run(
        [sys.executable, "-m", "tests._examples_runner", str(out), *EXAMPLES],
        cwd=ROOT,
        # The examples' working directories (and what they write there) go under pytest's own.
        env={**os.environ, "TMPDIR": str(work)},
        timeout=300,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    results: dict[str, dict[str, object]] = json.loads(out.read_text()) if out.exists() else {}
    return results


def test_every_example_is_listed_here_or_run() -> None:
    """No example is left out but the two that need a launcher."""
    assert len(EXAMPLES) + len(LAUNCHED) == len(list((ROOT / "examples").glob("*.py")))
    assert all((ROOT / "examples" / f"{name}.py").exists() for name in LAUNCHED)


# The first test also waits for `ran`, the runner's 300 s at most: a loaded machine (two xdist
# workers beside other work) took over the suite's default 120 s for it.
@pytest.mark.timeout(360)
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_to_its_end(ran: dict[str, dict[str, object]], name: str) -> None:
    """The example ran without an error (see its docstring for what it shows)."""
    assert name in ran, f"examples/{name}.py never finished (the runner stopped before it)"
    assert ran[name]["error"] is None, f"examples/{name}.py failed:\n{ran[name]['error']}"
