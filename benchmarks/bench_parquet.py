"""ParquetSink vs JsonlSink vs the bare write: throughput, and the event loop's lag meanwhile.

Two workloads: ``text`` (chat samples of about 2.5 KB, ``--text-rows`` of them) and ``tokens``
(``--token-rows`` samples carrying 4,096-token fields: token ids int32, log-probs float32, loss
mask int8; 36,864 bytes of arrays a row). For each, three variants, their order alternating over
``--rounds`` rounds, each with a 1 ms ticker task on the same event loop recording its lag:

- ``parquet``: ``TraceSession`` with only a ``ParquetSink`` (default settings);
- ``jsonl``: ``TraceSession`` with only a ``JsonlSink``;
- ``bare``: the trainer writing Parquet itself, in its loop: a pyarrow table of each batch's rows
  (the sink's columns, built from the caller's dicts and arrays) written as a row group to an
  open zstd ``pyarrow.parquet.ParquetWriter``, then closed and fsynced.

The window runs from the first call to the data being in closed files (``finish()`` for the
sessions). The sessions have ``health_metrics=False``, batches of ``--batch`` samples a call, and
log one batch before the window (the sink open, its writer process started). Rows are counted
back from the files. Reported per variant: the median round's rows/s and MB/s (encoded samples;
for ``tokens`` also the arrays' MB/s), and the ticker's p99 and max lag over all rounds; ratios
are medians of per-round ratios.

With ``--memory``: peak RSS while samples stream in at ``--rate`` samples/s (2.5 KB; 32 KB
samples at the same bytes/s) for ``--seconds``, default settings, each sink in a fresh process
(this script re-invoked); RSS is this process's plus its children's (ParquetSink's writer
process), read every 100 ms. Goal: ParquetSink at most 256 MB, with either sample size.

With ``--breakdown``: where a row's CPU goes, each workload's rows encoded once and then put
through the sink's stages in this process, the best of ``--rounds``: the sink's thread (the
journal's lines and their append), and the writer process's work (cutting the journal into
Arrow columns, the row groups' Parquet encoding and zstd, the rest: reading the journal, the
footer, the fsync), against `JsonlSink`'s lines and write, and the part of that on the
session's loop (the lines' pieces) against the lines joined there into one buffer, as before.
The 2.5 KB rows twice: as the throughput runs make them (64 texts reused, which zstd compresses
40-fold at little cost), and with every text distinct (as a run's are).

    python benchmarks/bench_parquet.py
    python benchmarks/bench_parquet.py --quick
    python benchmarks/bench_parquet.py --memory --seconds 90
    python benchmarks/bench_parquet.py --breakdown
"""

from __future__ import annotations

import os
import tempfile

os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="asynctrace-bench-")

import argparse
import contextlib
import gc
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import _common as common
import anyio
import orjson

TOKENS = 4096
GOAL_TEXT = 0.8  # ParquetSink / JsonlSink, samples/s, text rows
GOAL_TOKENS = 1.0  # ParquetSink / JsonlSink, MB/s, token rows
GOAL_P99_MS = 1.0
GOAL_MAX = 1.5  # ParquetSink's worst tick / JsonlSink's
GOAL_RSS_MB = 256.0  # peak RSS streaming, ParquetSink (and its writer process)
MB = 1e6
VARIANTS = ("parquet", "jsonl", "bare")
LABELS = {
    "parquet": "TraceSession + ParquetSink",
    "jsonl": "TraceSession + JsonlSink",
    "bare": "pyarrow in the loop (same rows)",
}


class Ticker:
    """The lag of every 1 ms sleep while `recording` is set."""

    def __init__(self) -> None:
        self.recording = False
        self.stop = False
        self.lags: list[float] = []

    async def run(self) -> None:
        while not self.stop:
            t0 = time.perf_counter()
            await anyio.sleep(0.001)
            if self.recording:
                self.lags.append(time.perf_counter() - t0 - 0.001)


