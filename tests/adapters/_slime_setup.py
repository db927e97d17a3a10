"""slime's rollouts as its own code builds them, for the slime tests and the Ray actor that runs them.

The `Sample` API and data source run from slime's source at a pinned commit
(tests/adapters/_upstream/slime_*.py); what SGLang would generate is scripted (`SCRIPT`), and the
arguments are slime's defaults for what that code reads, with docs/frameworks/slime.md's flags.
"""

from __future__ import annotations

import argparse
import shlex
import uuid
from pathlib import Path
from typing import Any

from tests.adapters._snippets import code_block
from tests.adapters._upstream.slime_arguments import add_log_function_arguments
from tests.adapters._upstream.slime_rollout import RolloutDataSource
from tests.adapters._upstream.slime_types import Sample

N = 3
PROMPTS = [
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nName a prime above 90.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nSpell 'cat' backwards.<|im_end|>\n<|im_start|>assistant\n",
]
LABELS = ["391", "97", "tac"]
TOOL = "\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n"
CALL = '<tool_call>{"name": "python", "code": "print(17 * 23)"}</tool_call><|im_end|>'
# What SGLang answers, per rollout: a list of turns, a tool call getting TOOL back.
SCRIPT = [
    [[CALL, "The answer is 391.<|im_end|>"], ["It is 391.<|im_end|>"], ["17 * 23 = 381, I think.<|im_end|>"]],
    [["97<|im_end|>"], ["91 is prime.<|im_end|>"], [CALL, "Hm, 391 is not prime.<|im_end|>"]],
    [["tac<|im_end|>"], ["act<|im_end|>"], ["It is tac: t-a-c reversed from c-a-t.<|im_end|>"]],
]


def _flags() -> argparse.Namespace:
    """The page's flags, parsed by slime's own definitions of them."""
    words = shlex.split(code_block("slime.md", "bash"))
    return add_log_function_arguments(argparse.ArgumentParser()).parse_args(words)


def make_args(checkpoint: Path, **overrides: Any) -> argparse.Namespace:
    """slime's arguments as the exercised code reads them (slime's defaults), the page's flags included."""
    args = _flags()
    values = {
        "hf_checkpoint": str(checkpoint),
        "wandb_project": f"slime-{uuid.uuid4().hex[:8]}",
        "wandb_group": "grpo/tool",
        "n_samples_per_prompt": N,
        "n_samples_per_eval_prompt": 2,
        "rollout_batch_size": len(PROMPTS),
        "global_batch_size": len(PROMPTS) * N,
        "advantage_estimator": "grpo",
        "rewards_normalization": True,
        "grpo_std_normalization": True,
        "normalize_advantages": False,
        "reward_key": None,
        "custom_reward_post_process_path": None,
        "custom_advantage_function_path": None,
        "rollout_global_dataset": False,
        "prompt_data": None,
        "load_debug_rollout_data": None,
        "use_wandb": False,
        "use_tensorboard": False,
        "wandb_always_use_train_step": False,
        "rollout_num_gpus": 1,
        "log_reward_category": None,
        "log_passrate": True,
        "rollout_top_p": 1.0,
        "use_rollout_routing_replay": False,
        "sglang_speculative_algorithm": None,
        "kl_coef": 0.0,
        "kl_loss_type": "k1",
        "use_rollout_logprobs": True,
        "use_opd": False,
    }
    vars(args).update({**values, **overrides})
    return args


class _Prompts:
    """The prompt dataset `RolloutDataSource.get_samples` reads: `samples` and a length."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)


def logprob_of(position: int) -> float:
    return -0.01 * (position + 1)


def _generate(
    args: argparse.Namespace, sample: Sample, turns: list[str], hf_tokenizer: Any, version: str
) -> None:
    """What slime's `generate` does with SGLang's answers: `append_response_tokens` for each turn,
    the tool's output appended untrainable, as a multi-turn generate function does."""
    sample.tokens = hf_tokenizer(text=sample.prompt, add_special_tokens=False)["input_ids"]
    for j, turn in enumerate(turns):
        if j:
            tool = hf_tokenizer(text=TOOL, add_special_tokens=False)["input_ids"]
            sample.append_response_tokens(args, tokens=tool, trainable=False, text=TOOL)
        ids = hf_tokenizer(text=turn, add_special_tokens=False)["input_ids"]
        meta = {"finish_reason": {"type": "stop"}, "weight_version": version}
        logprobs = [logprob_of(i) for i in range(len(ids))]
        sample.append_response_tokens(
            args, tokens=ids, log_probs=logprobs, trainable=True, meta_info=meta, text=turn
        )
    # The reward model, as a custom rm scores it.
    sample.reward = 1.0 if sample.label in turns[-1] else 0.0


def rollout(args: argparse.Namespace, hf_tokenizer: Any, *, version: str = "12") -> list[Sample]:
    """One rollout's samples, numbered by slime's data source and flattened as `_get_rollout_data` does."""
    source = RolloutDataSource(args)
    source.dataset = _Prompts(
        [Sample(prompt=p, label=label) for p, label in zip(PROMPTS, LABELS, strict=True)]
    )
    groups = source.get_samples(len(PROMPTS))
    for p, group in enumerate(groups):
        for k, sample in enumerate(group):
            _generate(args, sample, SCRIPT[p][k], hf_tokenizer, version)
    return [sample for group in groups for sample in group]
