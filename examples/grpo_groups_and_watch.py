"""Log whole GRPO prompt groups per step, and follow two prompts at every step they occur in.

Each step samples 32 prompts from a dataset of 200 and generates 8 answers per prompt. The cap
keeps 16 samples a step: the prompt group with the highest mean reward and the one with the
lowest, whole. Two watched prompts are logged whenever they are drawn, past the cap.

Run it, then open the dashboard with: trackio show --project "asynctrace-grpo-groups"
and search the traces for "prompt-0007" to follow that prompt from step to step.
"""

from __future__ import annotations

import random
from typing import Any

import anyio

import asynctrace as at

GROUP_SIZE = 8
WATCHED = ["prompt-0007", "prompt-0042"]


def rollouts(step: int, rng: random.Random) -> list[dict[str, Any]]:
    """Stands in for your generation and reward code: 8 answers for each of 32 prompts."""
    out = []
    for p in rng.sample(range(200), 32) + [7, 42][: step % 3]:  # the watched ones now and then
        prompt_id = f"prompt-{p:04d}"
        skill = (p % 10) / 10 + step / 50  # the policy improves with the steps
        for j in range(GROUP_SIZE):
            out.append(
                {
                    "prompt": f"Problem {p}: what is {p} * {step}?",
                    "response": f"Attempt {j}: {p * step}",
                    "reward": float(rng.random() < skill),
                    "prompt_id": prompt_id,  # stable across steps: the watch list follows it
                    "group_uid": f"{step}-{prompt_id}",  # one group per prompt per step
                    "policy_version": step,
                }
            )
    return out


async def main() -> None:
    rng = random.Random(0)
    async with at.TraceSession(
        "asynctrace-grpo-groups",
        max_traces_per_step=2 * GROUP_SIZE,
        sampler=at.GroupSampler("top_bottom", stat="mean", group_size=GROUP_SIZE),
        watch=at.Watch(ids=WATCHED, max_per_step=2 * GROUP_SIZE),
    ) as session:
        for step in range(10):
            await session.log_samples(rollouts(step, rng), step=step)  # whole groups in one call
    stats = session.stats()
    print(stats.summary())
    if not stats.check() or stats.failed or stats.pending:
        raise SystemExit("some traces were not delivered")


if __name__ == "__main__":
    anyio.run(main)
