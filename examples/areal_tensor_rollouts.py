"""AReaL-style tensor rollouts: log a padded multi-turn batch, decoding only the rows the cap keeps.

Each step builds a batch the way AReaL holds one (right-padded `input_ids`, `attention_mask`,
`loss_mask`, `versions`, `rewards`) from groups of multi-turn tool-use conversations, then
hands it to `log_rollouts`: the cap picks 4 rows from the rewards, and only those are moved
and decoded. Runs on the CPU in a few seconds with an in-process tokenizer.

Open the dashboard with: trackio show --project "asynctrace-areal"
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import torch

import asynctrace as at
from asynctrace.adapters import areal_adapter
from asynctrace.rollouts import toy_tokenizer

PROBLEMS = [(17, 23), (12, 34), (45, 6), (9, 99)]


def conversation(a: int, b: int, rng: random.Random) -> tuple[list[tuple[str, str]], float]:
    """A tool-use episode: the question, a calculator call, its output, the final answer."""
    answer = a * b if rng.random() < 0.7 else a * b + rng.randint(1, 9)
    turns = [
        ("user", f"<|im_start|>user\nWhat is {a} * {b}?<|im_end|>\n"),
        (
            "assistant",
            f'<tool_call>{{"name": "python", "arguments": {{"code": "print({a} * {b})"}}}}</tool_call>',
        ),
        ("tool", f"<|im_start|>tool\n{a * b}\n<|im_end|>\n"),
        ("assistant", f"The answer is {answer}.<|im_end|>"),
    ]
    return turns, float(answer == a * b)


def rollout_batch(
    tokenizer: Any, version: int, rng: random.Random, group_size: int = 8
) -> dict[str, torch.Tensor]:
    """One GRPO batch: `group_size` samples per problem, right-padded, versions -1 off-policy."""
    rows, masks, rewards = [], [], []
    for a, b in PROBLEMS:
        for _ in range(group_size):
            turns, reward = conversation(a, b, rng)
            ids: list[int] = []
            mask: list[int] = []
            for role, text in turns:
                piece = tokenizer.encode(text).ids
                ids += piece
                mask += [int(role == "assistant")] * len(piece)
            rows.append(ids)
            masks.append(mask)
            rewards.append(reward)
    width = max(len(r) for r in rows) + 4
    batch = {
        "input_ids": torch.zeros(len(rows), width, dtype=torch.long),
        "attention_mask": torch.zeros(len(rows), width, dtype=torch.bool),
        "loss_mask": torch.zeros(len(rows), width, dtype=torch.long),
        "versions": torch.full((len(rows), width), -1, dtype=torch.long),
        "rewards": torch.tensor(rewards),
    }
    for i, (ids, mask) in enumerate(zip(rows, masks, strict=True)):
        n = len(ids)
        batch["input_ids"][i, :n] = torch.tensor(ids)
        batch["attention_mask"][i, :n] = True
        batch["loss_mask"][i, :n] = torch.tensor(mask)
        batch["versions"][i, :n] = torch.where(torch.tensor(mask) == 1, version, -1)
    return batch


async def main() -> None:
    tokenizer = toy_tokenizer()
    rng = random.Random(0)
    async with at.TraceSession("asynctrace-areal", max_traces_per_step=4, sampler="top_bottom") as session:
        for step in range(5):
            batch = rollout_batch(tokenizer, version=step, rng=rng)
            # The cap chooses 4 of the 32 rows from the rewards alone; only those 4 are decoded.
            await session.log_rollouts(**areal_adapter.rollout_kwargs(batch), tokenizer=tokenizer, step=step)
            await session.log_metrics({"reward/mean": float(batch["rewards"].mean())}, step=step)
    stats = session.stats()
    print(stats.summary())
    if not stats.check() or stats.failed or stats.pending:
        raise SystemExit("some traces were not delivered")


if __name__ == "__main__":
    anyio.run(main)
