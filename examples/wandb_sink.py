"""Log rollout traces to the W&B run a trainer opened, and to a JSONL file beside it.

Runs offline (no account, no network): W&B writes the run under ./wandb, and
``wandb sync wandb/latest-run`` uploads it later. Remove the ``WANDB_MODE`` line to log online.
"""

from __future__ import annotations

import os
import random
from typing import Any

import anyio

import asynctrace as at

os.environ.setdefault("WANDB_MODE", "offline")


def rollout(step: int, i: int) -> dict[str, Any]:
    """Stands in for your generation and reward code: a prompt, a response and metadata."""
    reward = random.random()
    return {
        "prompt": f"What is {step} + {i}?",
        "response": f"The answer is {step + i}.",
        "reward": reward,
        "advantage": reward - 0.5,
        "policy_version": step,
        "stop_reason": random.choice(["stop", "length"]),
    }


async def main() -> None:
    import wandb

    # The trainer's own run; wandb.init takes a second or two, so it runs off the event loop.
    run = await anyio.to_thread.run_sync(lambda: wandb.init(project="asynctrace-wandb", name="grpo-demo"))
    sinks = [at.WandbSink(attach=True), at.JsonlSink("rollouts.jsonl")]
    async with at.TraceSession("asynctrace-wandb", sinks=sinks) as session:
        for step in range(5):
            samples = [rollout(step, i) for i in range(16)]
            await session.log_samples(samples, step=step)
            loss = 1.0 / (step + 1)
            run.log({"train/loss": loss}, step=step)  # the trainer logs with its own step
    print(session.stats().summary())
    # The sink logged its final table at close and left the run open: the trainer finishes it.
    await anyio.to_thread.run_sync(run.finish)
    print(f"W&B run in {os.path.dirname(run.dir)}; tables: train/traces-incr, train/traces")


if __name__ == "__main__":
    anyio.run(main)
