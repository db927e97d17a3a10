"""Log rollout traces into a local MLflow tracking store, then find them with MLflow's search.

Needs `pip install "asynctrace[mlflow]" mlflow` (the full package brings the SQLite store and the
UI). Run it, then look at the run's Traces tab with: mlflow ui --backend-store-uri sqlite:///mlflow.db
"""

from __future__ import annotations

import random
import sys
from typing import Any

import anyio
import mlflow  # imported up front: the sink would import it on its thread when the session starts

import asynctrace as at

TRACKING_URI = sys.argv[1] if len(sys.argv) > 1 else "sqlite:///mlflow.db"


def rollout(step: int, i: int) -> dict[str, Any]:
    """Stands in for your generation and reward code: a prompt, a response and metadata."""
    reward = random.random()
    return {
        "prompt": f"What is {step} + {i}?",
        "response": f"The answer is {step + i}.",
        "reward": reward,
        "advantage": reward - 0.5,
        "policy_version": step,
        "stop_reason": "stop" if i % 4 else "length",
    }


async def main() -> None:
    sink = at.MlflowSink(tracking_uri=TRACKING_URI, experiment="asynctrace-example")
    async with at.TraceSession(
        "asynctrace-example",
        sinks=[sink],
        max_traces_per_step=8,  # 8 traces per step: the 4 highest and the 4 lowest rewards
        sampler="top_bottom",
        # A new SQLite store's first open runs MLflow's schema migrations, seconds on a busy
        # machine: room for them in finish's deadline.
        finish_timeout=120.0,
    ) as session:
        for step in range(5):
            samples = [rollout(step, i) for i in range(64)]
            await session.log_samples(samples, step=step)
            rewards = [s["reward"] for s in samples]
            await session.log_metrics({"reward/mean": sum(rewards) / len(rewards)}, step=step)
    stats = session.stats()
    print(stats.summary())
    if not stats.check() or stats.failed or stats.pending:
        raise SystemExit("some traces were not delivered")

    # Read back through MLflow itself: the traces of step 3 whose completion was cut off.
    client = mlflow.MlflowClient(TRACKING_URI)
    found = client.search_traces(
        locations=[sink.experiment_id],
        run_id=sink.run_id,
        filter_string="tags.step = '3' AND tags.stop_reason = 'length'",
    )
    for trace in found:
        print(trace.info.client_request_id, trace.info.tags["reward"], trace.info.request_preview)
    print(f"run {sink.run_id}: {len(found)} truncated traces at step 3")


if __name__ == "__main__":
    anyio.run(main)
