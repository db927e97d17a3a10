"""Shared helpers for the benchmarks: sample builders, Trackio checks and table printing.

Every benchmark sets ``TRACKIO_DIR`` to a fresh temporary directory *before* importing this
module (Trackio reads it at import time); this module imports trackio and asynctrace lazily
so that importing it early can never pin the wrong directory.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import mmap
import os
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import orjson

__all__ = [
    "SIZES",
    "cleanup_trackio_dir_at_exit",
    "count_jsonl_lines",
    "count_trackio_traces",
    "fmt_ratio",
    "percentile",
    "prefault",
    "print_machine",
    "print_table",
    "quiet",
    "project_name",
    "sample_body",
    "sample_bodies",
    "stderr_to_log",
    "to_samples",
    "to_traces",
]

# Named sample sizes (target encoded JSON size of one sample, bytes).
SIZES: dict[str, int] = {"2.5KB": 2_560, "32KB": 32_768}

_WORDS = (  # noqa: SIM905 - a readable word list
    "the of and to in is that for it as with was on be by this are or at from which an not "
    "have has but all were they one their can if there been its also we more when will would "
    "so these no about into than them only other then some could two like what first time "
    "reward policy gradient token sequence value advantage rollout prompt answer step proof "
    "therefore compute integer prime divisor equation solve check result let because hence"
).split()


def make_sampler(name: str) -> Any:
    """The `sampler=` argument bench_capped.py and call_path.py give a sampler's name:
    "group" is the group sampler with `group_size=8`, "group_unsized" without it."""
    import asynctrace as at

    if name == "group":
        return at.GroupSampler("top_bottom", stat="mean", group_size=8)
    if name == "group_unsized":
        return at.GroupSampler("top_bottom", stat="mean")
    return name


def cleanup_trackio_dir_at_exit() -> None:
    """Remove this run's temporary TRACKIO_DIR when the interpreter exits."""
    path = os.environ.get("TRACKIO_DIR")
    if path and os.path.basename(path).startswith("asynctrace-bench-"):
        atexit.register(shutil.rmtree, path, ignore_errors=True)


def run_main(
    main_async: Callable[[argparse.Namespace], Awaitable[int]],
    parse_args: Callable[[list[str] | None], argparse.Namespace],
    argv: list[str] | None = None,
) -> int:
    """A benchmark's entry point: parse `argv` and run `main_async` on anyio, with Trackio's
    banners and the writer's stderr hidden unless ``--verbose``; the Trackio directory is
    removed at exit."""
    import anyio

    cleanup_trackio_dir_at_exit()
    args = parse_args(argv)
    with stderr_to_log(not args.verbose):
        return anyio.run(main_async, args)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence Trackio's progress prints (``* Trackio project initialized`` ...) on stdout."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


@contextlib.contextmanager
def stderr_to_log(enabled: bool = True) -> Iterator[None]:
    """Send fd 2 (this process's and any child's it starts meanwhile, such as Trackio's writer
    process and its banners) to a log file; its tail is printed if the body raises."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed below
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        yield
    except BaseException:
        sys.stderr.flush()
        os.dup2(saved, 2)
        log.seek(0)
        tail = log.read().decode(errors="replace").splitlines()[-40:]
        print("\n".join(["--- stderr (last 40 lines) ---", *tail]), file=sys.stderr)
        raise
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        log.close()


def print_machine(when: str) -> None:
    """One line on the conditions: cores and load average (the machine may be shared)."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"[{when}] cpus={os.cpu_count()} loadavg(1/5/15 min)={load}", flush=True)


def prefault(megabytes: int) -> None:
    """Touch `megabytes` of fresh memory and free it.

    On a VM whose guest memory is backed lazily by the host, the first touch of a page costs
    several times a normal page fault; a long-running trainer paid that long ago. Both
    variants of a benchmark run after this warm-up, so neither pays it.
    """
    if megabytes <= 0:
        return
    size = megabytes * 2**20
    with mmap.mmap(-1, size) as m:
        for offset in range(0, size, mmap.PAGESIZE):
            m[offset] = 1


def project_name(tag: str) -> str:
    """A Trackio project name no other run uses."""
    return f"bench-{tag}-{uuid.uuid4().hex[:8]}"


