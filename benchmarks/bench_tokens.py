"""`asynctrace view`'s token page on one long completion: server time a window, and browser load.

Builds a Parquet archive holding one completion of ``--tokens`` response tokens (default 131,072,
the longest frontier runs generate) with every token field a trainer logs (ids, loss mask,
log-probs of the rollout engine and of the trainer, entropy, advantages), decoded by
``decode_rollouts`` with a byte-level BPE tokenizer (so it has ``text_ends``), beside seven short
members of its group, through a real ``TraceSession`` and ``ParquetSink``. ``--archive DIR`` keeps
it there and reuses it on the next run.

Then, with ``asynctrace view`` in a subprocess:

- ``read whole``: the archive's read of the record (``Archive.tokens`` and ``Archive.record``, in
  this process: every token array and the messages, which the page's first window needs for its
  figures and map);
- server, over HTTP: the first window of the record (the server reads it), then every window
  (``--windows`` of them, spread over the completion), a jump to a listed token (``at=``), and
  another signal; the median, the slowest, and the page's size;
- browser (the machine's Chromium, headless, through Playwright, once it has shown the
  overview): the page's load event after navigation (and when its response ended), for the
  first window (the server reading the record first: a fresh server), for the next windows
  clicked through, and for jumps to the listed tokens; the medians and the slowest.

    python benchmarks/bench_tokens.py --archive /tmp/tokens-131k
    python benchmarks/bench_tokens.py --quick
"""

from __future__ import annotations

import argparse
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
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

SERVER_GOAL_MS = 300.0
BROWSER_GOAL_MS = 1000.0
_WORDS = (  # noqa: SIM905 - a readable word list
    "the of and to in is that for it as with was on be by this are or at from which an not have has "
    "reward policy gradient token sequence value advantage rollout prompt answer step proof therefore "
    "compute integer prime divisor equation solve check result let because hence first then so we get "
    "café naïve 你好 🙂 = + - * / ( ) < > { } \n"
).split(" ")


def build(directory: Path, tokens: int, seed: int = 0) -> str:
    """Write the archive into `directory`; returns the long completion's record id."""
    import anyio

    import asynctrace as at
    from asynctrace.rollouts import decode_rollouts, toy_tokenizer

    tokenizer = toy_tokenizer()
    rng = random.Random(seed)
    prompt = tokenizer.encode("Prove that there are infinitely many primes. Think step by step.").ids
    response: list[int] = []
    while len(response) < tokens:
        text = " ".join(rng.choice(_WORDS) for _ in range(20_000))
        response += tokenizer.encode(text).ids
    rows = [prompt + response[:tokens]]
    masks = [[0] * len(prompt) + [1] * tokens]
    for _ in range(7):
        short = tokenizer.encode(" ".join(rng.choice(_WORDS) for _ in range(60))).ids
        rows.append(prompt + short)
        masks.append([0] * len(prompt) + [1] * len(short))

    def series(row: list[int], low: float) -> tuple[list[float], list[float]]:
        logprobs = [-rng.expovariate(3.0) if rng.random() > 0.01 else -rng.uniform(3, low) for _ in row]
        ref = [
            lp + (rng.gauss(0, 0.02) if rng.random() > 0.002 else rng.uniform(-1.5, 1.5)) for lp in logprobs
        ]
        return logprobs, ref

    pairs = [series(row, 9.0) for row in rows]
    samples = decode_rollouts(
        rows,
        tokenizer=tokenizer,
        loss_mask=masks,
        rewards=[1.0] + [float(rng.random() < 0.5) for _ in range(7)],
        metadata={"group_uid": "long-group", "prompt_id": "primes"},
        token_fields={
            "token_ids": rows,
            "loss_mask": masks,
            "logprobs": [p[0] for p in pairs],
            "ref_logprobs": [p[1] for p in pairs],
            "entropy": [[rng.expovariate(1.0) for _ in row] for row in rows],
            "advantages": [[0.7] * len(row) for row in rows],
        },
    )

    async def main() -> None:
        sink = at.ParquetSink(directory)
        async with at.TraceSession(
            "bench-tokens", run="long", sinks=[sink], health_metrics=False, max_queue_bytes=256 * 2**20
        ) as session:
            await session.log_samples(samples, step=0)
        assert session.stats().check() and session.stats().written == len(samples)

    anyio.run(main)
    return long_record(directory)


def long_record(directory: Path) -> str:
    import duckdb

    files = str(directory / "*.parquet")
    found = duckdb.execute(f"SELECT id FROM '{files}' ORDER BY len(token_ids) DESC LIMIT 1").fetchone()
    assert found is not None
    return str(found[0])


