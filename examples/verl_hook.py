"""verl's PPO batches logged through `verl_adapter.log_batch`, as `RayPPOTrainer.fit` would call it.

Needs verl installed (``pip install --no-deps verl==0.9.1`` plus the dev extra's verl pins). The
batch is a real `DataProto` laid out as verl's agent loop returns it (left-padded prompts,
right-padded responses, `response_mask` 0 on tool output), with GRPO advantages from verl's
`compute_grpo_outcome_advantage`. The trainer here carries only what the hook reads from
verl's `RayPPOTrainer`: `tokenizer`, `global_steps` and `config.trainer.project_name` /
`experiment_name`. Nothing is downloaded: the tokenizer is built in-process.
Open the dashboard with: trackio show --project "verl-hook-example"
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from asynctrace.adapters import verl_adapter
from asynctrace.rollouts import toy_tokenizer
from asynctrace.rollouts._toy import encode_turns

N = 4  # rollouts per prompt (actor_rollout_ref.rollout.n)
QUESTIONS = ["What is 17 * 23?", "Name a prime above 90.", "Say hello in French."]


def _pad(rows: list[list[int]], width: int, left: bool, fill: int) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=torch.long)
    for r, row in enumerate(rows):
        if row:
            if left:
                out[r, width - len(row) :] = torch.tensor(row)
            else:
                out[r, : len(row)] = torch.tensor(row)
    return out


def rollout_batch(tokenizer: Any, step: int) -> DataProto:
    """One training step's batch at the point where `fit` has computed the advantages."""
    pad_id = tokenizer.token_to_id("<pad>")
    prompts, responses, masks, scores, uids, sources, turns_n = [], [], [], [], [], [], []
    for q, question in enumerate(QUESTIONS):
        prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        for _ in range(N):
            turns = [("assistant", random.choice(["Let me check.", "Sure."]) + "<|im_end|>")]
            if random.random() < 0.5:
                # A tool call: the tool's output is masked 0, the answer after it 1.
                turns += [("tool", "\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n")]
                turns += [("assistant", "Done.<|im_end|>")]
            ids, mask = encode_turns(tokenizer, turns)
            prompts.append(tokenizer.encode(prompt).ids)
            responses.append(ids)
            masks.append(mask)
            turns_n.append(1 + len(turns))  # verl counts the prompt and every turn after it
            scores.append(float(random.random() < 0.5))
            uids.append(f"step{step}-q{q}")
            sources.append("toy/arith" if q < 2 else "toy/chat")
    pw, rw = max(map(len, prompts)), max(map(len, responses)) + 2
    prompt_attention = _pad([[1] * len(p) for p in prompts], pw, True, 0)
    attention = torch.cat([prompt_attention, _pad([[1] * len(r) for r in responses], rw, False, 0)], dim=1)
    response_mask = _pad(masks, rw, False, 0)
    token_level_scores = torch.zeros(len(scores), rw)
    last = attention[:, pw:].sum(dim=1) - 1
    token_level_scores[torch.arange(len(scores)), last] = torch.tensor(scores)
    uid = np.array(uids, dtype=object)
    advantages, returns = compute_grpo_outcome_advantage(token_level_scores, response_mask, uid)
    versions = np.empty(len(scores), dtype=object)
    versions[:] = [step - 1] * len(scores)
    return DataProto.from_dict(
        tensors={
            "prompts": _pad(prompts, pw, True, pad_id),
            "responses": _pad(responses, rw, False, pad_id),
            "attention_mask": attention,
            "response_mask": response_mask,
            "token_level_scores": token_level_scores,
            "token_level_rewards": token_level_scores,
            "advantages": advantages,
            "returns": returns,
        },
        non_tensors={
            "uid": uid,
            "data_source": np.array(sources, dtype=object),
            "__num_turns__": np.array(turns_n, dtype=np.int32),
            "min_global_steps": versions,
            "max_global_steps": versions.copy(),
        },
    )


def main() -> None:
    random.seed(0)
    names = SimpleNamespace(project_name="verl-hook-example", experiment_name="grpo")
    config = SimpleNamespace(trainer=names)
    trainer = SimpleNamespace(tokenizer=toy_tokenizer(), global_steps=0, config=config)
    for step in range(1, 4):
        trainer.global_steps = step
        batch = rollout_batch(trainer.tokenizer, step)
        # The line a user adds to RayPPOTrainer.fit, right after compute_advantage(...):
        verl_adapter.log_batch(trainer, batch)
    session = trainer.asynctrace_session
    session.finish()
    print(session.stats().summary())


if __name__ == "__main__":
    main()
