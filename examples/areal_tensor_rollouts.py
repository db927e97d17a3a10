"""AReaL-shaped rollouts: log each step's list of trajectory groups from a synchronous training loop.

AReaL 1.0's `PPOTrainer.train` (areal/trainer/rl_trainer.py) holds a step's rollouts as a
list with one dict per group (the `n_samples` answers to one prompt, right-padded by
`concat_padded_tensors`): `input_ids`, `attention_mask`, `loss_mask`, `logprobs`, `versions`
(int32, -1 on prompt tokens) and `rewards` ([n]). This script builds such lists from
multi-turn tool-use conversations, without AReaL installed, and hands each to
`areal_adapter.log_batch` as the trainer would, right after `compute_advantages`. The hook
never raises into the loop; each row gets its group id. Runs on the CPU in a few seconds with
an in-process tokenizer.

Open the dashboard with: trackio show --project "asynctrace-areal"
"""

from __future__ import annotations

import random
from typing import Any

import torch

import asynctrace as at
from asynctrace.adapters import areal_adapter
from asynctrace.rollouts import encode_turns, toy_tokenizer

PROBLEMS = [(17, 23), (12, 34), (45, 6), (9, 99)]
GROUP_SIZE = 8


def episode(tokenizer: Any, a: int, b: int, version: int, rng: random.Random) -> dict[str, torch.Tensor]:
    """One trajectory as an AReaL workflow returns it: batch dimension 1, loss mask on generated tokens."""
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
    ids, mask = encode_turns(tokenizer, turns)
    versions = [version if m else -1 for m in mask]
    return {
        "input_ids": torch.tensor([ids], dtype=torch.int32),
        "loss_mask": torch.tensor([mask], dtype=torch.int32),
        "logprobs": torch.zeros(1, len(ids)),
        "versions": torch.tensor([versions], dtype=torch.int32),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.bool),
        "rewards": torch.tensor([float(answer == a * b)]),
    }


def group(episodes: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A group's episodes right-padded to its longest and stacked, as `concat_padded_tensors` does."""
    width = max(e["input_ids"].shape[1] for e in episodes)
    out: dict[str, torch.Tensor] = {}
    for key in episodes[0]:
        values = [e[key] for e in episodes]
        if values[0].dim() == 2:
            values = [torch.nn.functional.pad(v, (0, width - v.shape[1])) for v in values]
        out[key] = torch.cat(values)
    return out


def main() -> None:
    tokenizer = toy_tokenizer()
    rng = random.Random(0)
    with at.TraceSession("asynctrace-areal", max_traces_per_step=4, sampler="top_bottom") as session:
        for step in range(5):
            batch = [
                group([episode(tokenizer, a, b, step, rng) for _ in range(GROUP_SIZE)]) for a, b in PROBLEMS
            ]
            # In AReaL: right after `adv_batch = self.actor.compute_advantages(rollout_batch)`.
            areal_adapter.log_batch(session, batch, tokenizer=tokenizer, step=step)
            rewards = torch.cat([g["rewards"] for g in batch])
            session.log_metrics({"reward/mean": float(rewards.mean())}, step=step)
    stats = session.stats()
    print(stats.summary())
    if not stats.check() or stats.failed or stats.pending:
        raise SystemExit("some traces were not delivered")


if __name__ == "__main__":
    main()
