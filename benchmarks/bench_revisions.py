"""One benchmark, two versions of asynctrace, side by side: is a change a regression?

Runs ``benchmarks/<bench>`` of this tree and of a second source tree (a checkout of the code
before the change, say ``git worktree add ../before <commit>``) alternately, ``--rounds`` times
each, each with its own tree first on ``PYTHONPATH`` (each tree's copy of the benchmark, since
a benchmark may import private modules that moved). The first table of each run's output
is read: every row, by its label cells and its first number (``| variant | us/sample | ...``). Prints,
per row, the median of each version's figures and the ratio of the medians (this tree over
the other): above 1 this tree is slower, for figures where lower is better.

    python benchmarks/bench_revisions.py --base ../before bench_capped.py -- --calls 200
    python benchmarks/bench_revisions.py --base ../before bench_caller_cost.py -- --no-cold
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def figures(output: str) -> dict[str, float]:
    """The first table's rows, each by its label cells (those before its first number) and that
    number: `| variant | us/sample | ... |` and `| sample | inputs | call | us/sample | ... |` alike."""
    rows: dict[str, float] = {}
    for line in output.splitlines():
        if not line.lstrip().startswith("|"):
            if rows:
                break  # the first table ended
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for i, cell in enumerate(cells):
            try:
                value = float(cell.rstrip("x"))
            except ValueError:
                continue
            if i:
                rows[" ".join(cells[:i])] = value
            break
    return rows


def run(tree: Path, bench: str, extra: list[str]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(
        [sys.executable, str(tree / "benchmarks" / bench), *extra],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return figures(done.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="the other source tree (the code before)")
    p.add_argument("--rounds", type=int, default=3, help="alternating runs of each version")
    p.add_argument("bench", help="a script in benchmarks/, e.g. bench_capped.py")
    p.add_argument("extra", nargs="*", help="arguments for the benchmark (after --)")
    args = p.parse_args(argv)
    trees = {"this tree": ROOT, "base": args.base.resolve()}
    got: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    print(f"[start] cpus={os.cpu_count()} loadavg={os.getloadavg()}")
    for i in range(args.rounds):
        order = list(trees.items()) if i % 2 == 0 else list(reversed(trees.items()))
        for name, tree in order:
            for row, value in run(tree, args.bench, args.extra).items():
                got[name].setdefault(row, []).append(value)
    print(f"{args.bench}: median of {args.rounds} alternating runs per version; ratio = this tree / base")
    print("| row | this tree | base | ratio |")
    print("|---|---|---|---|")
    for row, values in got["this tree"].items():
        base = got["base"].get(row)
        if not base:
            continue
        mine, theirs = statistics.median(values), statistics.median(base)
        ratio = mine / theirs if theirs else float("nan")
        print(f"| {row} | {mine:.3f} | {theirs:.3f} | {ratio:.2f}x |")
    print(f"[end] loadavg={os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
