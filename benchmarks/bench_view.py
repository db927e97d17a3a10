"""`asynctrace view` on a large archive: start time and the time each page takes to answer.

Builds a Parquet archive of each ``--rows`` count (default 1,000,000) through a real
``TraceSession`` with a ``ParquetSink``: GRPO-style groups of 8 completions, 512 groups a step,
prompt ids drawn from a pool of 5,000 (so each prompt recurs across steps), policy-version lag,
truncations, and token-level fields (512 tokens of ids, loss mask, log-probs and advantages) on
one record in 64; the sink writes each file's sidecars (the viewer's index rows, their
summaries and words).
``--archive DIR ...`` (one per count) keeps each there and reuses it on the next run; an archive
without sidecars (written before them, or of an older version) measures the viewer reading the
files instead. The
archives are measured one after another and printed side by side, each figure's growth from the
first to the last, the goals (set for 10,000,000 rows) judged on the largest.

Then runs ``asynctrace view`` itself (the command, in a subprocess) twice: with an empty index
cache (the first open of an archive) and with the cache the first run left (every later
start). Each time: seconds until it listens, until the overview answers (a later start answers it
from the summary the first kept; a first open, from the sidecars' summaries), and until every page
answers (the index read); for the first, also until its text index is built (the find page says
so until then), and until the archive's by-prompt index it writes last covers every file (the
second start reads it; a viewer that writes none: NaN). On the second
server it times every view over HTTP, ``--repeat`` times each, after one untimed request;
the figure is the median, and the slowest is printed too. Side by side, in the same run, it
answers the overview's, a step's and a prompt's questions and each search by text with one
DuckDB query each straight on the files (what one would type without the viewer; for a search,
what the viewer did before its text index) and prints the ratios (``--no-direct``: not). Each
server's own peak RSS is read from its process (Linux ``VmHWM``) before it stops.

    python benchmarks/bench_view.py --archive /tmp/view-1m
    python benchmarks/bench_view.py --rows 1000000 10000000 --archive /tmp/view-1m /tmp/view-10m --no-direct
    python benchmarks/bench_view.py --quick
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from asynctrace.sinks._parquet_sidecar import SIDECAR_FOLDER

# Goals at 10,000,000 rows (judged on the largest archive measured).
GOAL_MS = 300.0
FIRST_OPEN_GOAL_S = 3.0
TEXT_GOAL_S = 15.0
RSS_GOAL_MIB = 1024.0
GROUP = 8
GROUPS_PER_STEP = 512
PROMPTS = 5_000
_WORDS = (  # noqa: SIM905 - a readable word list
    "the of and to in is that for it as with was on be by this are or at from which an not have has all "
    "reward policy gradient token sequence value advantage rollout prompt answer step proof therefore "
    "compute integer prime divisor equation solve check result let because hence first then so we get"
).split()


def _fragments(rng: random.Random, count: int, words: int) -> list[str]:
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) + "." for _ in range(count)]


def build(directory: Path, rows: int, seed: int = 0) -> None:
    """Write `rows` records (rounded down to whole steps) through a session into `directory`."""
    import anyio

    import asynctrace as at

    rng = random.Random(seed)
    pieces = _fragments(rng, 4096, 24)  # three of these make one completion of about 0.5 KB
    questions = [f"Problem {i}: " + " ".join(rng.sample(pieces, 2)) for i in range(PROMPTS)]
    per_step = GROUP * GROUPS_PER_STEP
    steps = max(1, rows // per_step)

    async def main() -> None:
        sink = at.ParquetSink(directory)
        async with at.TraceSession("bench-view", run="grpo", sinks=[sink], health_metrics=False) as session:
            for step in range(steps):
                batch = []
                for g in range(GROUPS_PER_STEP):
                    prompt = rng.randrange(PROMPTS)
                    version = step - rng.choice((0, 0, 1, 2))
                    p = 1 / (1 + 2.0 ** (-(step / steps * 6 - 3 + (prompt % 7 - 3) / 2)))
                    rewards = [float(rng.random() < p) for _ in range(GROUP)]
                    mean = sum(rewards) / GROUP
                    std = (sum((r - mean) ** 2 for r in rewards) / GROUP) ** 0.5
                    for i, reward in enumerate(rewards):
                        truncated = rng.random() < 0.05
                        text = " ".join(rng.sample(pieces, 3)) + (" The answer is 42." if reward else "")
                        length = 512 if truncated else rng.randrange(60, 400)
                        advantage = round((reward - mean) / (std + 1e-4), 4)
                        tokens = None
                        if (g * GROUP + i) % 64 == 0:
                            tokens = {
                                "token_ids": [rng.randrange(50_000) for _ in range(512)],
                                "loss_mask": [0] * 64 + [1] * 448,
                                "logprobs": [-rng.expovariate(3.0) for _ in range(512)],
                                "advantages": [advantage] * 512,
                            }
                        batch.append(
                            at.Sample(
                                messages=[
                                    {"role": "system", "content": "You are a careful math tutor."},
                                    {"role": "user", "content": questions[prompt]},
                                    {"role": "assistant", "content": text},
                                ],
                                metadata={
                                    "prompt_id": f"p{prompt:05d}",
                                    "group_uid": f"{step}-{g}",
                                    "sample_index": i,
                                    "reward": reward,
                                    "advantage": advantage,
                                    "policy_version": version,
                                    "stop_reason": "length" if truncated else "stop",
                                    "response_len": length,
                                    "prompt_len": 96,
                                    "dataset": "gsm8k",
                                    "reward_breakdown": {"correct": reward, "format": 0.1},
                                },
                                tokens=tokens,
                            )
                        )
                for k in range(0, len(batch), 256):
                    await session.log_samples(batch[k : k + 256], step=step)
        assert session.stats().check()

    anyio.run(main)


class Server:
    """`asynctrace view` in a subprocess: seconds until it listens, and until it has indexed."""

    def __init__(self, archive: Path, cache: Path) -> None:
        env = dict(os.environ, ASYNCTRACE_VIEW_CACHE=str(cache))
        self.started = started = time.perf_counter()
        cmd = [sys.executable, "-m", "asynctrace", "view", str(archive), "--port", "0"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"(http://\S+?)/?\s", line)
        if not found:
            self.close()
            raise SystemExit(f"asynctrace view did not start: {line!r}")
        self.url = found.group(1)
        self.listening = time.perf_counter() - started
        while fetch(self.url + "/")[0] == 503:
            time.sleep(0.01)
        self.indexed = time.perf_counter() - started
        # The overview may answer from a kept summary before the index is read: every page
        # answers once it is.
        while fetch(self.url + "/step?split=train&step=0")[0] == 503:
            time.sleep(0.01)
        self.ready = time.perf_counter() - started

    def peak_rss(self) -> float:
        """The server process's own peak resident memory so far, in MiB (Linux: VmHWM)."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return math.nan
        found = re.search(r"VmHWM:\s+(\d+) kB", status)
        return int(found.group(1)) / 1024 if found else math.nan

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def fetch(url: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(request, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def timed(call: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """(median, slowest) milliseconds of `repeat` calls, after one untimed call."""
    call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), max(times)


def one(sql: str, *params: Any) -> Any:
    """The first value of a DuckDB query's first row."""
    import duckdb

    return duckdb.execute(sql, list(params)).fetchall()[0][0]


def _pages(archive: Path) -> dict[str, str]:
    """One address of each view, picked from the archive with DuckDB."""
    files = str(archive / "*.parquet")
    step = one(f"SELECT median(step)::BIGINT FROM '{files}'")
    group = one(
        f"SELECT json_extract_string(metadata, '$.group_uid') FROM '{files}' WHERE step = ? LIMIT 1", step
    )
    prompt = one(
        f"SELECT json_extract_string(metadata, '$.prompt_id') AS p FROM '{files}' "
        "GROUP BY p ORDER BY count(*) DESC LIMIT 1"
    )
    with_tokens = one(f"SELECT id FROM '{files}' WHERE step = ? AND token_ids IS NOT NULL LIMIT 1", step)
    record = one(f"SELECT id FROM '{files}' WHERE step = ? LIMIT 1 OFFSET 7", step)
    lowest_mean = {"split": "train", "step": step, "order": "-mean"}
    return {
        "overview": "/",
        "step, by spread": "/step?" + urlencode({"split": "train", "step": step}),
        "step, by mean (lowest first)": "/step?" + urlencode(lowest_mean),
        "group": "/group?" + urlencode({"split": "train", "step": step, "group": group}),
        "prompt history": "/prompt?" + urlencode({"id": prompt}),
        "tokens": "/tokens?" + urlencode({"id": with_tokens}),
        "record": "/record?" + urlencode({"id": record}),
        "find by id": "/find?" + urlencode({"id": record}),
        "find by reward range": "/find?" + urlencode({"low": 0.5, "high": 1.0}),
        "find by text, no match": "/find?" + urlencode({"q": "zebra crossing"}),
        # One prompt's question: in about 200 records spread over the run's steps.
        "find by text, a prompt's question": "/find?" + urlencode({"q": f"problem {int(prompt[1:])}:"}),
        "find by text, a word in most records": "/find?" + urlencode({"q": "Therefore"}),
    }


def direct_queries(archive: Path, page: dict[str, str]) -> dict[str, Callable[[], Any]]:
    """The overview's, a step's and a prompt's questions as one DuckDB query each on the files."""
    import duckdb

    files = str(archive / "*.parquet")
    con = duckdb.connect()
    step = int(re.search(r"step=(\d+)", page["step, by spread"]).group(1))  # type: ignore[union-attr]
    prompt = re.search(r"id=([^&]+)", page["prompt history"]).group(1)  # type: ignore[union-attr]
    overview = f"""
        WITH r AS (SELECT split, step, reward, stop_reason, policy_version,
                          json_extract(metadata, '$.response_len')::BIGINT AS n,
                          json_extract_string(metadata, '$.group_uid') AS g FROM '{files}'),
        s AS (SELECT split, step, g, stddev_pop(reward) AS sd FROM r GROUP BY ALL)
        SELECT split, step, count(*), avg(reward), stddev_pop(reward), avg((stop_reason = 'length')::INT),
               avg(n), avg(step - policy_version),
               (SELECT count(*) FILTER (WHERE sd = 0) FROM s WHERE s.step = r.step AND s.split = r.split)
        FROM r GROUP BY split, step"""
    groups = f"""
        SELECT json_extract_string(metadata, '$.group_uid') AS g, count(*), avg(reward), stddev_pop(reward)
        FROM '{files}' WHERE step = {step} AND split = 'train' GROUP BY g ORDER BY 4 DESC"""
    history = f"""
        SELECT step, policy_version, reward, messages FROM '{files}'
        WHERE json_extract_string(metadata, '$.prompt_id') = '{prompt}' ORDER BY step"""
    queries: dict[str, Callable[[], Any]] = {
        "overview": lambda: con.sql(overview).fetchall(),
        "step, by spread": lambda: con.sql(groups).fetchall(),
        "prompt history": lambda: con.sql(history).fetchall(),
    }
    # A search by text as one query (and as the viewer did before its text index): every message read.
    for name, path in page.items():
        if name.startswith("find by text"):
            text = parse_qs(urlsplit(path).query)["q"][0]
            search = (
                f"SELECT id FROM '{files}' WHERE regexp_matches(messages, $p) ORDER BY step, id LIMIT 100"
            )
            pattern = {"p": "(?i)" + re.escape(text)}
            queries[name] = lambda search=search, pattern=pattern: con.execute(search, pattern).fetchall()
    return queries


@dataclass
class Measured:
    """One archive's figures: its size, both starts, each page (median, slowest ms), the same
    questions as one DuckDB query each (median, slowest ms), and each server's peak RSS (MiB)."""

    rows: int
    files: int
    mib: float
    load: float
    cold: Server
    warm: Server
    text_ready: float
    index_ready: float
    cold_rss: float
    warm_rss: float
    pages: dict[str, tuple[float, float]]
    direct: dict[str, tuple[float, float]]


def measure(archive: Path, repeat: int, scratch: Path, direct: bool) -> Measured:
    """Both starts of `asynctrace view` on `archive`, then every page of the second, timed."""
    files = str(archive / "*.parquet")
    rows = one(f"SELECT count(*) FROM '{files}'")
    parts = list(archive.glob("*.parquet"))
    size = sum(p.stat().st_size for p in parts) / 2**20
    sidecars = sum(p.stat().st_size for p in (archive / SIDECAR_FOLDER).glob("*.parquet")) / 2**20
    load = os.getloadavg()[0]
    print(
        f"archive: {rows:,} rows in {len(parts)} files, {size:.0f} MiB, sidecars {sidecars:.0f} MiB; "
        f"load average {load:.1f}",
        flush=True,
    )
    cache = scratch / f"cache-{rows}"
    cold = Server(archive, cache)
    # The index is kept once the pages are ready (where the sink's sidecars do not hold it),
    # then the text index is built: the find page says so until it is whole.
    try:
        while b'data-k="text-index"' in fetch(cold.url + "/find")[1]:
            time.sleep(0.05)
        text_ready = time.perf_counter() - cold.started
        # Then the archive's by-prompt index, which a first open writes last (`index_prompts`),
        # and which a later start reads: the first server's memory includes its writing.
        index_ready = _prompt_index_written(archive, parts, cold.started)
        cold_rss = cold.peak_rss()
    finally:
        cold.close()
    warm = Server(archive, cache)
    try:
        page = _pages(archive)
        results = {
            name: timed(lambda path=path: fetch(warm.url + path), repeat) for name, path in page.items()
        }
        warm_rss = warm.peak_rss()
    finally:
        warm.close()
    # The benchmark's own queries run in this process, after the server has gone: its RSS is its own.
    answers = (
        {name: timed(call, repeat) for name, call in direct_queries(archive, page).items()} if direct else {}
    )
    return Measured(
        rows,
        len(parts),
        size,
        load,
        cold,
        warm,
        text_ready,
        index_ready,
        cold_rss,
        warm_rss,
        results,
        answers,
    )


def _prompt_index_written(archive: Path, parts: list[Path], started: float, seconds: float = 300.0) -> float:
    """Seconds from the server's start until the archive's by-prompt index covers every file
    with sidecars (NaN for a viewer that writes none, for fewer than two such files, which get
    none, or past `seconds`)."""
    try:
        import duckdb

        from asynctrace.view import _prompt_index
    except ImportError:
        return math.nan
    held = sum((archive / SIDECAR_FOLDER / f"{p.name}.index.parquet").is_file() for p in parts)
    deadline = time.perf_counter() + seconds
    while held >= 2 and time.perf_counter() < deadline:
        found = _prompt_index.read(duckdb.connect(), archive)
        if found is not None and len(found.covered) >= held:
            return time.perf_counter() - started
        time.sleep(0.5)
    return math.nan


def _cells(values: list[float], unit: str, goal: float | None, digits: int = 0) -> str:
    cells = [f"{v:,.{digits}f} {unit}" for v in values]
    if goal is None:
        return " | ".join(cells) + " | —"
    verdict = "met" if values[-1] <= goal else "not met"
    return " | ".join(cells) + f" | ≤ {goal:,.{digits}f} {unit}: {verdict}"


def report(measured: list[Measured]) -> bool:
    """Print the archives side by side, the goals judged on the largest; whether all are met."""
    names = " | ".join(f"{m.rows:,} rows" for m in measured)
    growth = len(measured) > 1
    print(f"\n| | {names} | goal (largest) |" + (" growth |" if growth else ""))
    print("|---|" + "---|" * len(measured) + "---|" + ("---|" if growth else ""))
    met = True

    def row(label: str, values: list[float], unit: str, goal: float | None, digits: int = 0) -> None:
        nonlocal met
        if goal is not None:
            met &= values[-1] <= goal
        extra = f" {values[-1] / values[0]:.1f}x |" if growth and values[0] else (" — |" if growth else "")
        print(f"| {label} | {_cells(values, unit, goal, digits)} |{extra}")

    row("archive on disk", [m.mib for m in measured], "MiB", None)
    row("first open: overview answers", [m.cold.indexed for m in measured], "s", FIRST_OPEN_GOAL_S, 2)
    row("first open: every page answers", [m.cold.ready for m in measured], "s", None, 2)
    row("first open: text index built and kept", [m.text_ready for m in measured], "s", TEXT_GOAL_S, 1)
    row("first open: archive's by-prompt index written", [m.index_ready for m in measured], "s", None, 1)
    row("later start: overview answers", [m.warm.indexed for m in measured], "s", None, 2)
    row("later start: every page answers", [m.warm.ready for m in measured], "s", None, 2)
    row("server peak RSS, first open", [m.cold_rss for m in measured], "MiB", RSS_GOAL_MIB)
    row("server peak RSS, later start and every page", [m.warm_rss for m in measured], "MiB", RSS_GOAL_MIB)
    for name in measured[0].pages:
        row(name, [m.pages[name][0] for m in measured], "ms", GOAL_MS)
    print(
        "\npages: median of the repeats; slowest of each: "
        + "; ".join(f"{m.rows:,} rows {max(v[1] for v in m.pages.values()):.0f} ms" for m in measured)
    )
    print("load average at each start: " + ", ".join(f"{m.load:.1f}" for m in measured))
    for m in measured:
        for name, (median, _) in m.direct.items():
            print(
                f"{m.rows:,} rows, {name}: one DuckDB query on the files {median:.0f} ms, "
                f"the page {m.pages[name][0]:.0f} ms ({median / m.pages[name][0]:.1f}x)"
            )
    return met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000])
    parser.add_argument(
        "--archive",
        type=Path,
        nargs="+",
        help="keep each archive here, one per --rows (built when it holds none)",
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="20,480 rows, 3 repeats")
    parser.add_argument(
        "--no-direct", action="store_true", help="skip the DuckDB queries straight on the files"
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is not met")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.repeat = [20_480], 3
    if args.archive and len(args.archive) != len(args.rows):
        parser.error("give one --archive per --rows")
    scratch = Path(tempfile.mkdtemp(prefix="asynctrace-bench-view-"))
    try:
        import duckdb

        print(f"machine: {os.cpu_count()} CPUs, duckdb {duckdb.__version__}")
        measured = []
        for k, rows in enumerate(args.rows):
            archive = args.archive[k] if args.archive else scratch / f"archive-{rows}"
            if not list(archive.glob("*.parquet")):
                started = time.perf_counter()
                build(archive, rows)
                print(f"built the archive of {rows:,} rows in {time.perf_counter() - started:.1f} s")
            measured.append(measure(archive, args.repeat, scratch, not args.no_direct))
        met = report(measured)
        return 1 if not met and args.strict else 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