def token_samples(n: int) -> list[Any]:
    """`n` samples with 4k-token fields (a pool of 16 distinct rows reused)."""
    import numpy as np

    import asynctrace as at

    rng = np.random.default_rng(0)
    pool = []
    for i in range(min(n, 16)):
        body = common.sample_body(i, 2_560)
        tokens = {
            "token_ids": rng.integers(0, 151_000, TOKENS, dtype=np.int32),
            "logprobs": -rng.exponential(0.5, TOKENS).astype(np.float32),
            "loss_mask": (np.arange(TOKENS) >= 512).astype(np.int8),
        }
        pool.append(at.Sample(messages=body["messages"], metadata=body["metadata"], tokens=tokens))
    return [pool[i % len(pool)] for i in range(n)]


def _bare_table(samples: list[Any], prefix: str, start: int, step: int) -> Any:
    """The rows a ParquetSink writes, built directly from the caller's samples."""
    import numpy as np
    import pyarrow as pa

    from asynctrace.sinks._parquet import schema

    n = len(samples)
    metas = [s.metadata for s in samples]
    target = schema()
    columns = {
        "id": pa.array([f"{prefix}-{start + i}" for i in range(n)]),
        "step": pa.array([step] * n, pa.int64()),
        "split": pa.array(["train"] * n),
        "key": pa.array(["train/traces"] * n),
        "timestamp": pa.array([int(time.time() * 1e6)] * n, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        "messages": pa.array([orjson.dumps(s.messages).decode() for s in samples]),
        "metadata": pa.array([orjson.dumps(m).decode() for m in metas]),
        "reward": pa.array([m.get("reward") for m in metas], pa.float64()),
        "advantage": pa.array([m.get("advantage") for m in metas], pa.float64()),
        "policy_version": pa.array([m.get("policy_version") for m in metas], pa.int64()),
        "stop_reason": pa.array([m.get("stop_reason") for m in metas], pa.string()),
        "score": pa.array([None] * n, pa.float64()),
        "spans": pa.array([None] * n, pa.string()),
    }
    for name in ("token_ids", "loss_mask", "logprobs", "advantages"):
        kind = target.field(name).type
        held = [s.tokens[name] for s in samples if s.tokens and name in s.tokens]
        if len(held) == n:
            offsets = pa.array(np.arange(n + 1, dtype=np.int32) * TOKENS)
            columns[name] = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(held)))
        else:
            columns[name] = pa.nulls(n, kind)
    return pa.Table.from_arrays([columns[f.name] for f in target], schema=target)


def _parquet_rows(directory: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in directory.glob("*.parquet"))


def _jsonl_rows(path: Path) -> int:
    return common.count_jsonl_lines(path)


async def _window(ticker: Ticker, body: Callable[[], Awaitable[None]]) -> float:
    await anyio.sleep(0.05)
    ticker.recording = True
    t0 = time.perf_counter()
    try:
        await body()
    finally:
        elapsed = time.perf_counter() - t0
        ticker.recording = False
    return elapsed


