"""NeMo RL's GRPO steps logged through `nemo_rl_adapter.log_step`, as `grpo_train` would call it.

Runs on CPU without NeMo RL: each step's `repeated_batch` and `train_data` are laid out as
`grpo_train` holds them at its "# Logging" comment (message logs with token ids, assistant turns
with `generation_logprobs`, a tool answer between turns; flattened, right-padded training rows
with GRPO's leave-one-out, normalised advantages, grouped by prompt tokens as NeMo RL groups).
Nothing is downloaded: the tokenizer is built in-process.
Open the dashboard with: trackio show --project "nemo-rl-example"
"""

from __future__ import annotations

import random
from typing import Any

import torch

import asynctrace as at
from asynctrace.adapters import nemo_rl_adapter
from asynctrace.rollouts import toy_tokenizer

GENERATIONS = 4  # grpo.num_generations_per_prompt
QUESTIONS = ["What is 17 * 23?", "Name a prime above 90.", "What is 17 * 23?"]


def _ids(tokenizer: Any, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)


def grpo_step(tokenizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """`repeated_batch` and `train_data` of one step, at the point where advantages are set."""
    logs, lengths, idx, rewards = [], [], [], []
    for row, question in enumerate(QUESTIONS):
        for _ in range(GENERATIONS):
            log = [{"role": "user", "content": question, "token_ids": _ids(tokenizer, question)}]
            lengths.append(len(log[0]["token_ids"]))
            turns = ["Let me compute.", "It is 391."] if random.random() < 0.5 else ["It is 401."]
            for t, text in enumerate(turns):
                ids = _ids(tokenizer, text)
                log.append(
                    {
                        "role": "assistant",
                        "content": text,
                        "token_ids": ids,
                        "generation_logprobs": -torch.rand(len(ids)),
                        "token_loss_mask": torch.ones_like(ids),
                    }
                )
                if t < len(turns) - 1:
                    log.append({"role": "tool", "content": "391", "token_ids": _ids(tokenizer, "391")})
            logs.append(log)
            idx.append(row)
            rewards.append(1.0 if "391" in turns[-1] else 0.0)
    total_reward = torch.tensor(rewards)
    # GRPO's baseline: leave-one-out mean over the rows with the same prompt tokens, then / std.
    prompts = [tuple(log[0]["token_ids"].tolist()) for log in logs]
    advantage = torch.zeros_like(total_reward)
    for prompt in set(prompts):
        rows = torch.tensor([i for i, p in enumerate(prompts) if p == prompt])
        group = total_reward[rows]
        baseline = (group.sum() - group) / (len(group) - 1)
        std = group.std()
        advantage[rows] = (group - baseline) / (std + 1e-6) if std > 0 else group - baseline
    width = max(sum(len(m["token_ids"]) for m in log) for log in logs)
    advantages = torch.zeros(len(logs), width)
    for i, log in enumerate(logs):
        advantages[i, : sum(len(m["token_ids"]) for m in log)] = advantage[i]
    repeated_batch = {
        "message_log": logs,
        "length": torch.tensor(lengths),
        "idx": idx,
        "task_name": ["math"] * len(logs),
        "total_reward": total_reward,
        "loss_multiplier": torch.ones(len(logs)),
    }
    return repeated_batch, {"advantages": advantages}


def main() -> None:
    random.seed(0)
    tokenizer = toy_tokenizer()
    with at.TraceSession("nemo-rl-example", on_full="block") as session:
        for total_steps in range(3):
            repeated_batch, train_data = grpo_step(tokenizer)
            nemo_rl_adapter.log_step(
                session, repeated_batch, train_data, step=total_steps + 1, policy_version=total_steps
            )
    stats = session.stats()
    print(f"written {stats.written}, dropped {dict(stats.dropped)}")


if __name__ == "__main__":
    main()
