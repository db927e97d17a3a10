"""MlflowSink vs MLflow's own tracing calls: the caller's cost, and end-to-end throughput.

Both sides write the same samples (2.5 KB chat samples with RL metadata), one MLflow trace each,
linked to a run, into a SQLite tracking store of their own (a copy of one migrated database, so
that MLflow's schema migrations are outside every window):

- session: ``await session.log_samples(batch of 32)`` into a ``TraceSession`` whose only sink is
  ``MlflowSink``; the caller's cost is the time inside those calls, the throughput is from the
  first submit to ``finish`` returning (every trace in the database, the run ended).
- MLflow: ``MlflowClient.start_trace`` (inputs, the same tags) and ``end_trace`` (outputs) per
  sample, MLflow's own way to log a trace; it hands finished traces to its own background
  queue (``MLFLOW_ENABLE_ASYNC_TRACE_LOGGING``, on by default). The caller's cost is the time
  inside those two calls, the throughput runs until ``mlflow.flush_trace_async_logging()``
  returns and the run is ended.

Counts are verified with ``search_traces`` on each side. Variants alternate over ``--rounds``;
the median round is reported.

    python benchmarks/bench_mlflow.py
    python benchmarks/bench_mlflow.py --quick
"""

from __future__ import annotations

import os
import tempfile

os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="asynctrace-bench-")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import argparse
import logging
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _common as common

BATCH = 32
GOAL_CALLER = 10.0  # the session's call at least 10x cheaper per sample than MLflow's own
GOAL_THROUGHPUT = 0.5  # and at least half MLflow's own end-to-end throughput


def _count(uri: str, experiment_id: str, run_id: str) -> int:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    n, token = 0, None
    while True:
        page = client.search_traces(
            locations=[experiment_id], run_id=run_id, max_results=500, page_token=token, include_spans=False
        )
        n += len(page)
        token = page.token
        if not token:
            return n


def _store(template: Path, workdir: Path, name: str) -> str:
    path = workdir / f"{name}.db"
    shutil.copyfile(template, path)
    return f"sqlite:///{path}"


