"""Log rollout traces from an async training loop into a local Trackio project.

Run it, then open the dashboard with: trackio show --project "asynctrace-quickstart"
"""

from __future__ import annotations

import random
from typing import Any

import anyio

import asynctrace as at


def rollout(step: int, i: int) -> dict[str, Any]:
    """Stands in for your generation and reward code: a prompt, a response and metadata."""
    reward = random.random()
    return {
        "prompt": f"What is {step} + {i}?",
        "response": f"The answer is {step + i}.",
        "reward": reward,
        "advantage": reward - 0.5,
        "policy_version": step,
    }


async def main() -> None:
    async with at.TraceSession(
        "asynctrace-quickstart",
        max_traces_per_step=8,  # keep 8 traces per step:
        sampler="top_bottom",  # the 4 highest and the 4 lowest rewards
    ) as session:
        for step in range(10):
            samples = [rollout(step, i) for i in range(64)]
            await session.log_samples(samples, step=step)  # validates, encodes, queues; returns fast
            rewards = [s["reward"] for s in samples]
            await session.log_metrics({"reward/mean": sum(rewards) / len(rewards)}, step=step)
    # Leaving the block drained the queue and finished the Trackio run.
    stats = session.stats()
    print(stats.summary())
    if not stats.check() or stats.failed or stats.pending:
        raise SystemExit("some traces were not delivered")


if __name__ == "__main__":
    anyio.run(main)