async def run_session(variant: str, samples: list[Any], batch: int, workdir: Path, ticker: Ticker) -> float:
    import asynctrace as at

    target = workdir / f"{variant}-{uuid.uuid4().hex[:8]}"
    sink: at.Sink = at.ParquetSink(target) if variant == "parquet" else at.JsonlSink(target / "out.jsonl")
    async with at.TraceSession(
        "bench", run="r", sinks=[sink], health_metrics=False, batch_size=batch, finish_timeout=600.0
    ) as session:
        await session.log_samples(samples[:batch], step=0)  # warm-up, before the window
        assert await session.flush(timeout=600.0)

        async def body() -> None:
            for c in range(0, len(samples), batch):
                await session.log_samples(samples[c : c + batch], step=1 + c // batch)
            await session.finish()

        elapsed = await _window(ticker, body)
    stats = session.stats()
    expected = len(samples) + batch
    _check(stats.written == expected and stats.check(), f"{variant}: {stats.summary()}")
    rows = _parquet_rows(target) if variant == "parquet" else _jsonl_rows(target / "out.jsonl")
    _check(rows == expected, f"{variant}: {rows} rows in the files, expected {expected}")
    shutil.rmtree(target)
    return elapsed


async def run_bare(samples: list[Any], batch: int, workdir: Path, ticker: Ticker) -> float:
    import pyarrow.parquet as pq

    from asynctrace.sinks._parquet import schema

    directory = workdir / f"bare-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    prefix = uuid.uuid4().hex[:12]
    path = directory / "bare.parquet"

    async def body() -> None:
        with open(path, "wb") as f:
            with pq.ParquetWriter(f, schema(), compression="zstd") as writer:
                for c in range(0, len(samples), batch):
                    writer.write_table(_bare_table(samples[c : c + batch], prefix, c, c // batch))
                    await anyio.sleep(0)
            f.flush()
            os.fsync(f.fileno())

    elapsed = await _window(ticker, body)
    rows = _parquet_rows(directory)
    _check(rows == len(samples), f"bare: {rows} rows, expected {len(samples)}")
    shutil.rmtree(directory)
    return elapsed


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"verification failed: {what}")


async def measure(
    name: str, samples: list[Any], args: argparse.Namespace, workdir: Path
) -> dict[str, tuple[list[float], list[float]]]:
    """Per variant: each round's seconds, and every tick's lag."""
    out: dict[str, tuple[list[float], list[float]]] = {v: ([], []) for v in VARIANTS}
    ticker = Ticker()
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker.run)
        for r in range(args.rounds):
            for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                ticker.lags = []
                gc.collect()
                if variant == "bare":
                    seconds = await run_bare(samples, args.batch, workdir, ticker)
                else:
                    seconds = await run_session(variant, samples, args.batch, workdir, ticker)
                out[variant][0].append(seconds)
                out[variant][1].extend(ticker.lags)
                if args.verbose:
                    print(
                        f"  {name} round {r + 1} {variant}: {len(samples) / seconds:,.0f} rows/s", flush=True
                    )
        ticker.stop = True
    return out


def report(name: str, samples: list[Any], results: dict[str, tuple[list[float], list[float]]]) -> list[bool]:
    from asynctrace._records.encode import encode_sample

    n = len(samples)
    encoded = sum(len(encode_sample(s, i)[0]) for i, s in enumerate(samples)) / 1e6
    arrays = sum(sum(v.nbytes for v in s.tokens.values()) for s in samples if s.tokens) / 1e6
    rows = []
    for variant in VARIANTS:
        seconds, lags = results[variant]
        median = statistics.median(seconds)
        row = [
            LABELS[variant],
            f"{n / median:,.0f}",
            f"{encoded / median:,.0f}",
        ]
        if arrays:
            row.append(f"{arrays / median:,.0f}")
        row += [f"{common.percentile(lags, 99) * 1e3:.3f}", f"{max(lags) * 1e3:.1f}"]
        rows.append(row)
    headers = ["variant", "rows/s", "MB/s (encoded)"] + (["MB/s (arrays)"] if arrays else [])
    print(f"\n{name}: {n} rows, {encoded / n * 1e6 / 1e3:.1f} KB encoded a row")
    common.print_table([*headers, "p99 lag ms", "max lag ms"], rows)
    seconds = {v: results[v][0] for v in VARIANTS}
    to_jsonl = statistics.median(j / p for p, j in zip(seconds["parquet"], seconds["jsonl"], strict=True))
    to_bare = statistics.median(b / p for p, b in zip(seconds["parquet"], seconds["bare"], strict=True))
    p99 = common.percentile(results["parquet"][1], 99) * 1e3
    worst = max(results["parquet"][1]) / max(results["jsonl"][1])
    goal = GOAL_TOKENS if arrays else GOAL_TEXT
    print(
        f"ratio {name}: ParquetSink / JsonlSink throughput = {common.fmt_ratio(to_jsonl)} (goal >= {goal:g}x)"
    )
    print(f"ratio {name}: ParquetSink / bare pyarrow throughput = {common.fmt_ratio(to_bare)}")
    print(f"ratio {name}: ParquetSink max lag / JsonlSink max lag = {worst:.2f} (goal <= {GOAL_MAX:g})")
    print(f"{name}: ParquetSink p99 lag {p99:.3f} ms (goal < {GOAL_P99_MS:g} ms)")
    return [to_jsonl >= goal, worst <= GOAL_MAX, p99 < GOAL_P99_MS]


async def main_async(args: argparse.Namespace) -> int:
    import pyarrow

    common.print_machine("start")
    common.prefault(args.prefault_mib)
    workloads = []
    if "text" in args.workloads:
        workloads.append(
            ("text", common.to_samples(common.sample_bodies(args.text_rows, common.SIZES["2.5KB"])))
        )
    if "tokens" in args.workloads:
        workloads.append(("tokens", token_samples(args.token_rows)))
    gc.collect()
    gc.freeze()  # the prebuilt inputs: a trainer holds one step's samples, not the run's
    workdir = Path(tempfile.mkdtemp(prefix="asynctrace-bench-parquet-"))
    met: list[bool] = []
    try:
        results = [
            (name, samples, await measure(name, samples, args, workdir)) for name, samples in workloads
        ]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"pyarrow {pyarrow.__version__}; batches of {args.batch}, {args.rounds} alternating rounds "
        "(median round; lags over all rounds); health_metrics=False"
    )
    for name, samples, result in results:
        met += report(name, samples, result)
    common.print_machine("end")
    return 0 if all(met) or not args.strict else 1


