"""slime's rollouts logged through `slime_adapter.log_rollout`, as slime calls the plugin.

Needs slime's source importable (slime is not on a package index: a clone of THUDM/slime at
commit 624b824a898a on ``PYTHONPATH``; `slime.utils.types` needs only torch and httpx). The
samples are slime's own `Sample`s, numbered as its data source numbers them and filled through
`append_response_tokens` as its generate functions fill them (a tool call, the tool's output
appended untrainable, an answer), with SGLang's answers made up here. In a run, slime calls the
plugin itself once ``--custom-rollout-log-function-path
asynctrace.adapters.slime_adapter.log_rollout`` is on its command line. Nothing is downloaded:
the tokenizer (``--hf-checkpoint``) is built in-process.
Open the dashboard with: trackio show --project "slime-example"
"""

from __future__ import annotations

import argparse
import random
import tempfile

from slime.utils.types import Sample
from transformers import PreTrainedTokenizerFast

from asynctrace.adapters import slime_adapter
from asynctrace.rollouts import toy_tokenizer

N = 4  # --n-samples-per-prompt
QUESTIONS = {"What is 17 * 23?": "391", "Name a prime above 90.": "97", "Spell 'cat' backwards.": "tac"}
TOOL = "\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n"


def generate(args: argparse.Namespace, sample: Sample, tokenizer: object, version: int) -> None:
    """What a multi-turn generate function does with SGLang's answers (made up here)."""

    def ids(text: str) -> list[int]:
        return tokenizer(text=text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]

    sample.tokens = ids(sample.prompt)
    turns = ["<tool_call>python</tool_call><|im_end|>"] if random.random() < 0.5 else []
    turns.append(random.choice(["391", "97", "tac", "I am not sure."]) + "<|im_end|>")
    for j, turn in enumerate(turns):
        if j:
            sample.append_response_tokens(args, tokens=ids(TOOL), trainable=False, text=TOOL)
        tokens = ids(turn)
        meta = {"finish_reason": {"type": "stop"}, "weight_version": str(version)}
        logprobs = [-random.random() for _ in tokens]
        sample.append_response_tokens(args, tokens=tokens, log_probs=logprobs, meta_info=meta, text=turn)
    sample.reward = float(sample.label in turns[-1])


def main() -> None:
    random.seed(0)
    checkpoint = tempfile.mkdtemp()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=toy_tokenizer(), pad_token="<pad>")
    tokenizer.save_pretrained(checkpoint)
    args = argparse.Namespace(
        hf_checkpoint=checkpoint,
        wandb_project="slime-example",
        wandb_group="grpo",
        n_samples_per_prompt=N,
        rollout_batch_size=len(QUESTIONS),
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=True,
    )
    index = 0
    for rollout_id in range(3):
        samples = []
        for group, (question, label) in enumerate(QUESTIONS.items()):
            for _ in range(N):
                prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
                sample = Sample(prompt=prompt, label=label, group_index=rollout_id * 3 + group, index=index)
                index += 1
                generate(args, sample, tokenizer, version=rollout_id)
                samples.append(sample)
        # What slime's log_rollout_data does with --custom-rollout-log-function-path:
        slime_adapter.log_rollout(rollout_id, args, samples, None, 1.0)
    session = slime_adapter.open_session(args)
    session.finish()
    print(session.stats().summary())


if __name__ == "__main__":
    main()