def _text(rng: random.Random, nbytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < nbytes:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:nbytes]


def sample_body(i: int, size: int, *, seed: int = 0) -> dict[str, Any]:
    """One chat sample (system + user prompt, assistant response) and RL metadata whose
    orjson encoding (``{"messages": ..., "metadata": ...}``) is about `size` bytes."""
    rng = random.Random(seed * 1_000_003 + i)
    metadata: dict[str, Any] = {
        "reward": round(rng.random(), 4),
        "advantage": round(rng.gauss(0.0, 1.0), 4),
        "stop_reason": rng.choice(["stop", "length"]),
        "dataset": "gsm8k",
        "prompt_index": i // 8,
        "sample_index": i % 8,
        "policy_version": 3,
    }
    system = {"role": "system", "content": "You are a careful math tutor. Think step by step."}
    skeleton = {
        "messages": [system, {"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
        "metadata": {**metadata, "prompt_len": 0, "response_len": 0},
    }
    room = max(64, size - len(orjson.dumps(skeleton)))
    prompt = _text(rng, room // 4)
    response = _text(rng, room - len(prompt))
    metadata["prompt_len"] = len(prompt) // 4
    metadata["response_len"] = len(response) // 4
    return {
        "messages": [system, {"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
        "metadata": metadata,
    }


def sample_bodies(n: int, size: int, *, distinct: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """`n` samples: `distinct` different texts reused, each sample with its own metadata."""
    pool = [sample_body(i, size, seed=seed) for i in range(min(n, distinct))]
    out: list[dict[str, Any]] = []
    for i in range(n):
        base = pool[i % len(pool)]
        meta = dict(base["metadata"])
        meta["prompt_index"] = i // 8
        meta["sample_index"] = i % 8
        out.append({"messages": base["messages"], "metadata": meta})
    return out


def to_samples(bodies: Sequence[dict[str, Any]]) -> list[Any]:
    """The bodies as `asynctrace.Sample` objects (what a trainer hands the session)."""
    import asynctrace as at

    return [at.Sample(messages=b["messages"], metadata=b["metadata"]) for b in bodies]


def shuffled_step(per_step: int) -> list[Any]:
    """One step of 2.5 KB samples whose rewards 0 .. (per_step - 1) / per_step are shuffled
    (the same order every run): what the capped benchmarks log each step."""
    bodies = sample_bodies(per_step, SIZES["2.5KB"])
    rewards = [i / per_step for i in range(per_step)]
    random.Random(0).shuffle(rewards)
    for body, reward in zip(bodies, rewards, strict=True):
        body["metadata"]["reward"] = reward
    return to_samples(bodies)


def to_traces(bodies: Sequence[dict[str, Any]]) -> list[Any]:
    """The same bodies as `trackio.Trace` objects (what a trainer hands Trackio directly)."""
    import trackio

    return [trackio.Trace(b["messages"], b["metadata"]) for b in bodies]


def count_trackio_traces(project: str, run: str) -> int:
    """Traces of `run` that are in the project's SQLite database (a COUNT query)."""
    from trackio.sqlite_storage import SQLiteStorage

    path = SQLiteStorage.get_project_db_path(project)
    if not path.exists():
        return 0
    with sqlite3.connect(path) as conn:
        row = conn.execute("SELECT COUNT(*) FROM traces WHERE run_name = ?", (run,)).fetchone()
    return int(row[0])


def count_jsonl_lines(path: str | os.PathLike[str]) -> int:
    """Trace lines in a JSONL file; metrics lines (the session's health metrics at finish,
    ``{"step": ..., "metrics": ...}``) are not traces and are left out."""
    with open(path, "rb") as f:
        return sum(1 for line in f if not line.startswith(b'{"step"'))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return float(values[0])
    cuts = statistics.quantiles(values, n=1000, method="inclusive")
    return float(cuts[max(0, min(998, round(q * 10) - 1))])


def fmt_ratio(value: float) -> str:
    return f"{value:.2f}x" if value < 100 else f"{value:.0f}x"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A small Markdown table (so it can be pasted into docs as is)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(cells[0], widths, strict=True)) + " |"
    print(line)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