class Server:
    """`asynctrace view` in a subprocess, once it has indexed its archive."""

    def __init__(self, archive: Path, cache: Path) -> None:
        env = dict(os.environ, ASYNCTRACE_VIEW_CACHE=str(cache))
        cmd = [sys.executable, "-m", "asynctrace", "view", str(archive), "--port", "0"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        found = re.search(r"(http://\S+?)/?\s", self.proc.stdout.readline())
        if not found:
            self.close()
            raise SystemExit("asynctrace view did not start")
        self.url = found.group(1)
        while fetch(self.url + "/step?step=0")[0] == 503:
            time.sleep(0.01)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def fetch(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def page(record: str, **params: Any) -> str:
    return "/tokens?" + urlencode({"id": record, **params})


def timed_get(base: str, path: str) -> tuple[float, int]:
    """Milliseconds to fetch `path` whole, and its size; fails on anything but 200."""
    start = time.perf_counter()
    status, body = fetch(base + path)
    elapsed = (time.perf_counter() - start) * 1000
    if status != 200:
        raise SystemExit(f"{path}: {status} {body[:300]!r}")
    return elapsed, len(body)


def read_whole(archive: Path, record: str, repeat: int) -> list[float]:
    """Milliseconds of the archive's read of the record (its arrays and its messages), in process."""
    from asynctrace.view._archive import Archive

    store = Archive(archive)
    store.load(keep=False)
    store.complete_tokens()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fields = store.tokens(record)
        found = store.record(record)
        times.append((time.perf_counter() - start) * 1000)
        assert fields and found is not None
    return times


def browse(base: str, record: str, chromium: str, windows: int) -> dict[str, list[float]]:
    """Load event (ms after navigation starts) of the first window (and when its response
    ended), then of the next windows clicked through and of jumps to listed tokens, in headless
    Chromium, once it has shown the overview (the browser's own start is not the page's)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from screenshots import headless_chromium

    out: dict[str, list[float]] = {
        "first window, load event": [],
        "first window, end of its response": [],
        "next window (click), load event": [],
        "jump to a listed token, load event": [],
    }

    def loaded(tab: Any, what: str = "loadEventEnd") -> float:
        return float(tab.evaluate(f"performance.getEntriesByType('navigation')[0].{what}"))

    with headless_chromium(chromium) as browser:
        tab = browser.new_page()
        tab.goto(base + "/")
        tab.goto(base + page(record))
        out["first window, load event"].append(loaded(tab))
        out["first window, end of its response"].append(loaded(tab, "responseEnd"))
        for _ in range(windows):
            with tab.expect_navigation():
                tab.locator("a.next").first.click()
            out["next window (click), load event"].append(loaded(tab))
        for item in tab.locator("ol.disagree li a").all()[:windows]:
            href = item.get_attribute("href")
            assert href
            tab.goto(base + href)
            out["jump to a listed token, load event"].append(loaded(tab))
    return out


def _row(name: str, values: list[float], goal: float | None, extra: str = "") -> str:
    median, slowest = statistics.median(values), max(values)
    verdict = "" if goal is None else ("ok" if slowest < goal else "OVER")
    return f"| {name} | {len(values)} | {median:.0f} | {slowest:.0f} | {extra} | {verdict} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=131_072, help="response tokens of the long completion")
    parser.add_argument("--archive", type=Path, help="keep the archive here and reuse it")
    parser.add_argument("--windows", type=int, default=12, help="windows timed over HTTP and in the browser")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--no-browser", action="store_true", help="time the server only")
    parser.add_argument("--quick", action="store_true", help="8,192 tokens, 3 windows")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is not met")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.windows = 8192, 3
    tmp = Path(tempfile.mkdtemp(prefix="bench-tokens-"))
    try:
        archive = args.archive or tmp / "archive"
        if archive.is_dir() and any(archive.glob("*.parquet")):
            record = long_record(archive)
        else:
            started = time.perf_counter()
            record = build(archive, args.tokens)
            print(f"built the archive in {time.perf_counter() - started:.1f} s: {archive}")
        import duckdb

        count = duckdb.execute(
            f"SELECT len(token_ids) FROM '{archive}/*.parquet' WHERE id = ?", [record]
        ).fetchone()
        assert count is not None
        total = int(count[0])
        size = sum(f.stat().st_size for f in archive.glob("*.parquet"))
        print(
            f"record {record}: {total:,} tokens; archive {size / 2**20:.1f} MB; "
            f"load average {os.getloadavg()[0]:.1f}"
        )

        whole = read_whole(archive, record, 5)
        server = Server(archive, tmp / "cache")
        try:
            first, first_size = timed_get(server.url, page(record))
            starts = sorted({(k * total // args.windows) // 1024 * 1024 for k in range(args.windows)})
            windows = [timed_get(server.url, page(record, start=s)) for s in starts]
            jumps = [timed_get(server.url, page(record, at=(k * 7919) % total)) for k in range(args.windows)]
            signals = [
                timed_get(server.url, page(record, start=s, signal=name))
                for s, name in zip(
                    starts, ["difference", "entropy", "loss_mask", "ref_logprobs"] * 99, strict=False
                )
            ]
        finally:
            server.close()
        browser: dict[str, list[float]] = {}
        if not args.no_browser:
            fresh = Server(archive, tmp / "cache")  # its first page reads the record, as a first open does
            try:
                browser = browse(fresh.url, record, args.chromium, min(args.windows, 8))
            finally:
                fresh.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    kb = statistics.median(size for _, size in windows) / 1024
    print("\n| what | n | median ms | slowest ms | | goal |")
    print("|---|---|---|---|---|---|")
    print(_row("read whole: the record's arrays and messages (in process)", whole, SERVER_GOAL_MS))
    print(
        _row(
            "server: first window (reads the record)", [first], SERVER_GOAL_MS, f"{first_size / 1024:.0f} KB"
        )
    )
    print(_row("server: a window", [t for t, _ in windows], SERVER_GOAL_MS, f"{kb:.0f} KB"))
    print(_row("server: a jump to a token (at=)", [t for t, _ in jumps], SERVER_GOAL_MS))
    print(_row("server: a window, another signal", [t for t, _ in signals], SERVER_GOAL_MS))
    for name, values in browser.items():
        if values:
            print(_row(f"browser: {name}", values, BROWSER_GOAL_MS))
    slow = [
        max(whole) >= SERVER_GOAL_MS,
        first >= SERVER_GOAL_MS,
        max(t for t, _ in windows + jumps + signals) >= SERVER_GOAL_MS,
        any(max(v) >= BROWSER_GOAL_MS for v in browser.values() if v),
    ]
    return 1 if args.strict and any(slow) else 0


if __name__ == "__main__":
    sys.exit(main())