class RssPeak(threading.Thread):
    """The peak RSS of this process, of its children, and of both together, every 100 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        import psutil

        self.process = psutil.Process()
        self.peaks = [0, 0, 0]  # own, children, total
        self.halt = threading.Event()

    def run(self) -> None:
        import psutil

        while not self.halt.wait(0.1):
            own = self.process.memory_info().rss
            children = 0
            for child in self.process.children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    children += child.memory_info().rss
            for k, value in enumerate((own, children, own + children)):
                self.peaks[k] = max(self.peaks[k], value)


async def stream_child(args: argparse.Namespace) -> list[Any]:
    """Log samples at a steady rate for a while through one sink; peak RSS meanwhile."""
    import asynctrace as at

    size = common.SIZES[args.size]
    rate = args.rate * common.SIZES["2.5KB"] / size  # the same bytes a second for either size
    pool = common.to_samples(common.sample_bodies(64, size))
    workdir = Path(tempfile.mkdtemp(prefix="asynctrace-bench-memory-"))
    sink: at.Sink = (
        at.ParquetSink(workdir) if args.child == "parquet" else at.JsonlSink(workdir / "out.jsonl")
    )
    peak = RssPeak()
    batch = 32
    try:
        async with at.TraceSession("bench", run="memory", sinks=[sink], health_metrics=False) as session:
            await session.flush()
            peak.start()
            logged = 0
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < args.seconds:
                await session.log_samples([pool[(logged + j) % len(pool)] for j in range(batch)], step=logged)
                logged += batch
                await anyio.sleep(max(0.0, t0 + logged / rate - time.perf_counter()))
            produced = time.perf_counter() - t0
            stats = await session.finish()
        peak.halt.set()
        peak.join()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    _check(stats.written == logged and stats.check(), stats.summary())
    own, children, total = peak.peaks
    return {"sink": args.child, "size": args.size, "rate": logged / produced, "logged": logged}, (
        own,
        children,
        total,
    )  # type: ignore[return-value]


def run_memory(args: argparse.Namespace) -> int:
    common.print_machine("start")
    rows = []
    met = True
    for size in ("2.5KB", "32KB"):
        peaks = {}
        for sink in ("jsonl", "parquet"):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", sink, "--size", size]
            cmd += ["--seconds", str(args.seconds), "--rate", str(args.rate)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{sink} {size} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
            info, (own, children, total) = json.loads(line[len("RESULT ") :])
            peaks[sink] = total
            rows.append(
                [
                    f"{sink}, {size}",
                    f"{info['rate']:,.0f}",
                    f"{info['logged']:,}",
                    f"{own / MB:.0f}",
                    f"{children / MB:.0f}",
                    f"{total / MB:.0f}",
                ]
            )
        met &= peaks["parquet"] / MB <= GOAL_RSS_MB
        print(
            f"ratio {size}: ParquetSink peak RSS {peaks['parquet'] / MB:.0f} MB (goal <= {GOAL_RSS_MB:g}), "
            f"{peaks['parquet'] / peaks['jsonl']:.1f}x JsonlSink's",
            flush=True,
        )
    print(f"peak RSS streaming for {args.seconds:g} s, default settings, a fresh process per variant")
    common.print_table(
        ["sink, sample size", "samples/s", "samples", "process MB", "writer process MB", "together MB"], rows
    )
    common.print_machine("end")
    return 0 if met or not args.strict else 1


def _cpu_per_row(n: int, rounds: int, body: Callable[[], Any]) -> float:
    """The least CPU time of `rounds` calls of `body`, in microseconds a row."""
    best = float("inf")
    for _ in range(rounds):
        gc.collect()
        t0 = time.process_time()
        body()
        best = min(best, time.process_time() - t0)
    return best / n * 1e6


def _stage_costs(name: str, samples: list[Any], args: argparse.Namespace) -> dict[str, float]:
    """CPU µs a row of each stage (see ``--breakdown``) for `samples`."""
    import asynctrace as at
    from asynctrace._records.encode import encode_sample
    from asynctrace._records.types import TraceRecord

    try:
        from asynctrace.sinks._appends import write_all
    except ImportError:  # the code before the appends had a module of their own
        from asynctrace.sinks._parquet import _write_all as write_all  # type: ignore[attr-defined,no-redef]
    from asynctrace.sinks import _parquet_file as files
    from asynctrace.sinks import _parquet_rows as rows

    n, when = len(samples), time.time()
    records = [
        TraceRecord(f"b-{i}", 1 + i // args.batch, "train", "train/traces", encode_sample(s, i)[0], when)
        for i, s in enumerate(samples)
    ]
    batches = [records[c : c + args.batch] for c in range(0, n, args.batch)]
    workdir = Path(tempfile.mkdtemp(prefix="asynctrace-bench-breakdown-"))
    journal = workdir / "journal"
    described: list[tuple[int, int, dict[str, Any]]] = []

    def append_journal() -> None:
        described.clear()
        fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        try:
            for batch in batches:
                start = os.lseek(fd, 0, os.SEEK_END)
                if hasattr(rows, "journal_parts"):
                    parts, layout = rows.journal_parts(batch)
                    write_all(fd, parts)
                    size = sum(map(len, parts))
                else:  # the code before 2026-11-27 (one joined buffer), for back-to-back runs
                    data, layout = rows.journal_lines(batch)
                    write_all(fd, [data])
                    size = len(data)
                described.append((start, start + size, layout))
        finally:
            os.close(fd)

    def jsonl() -> None:
        sink = at.JsonlSink(workdir / "out.jsonl")
        for batch in batches:
            sink._write_lines(sink._lines(batch), 3)
        sink._close_file()

    # What the session's loop does for JsonlSink: the lines' pieces; before, also their join.
    loop_sink = at.JsonlSink(workdir / "unused.jsonl")

    def jsonl_loop() -> None:
        for batch in batches:
            loop_sink._lines(batch)

    def jsonl_loop_joined() -> None:
        for batch in batches:
            b"".join(loop_sink._lines(batch))

    def convert() -> None:
        converter = files.FileConverter()
        out = os.open(workdir / "out.parquet", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        converter.start(out, os.open(journal, os.O_RDONLY))
        for start, end, layout in described:
            converter.append(end, layout=layout, start=start)
        _check(converter.finish() == n, f"{name}: rows written")

    # The writer process's stages, timed inside one conversion: cutting lines into columns
    # (`RowBuffer.add_described`) and writing a row group (`FileConverter._flush`: the table,
    # its Parquet encoding and zstd, the memory given back).
    spent = {"cut": 0.0, "encode": 0.0}
    originals = (rows.RowBuffer.add_described, files.FileConverter._flush)

    def timed(stage: str, method: Callable[..., None]) -> Callable[..., None]:
        def run(*a: Any) -> None:
            t0 = time.process_time()
            method(*a)
            spent[stage] += time.process_time() - t0

        return run

    try:
        costs = {
            "jsonl": _cpu_per_row(n, args.rounds, jsonl),
            "jsonl_loop": _cpu_per_row(n, args.rounds, jsonl_loop),
            "jsonl_loop_joined": _cpu_per_row(n, args.rounds, jsonl_loop_joined),
            "journal": _cpu_per_row(n, args.rounds, append_journal),
        }
        rows.RowBuffer.add_described = timed("cut", originals[0])  # type: ignore[method-assign]
        files.FileConverter._flush = timed("encode", originals[1])  # type: ignore[method-assign]
        best = None
        for _ in range(args.rounds):
            spent.update(cut=0.0, encode=0.0)
            total = _cpu_per_row(n, 1, convert)
            if best is None or total < best[0]:
                best = (total, spent["cut"] / n * 1e6, spent["encode"] / n * 1e6)
        assert best is not None
        costs.update(convert=best[0], cut=best[1], encode=best[2])
        costs["compressed"] = (workdir / "out.parquet").stat().st_size / journal.stat().st_size
        return costs
    finally:
        rows.RowBuffer.add_described, files.FileConverter._flush = originals  # type: ignore[method-assign]
        shutil.rmtree(workdir, ignore_errors=True)


def run_breakdown(args: argparse.Namespace) -> int:
    common.print_machine("start")
    size = common.SIZES["2.5KB"]
    workloads = [
        ("text (64 texts, as above)", common.to_samples(common.sample_bodies(args.text_rows, size))),
        (
            "text (every one distinct)",
            common.to_samples(common.sample_bodies(args.text_rows, size, distinct=args.text_rows)),
        ),
        ("tokens", token_samples(args.token_rows)),
    ]
    table = []
    for name, samples in workloads:
        costs = _stage_costs(name, samples, args)
        table.append(
            [
                name,
                f"{costs['jsonl']:.2f}",
                f"{costs['jsonl_loop']:.2f} ({costs['jsonl_loop_joined'] / costs['jsonl_loop']:.1f}x less)",
                f"{costs['journal']:.2f}",
                f"{costs['convert']:.2f}",
                f"{costs['cut']:.2f}",
                f"{costs['encode']:.2f}",
                f"{costs['convert'] - costs['cut'] - costs['encode']:.2f}",
                f"{costs['compressed']:.3f}",
            ]
        )
    print(f"CPU µs a row, best of {args.rounds} rounds, batches of {args.batch}")
    common.print_table(
        [
            "rows",
            "JsonlSink lines + write",
            "of which on the loop (than lines + join)",
            "sink thread: journal lines + append",
            "writer process: all",
            "of which: cut into columns",
            "Parquet encode + zstd",
            "the rest",
            "file / journal bytes",
        ],
        table,
    )
    common.print_machine("end")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", nargs="+", choices=["text", "tokens"], default=["text", "tokens"])
    parser.add_argument("--text-rows", type=int, default=51_200)
    parser.add_argument("--token-rows", type=int, default=2_048)
    parser.add_argument("--batch", type=int, default=256, help="samples a log_samples call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefault-mib", type=int, default=512)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 4096 text and 256 token rows, 1 round"
    )
    parser.add_argument("--memory", action="store_true", help="measure peak RSS while streaming instead")
    parser.add_argument(
        "--breakdown", action="store_true", help="CPU a row in each stage of the sink instead"
    )
    parser.add_argument("--seconds", type=float, default=90.0, help="--memory: seconds of streaming")
    parser.add_argument("--rate", type=float, default=5_800.0, help="--memory: 2.5 KB samples a second")
    parser.add_argument("--child", choices=["jsonl", "parquet"], help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=sorted(common.SIZES), default="2.5KB", help=argparse.SUPPRESS)
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is not met")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.text_rows, args.token_rows, args.rounds, args.prefault_mib = 4096, 256, 1, 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        result = anyio.run(stream_child, args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.breakdown:
        return run_breakdown(args)
    if args.memory:
        common.cleanup_trackio_dir_at_exit()
        return run_memory(args)
    return common.run_main(main_async, lambda _: args)


if __name__ == "__main__":
    sys.exit(main())
