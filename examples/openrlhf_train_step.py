"""OpenRLHF's experience batches logged through `openrlhf_adapter.log_train_batch`, as `train_step` calls it.

Needs OpenRLHF installed (``pip install --no-deps openrlhf==0.11.2`` plus the dev extra). The
rollouts come from OpenRLHF's own `MultiTurnAgentExecutor` (a tool call, the tool's answer, an
answer) driven by a scripted stand-in for vLLM, become `Experience`s as `SamplesGenerator` builds
them, micro-batches by `Experience.concat_experiences`, and get GRPO (`group_norm`) advantages
the way `RemoteExperienceMaker.compute_advantages_and_returns` computes them. The trainer here
carries only what the hook reads from OpenRLHF's `PPOTrainer`: `tokenizer` and `args`. Nothing
is downloaded: the tokenizer is built in-process.
Open the dashboard with: trackio show --project "openrlhf-example"
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace as NS
from typing import Any

import torch
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor
from transformers import PreTrainedTokenizerFast

from asynctrace.adapters import openrlhf_adapter
from asynctrace.rollouts import toy_tokenizer

N = 4  # --rollout.n_samples_per_prompt
QUESTIONS = {"What is 17 * 23?": "391", "Name a prime above 90.": "97", "Spell 'cat' backwards.": "tac"}
TOOL = "\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n"


class Engine:
    """Stands in for vLLM: a random answer, sometimes a tool call first."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    async def generate(
        self, prompt_ids: list[int], sampling_params: Any, multi_modal_data: Any = None
    ) -> Any:
        first_turn = TOOL not in self.tokenizer.decode(prompt_ids)
        choices = ["<tool_call>python</tool_call>", "391", "97", "tac", "I am not sure."]
        text = random.choice(choices if first_turn else choices[1:]) + "<|im_end|>"
        ids = self.tokenizer(text=text, add_special_tokens=False)["input_ids"]
        return NS(outputs=[NS(token_ids=ids, text=text, finish_reason="stop", logprobs=None)])


class Env(AgentInstanceBase):
    """Answers a tool call with the tool's output; any other answer ends the episode, scored by the label."""

    def __init__(self) -> None:
        pass

    async def step(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        if "<tool_call>" in states["action_text"]:
            return {"rewards": torch.tensor(0.0), "environment_feedback": TOOL, "done": False}
        reward = float(states["label"] in states["action_text"])
        return {"rewards": torch.tensor(reward), "environment_feedback": "", "done": True}


def experience_of(response: dict[str, Any]) -> Experience:
    """A response as `SamplesGenerator._process_response_into_experience` turns it into an Experience."""
    sequences = torch.tensor(response["observation_tokens"])
    mask = torch.zeros_like(sequences)
    for start, end in response["action_ranges"]:
        mask[start:end] = 1
    reward = torch.tensor([float(response["reward"])])
    return Experience(
        sequences=sequences.unsqueeze(0),
        attention_mask=torch.ones_like(sequences).unsqueeze(0),
        action_mask=mask[1:].unsqueeze(0),  # OpenRLHF aligns it on sequences[:, 1:]
        prompts=[response["prompt"]],
        labels=[response["label"]],
        rewards=reward,
        truncated=torch.tensor([response["truncated"]]),
        info={"reward": reward},
    )


async def rollouts(tokenizer: Any) -> list[Experience]:
    executor, engine = MultiTurnAgentExecutor(Env), Engine(tokenizer)
    out = []
    for question, label in QUESTIONS.items():
        prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        params = NS(max_tokens=None, logprobs=None)
        for _ in range(N):
            response = await executor.execute(prompt, label, params, 256, tokenizer, engine)
            out.append(experience_of(response))
    return out


def make_experience_batch(samples: list[Experience], pad_id: int) -> list[Experience]:
    """Micro-batches of 4 with GRPO advantages, as `make_experience_batch` gives them (no KL)."""
    for i, sample in enumerate(samples):
        sample.index = [i]
    batches = [Experience.concat_experiences(samples[i : i + 4], pad_id) for i in range(0, len(samples), 4)]
    rewards = torch.cat([b.rewards for b in batches]).reshape(-1, N)
    normed = ((rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-9)).reshape(-1)
    for batch in batches:
        # Every action token carries its sample's normalised reward (gamma 1, reward at the end).
        batch.advantages = normed[[i for i in batch.index]].unsqueeze(1) * batch.action_mask.float()
    return batches


def main() -> None:
    random.seed(0)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=toy_tokenizer(), pad_token="<pad>")
    args = NS(
        rollout=NS(n_samples_per_prompt=N),
        train=NS(async_enable=False),
        logger=NS(wandb=NS(project="openrlhf-example", run_name="grpo")),
    )
    trainer = NS(tokenizer=tokenizer, args=args)
    for global_step in range(3):
        rollout_samples = asyncio.run(rollouts(tokenizer))
        experiences = make_experience_batch(rollout_samples, tokenizer.pad_token_id)
        # The line a user adds to BasePPOTrainer.train_step, right after make_experience_batch:
        openrlhf_adapter.log_train_batch(trainer, experiences, global_step)
    session = trainer.asynctrace_session
    session.finish()
    print(session.stats().summary())


if __name__ == "__main__":
    main()