async def session_round(samples: list[Any], uri: str) -> tuple[float, float]:
    """Seconds inside log_samples per sample, and seconds from the first submit to finish."""
    import asynctrace as at

    sink = at.MlflowSink(tracking_uri=uri, experiment="bench")
    async with at.TraceSession("bench", sinks=[sink], finish_timeout=600.0, batch_size=BATCH) as session:
        # The run open and one trace written before the window, as MLflow's side opens its run
        # and (see below) imports its tracing machinery before its own.
        await session.log_samples(samples[:1], step=0)
        await session.flush(timeout=600.0)
        inside = 0.0
        t0 = time.perf_counter()
        for c in range(0, len(samples), BATCH):
            c0 = time.perf_counter()
            await session.log_samples(samples[c : c + BATCH], step=1 + c // BATCH)
            inside += time.perf_counter() - c0
        stats = await session.finish()
        elapsed = time.perf_counter() - t0
    _check(stats.written == len(samples) + 1 and stats.check(), f"session: {stats.summary()}")
    stored = _count(uri, str(sink.experiment_id), str(sink.run_id))
    _check(stored == len(samples) + 1, f"session stored {stored} traces, expected {len(samples) + 1}")
    return inside / len(samples), elapsed


def mlflow_round(bodies: list[dict[str, Any]], uri: str, artifacts: Path) -> tuple[float, float]:
    """The same with MLflow's own tracing calls on the caller's thread."""
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    # MLflow's exporter may also upload traces as artifacts: into the run's scratch directory.
    experiment_id = client.create_experiment("bench", artifact_location=artifacts.as_uri())
    run = client.create_run(experiment_id, run_name="bench")
    run_id = run.info.run_id

    def log(body: dict[str, Any], step: int) -> None:
        messages = body["messages"]
        tags = {"step": str(step), "split": "train", **{k: str(v) for k, v in body["metadata"].items()}}
        span = client.start_trace(
            "train/traces",
            span_type="CHAT_MODEL",
            inputs={"messages": messages[:-1]},
            tags=tags,
            experiment_id=experiment_id,
            run_id=run_id,
        )
        client.end_trace(span.trace_id, outputs=messages[-1])

    log(bodies[0], 0)
    mlflow.flush_trace_async_logging()
    inside = 0.0
    t0 = time.perf_counter()
    for c in range(0, len(bodies), BATCH):
        c0 = time.perf_counter()
        for body in bodies[c : c + BATCH]:
            log(body, 1 + c // BATCH)
        inside += time.perf_counter() - c0
    mlflow.flush_trace_async_logging()
    client.set_terminated(run_id, "FINISHED")
    elapsed = time.perf_counter() - t0
    stored = _count(uri, experiment_id, run_id)
    _check(stored == len(bodies) + 1, f"MLflow stored {stored} traces, expected {len(bodies) + 1}")
    return inside / len(bodies), elapsed


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise SystemExit(f"verification failed: {message}")


async def main_async(args: argparse.Namespace) -> int:
    common.print_machine("start")
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    t = time.perf_counter()
    from mlflow.tracking import MlflowClient

    imported = time.perf_counter() - t
    workdir = Path(tempfile.mkdtemp(prefix="asynctrace-bench-mlflow-"))
    try:
        template = workdir / "template.db"
        t = time.perf_counter()
        MlflowClient(f"sqlite:///{template}").search_experiments()
        migrated = time.perf_counter() - t
        print(f"import mlflow: {imported:.2f} s; a new SQLite store's schema migrations: {migrated:.2f} s")
        bodies = common.sample_bodies(args.samples, common.SIZES["2.5KB"])
        samples = common.to_samples(bodies)
        caller: dict[str, list[float]] = {"session": [], "mlflow": []}
        total: dict[str, list[float]] = {"session": [], "mlflow": []}
        for r in range(args.rounds):
            for variant in ("session", "mlflow") if r % 2 == 0 else ("mlflow", "session"):
                uri = _store(template, workdir, f"{variant}-{r}")
                if variant == "session":
                    per, elapsed = await session_round(samples, uri)
                else:
                    per, elapsed = mlflow_round(bodies, uri, workdir / f"artifacts-{r}")
                caller[variant].append(per)
                total[variant].append(elapsed)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    n = len(samples)
    rows = [
        [
            "TraceSession + MlflowSink",
            f"{statistics.median(caller['session']) * 1e6:,.1f}",
            f"{n / statistics.median(total['session']):,.0f}",
            " / ".join(f"{n / t:,.0f}" for t in total["session"]),
        ],
        [
            "MLflow start_trace + end_trace",
            f"{statistics.median(caller['mlflow']) * 1e6:,.1f}",
            f"{n / statistics.median(total['mlflow']):,.0f}",
            " / ".join(f"{n / t:,.0f}" for t in total["mlflow"]),
        ],
    ]
    print(
        f"{n} samples of 2.5 KB per round, batches of {BATCH}, {args.rounds} alternating rounds, "
        f"one SQLite tracking store per round (counts verified with search_traces)"
    )
    common.print_table(
        ["variant", "caller us/sample (median)", "samples/s end to end (median)", "rounds (samples/s)"], rows
    )
    print()
    cost = [m / s for s, m in zip(caller["session"], caller["mlflow"], strict=True)]
    tput = [m / s for s, m in zip(total["session"], total["mlflow"], strict=True)]
    ok = True
    for name, pairs, goal in (
        ("caller cost: MLflow's calls / the session's", cost, GOAL_CALLER),
        ("throughput: session / MLflow's own", tput, GOAL_THROUGHPUT),
    ):
        ratio = statistics.median(pairs)
        met = ratio >= goal
        ok &= met
        rounds = ", ".join(common.fmt_ratio(x) for x in pairs)
        verdict = "met" if met else "NOT met"
        print(f"ratio {name} = {common.fmt_ratio(ratio)} (per round: {rounds}; goal >= {goal}x: {verdict})")
    common.print_machine("end")
    return 0 if ok or not args.strict else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=512, help="samples per round (default 512)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 64 samples, 1 round")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is not met")
    parser.add_argument("--verbose", action="store_true", help="show stderr (MLflow's logs)")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.rounds = 64, 1
    return args


def main(argv: list[str] | None = None) -> int:
    return common.run_main(main_async, parse_args, argv)


if __name__ == "__main__":
    sys.exit(main())
