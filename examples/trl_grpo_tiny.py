"""TRL GRPO on CPU, traced with asynctrace: a tiny random model, nothing downloaded.

    pip install -e . "trl==1.16.0"
    python examples/trl_grpo_tiny.py
    trackio show --project asynctrace-trl-example

The model is a randomly initialised one-layer Qwen2 and the tokenizer a byte-level BPE trained
in-process, so the completions are noise; what matters is the integration, two lines below
(`from asynctrace.adapters.trl_adapter import attach` and `attach(trainer, ...)`). It runs 4
GRPO steps with an eval pass every 2, in well under a minute.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from asynctrace.adapters.trl_adapter import attach
from asynctrace.rollouts import toy_tokenizer


def brevity(completions: list[Any], **kwargs: Any) -> list[float]:
    """Shorter is better."""
    return [-float(len(c[0]["content"])) for c in completions]


def has_digit(completions: list[Any], **kwargs: Any) -> list[float | None]:
    """1 for a completion with a digit, 0 without; None (not applicable) for the 'chat' prompts."""
    return [
        None if task == "chat" else float(any(ch.isdigit() for ch in c[0]["content"]))
        for c, task in zip(completions, kwargs["task"], strict=True)
    ]


def main() -> None:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=toy_tokenizer(), pad_token="<pad>", eos_token="<|im_end|>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    )
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "task": "math" if i % 2 else "chat"}
        for i in range(16)
    ]
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-tiny-"),
        project="asynctrace-trl-example",
        run_name="grpo-tiny",
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        max_steps=4,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        num_iterations=2,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4,
        reward_weights=[0.1, 1.0],
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[brevity, has_digit],
        args=args,
        train_dataset=Dataset.from_list(rows[:12]),
        eval_dataset=Dataset.from_list(rows[12:]),
        processing_class=tokenizer,
    )
    tracer = attach(trainer, max_traces_per_step=16)
    trainer.train()

    if tracer.session is not None:  # None on processes other than the main one
        stats = tracer.session.stats()
        print(f"batches logged: {tracer.batches}; {stats.summary()}; invariant holds: {stats.check()}")
        print(f'view them: trackio show --project "{args.project}"')


if __name__ == "__main__":
    main()
