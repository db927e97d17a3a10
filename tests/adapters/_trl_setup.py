"""A real TRL GRPOTrainer small enough for CPU, and what it computed, for the TRL tests.

Shared by the in-process test and the `torchrun` script (`_trl_torchrun.py`). Nothing is
downloaded: the model is a randomly initialised two-head Qwen2 and the tokenizer a byte-level
BPE trained in-process, wrapped as a `PreTrainedTokenizerFast` with a chat template.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from asynctrace.rollouts import toy_tokenizer

# transformers' models and TRL's trainer take seconds to import: each function imports what it
# builds, so collecting the TRL tests does not pay for them.
if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM
    from trl import GRPOTrainer

WEIGHTS = (0.5, 2.0)
"""reward_weights for (length, keyword): exact in float32, so the weighted sums compare exactly."""

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def hf_tokenizer() -> PreTrainedTokenizerFast:
    """The in-process tokenizer as transformers and TRL use it."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=toy_tokenizer(), pad_token="<pad>", eos_token="<|im_end|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_model(vocab_size: int) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 with one layer of width 16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Qwen2ForCausalLM(config)


def conversations(n: int, what: str) -> Dataset:
    """`n` conversational prompts."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"{what} {i}?"}]} for i in range(n)])


class Recorder:
    """Reward functions that record what TRL gave them and what they returned, and a spy on
    each generated batch that records TRL's split, step, advantages and mean reward.

    Per call (one local batch): row 0 is unscorable (every function returns None), row 1 is
    scored by `length` only, the other rows by both.
    """

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []
        self._pending: dict[str, Any] = {}

    def length(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        """1 + the completion's length mod 3 (never 0), None for the first row."""
        texts = [c[0]["content"] for c in completions]
        values = [None if i == 0 else 1.0 + len(t) % 3 for i, t in enumerate(texts)]
        kwargs["log_extra"]("chars", [len(t) for t in texts])
        self._pending.update(prompts=prompts, completions=completions, length=values)
        return values

    def keyword(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        """1 when the completion holds an 'e', else 0.5; None for the first two rows."""
        texts = [c[0]["content"] for c in completions]
        values = [None if i < 2 else (1.0 if "e" in t else 0.5) for i, t in enumerate(texts)]
        self._pending["keyword"] = values
        return values

    def spy(self, trainer: GRPOTrainer) -> None:
        """Record every batch `_generate_and_score_completions` returns (outermost wrapper)."""
        inner = trainer._generate_and_score_completions

        def generate_and_score(inputs: Any) -> Any:
            split = "train" if trainer.model.training else "eval"
            step = trainer.state.global_step
            self._pending = {}
            output = inner(inputs)
            self.batches.append(
                {
                    "split": split,
                    "step": step,
                    **self._pending,
                    # The local slice, in generation order (TRL shuffles it only afterwards).
                    "advantages": output["advantages"].tolist(),
                    "reward_mean": trainer._metrics[split]["reward"][-1],
                }
            )
            return output

        trainer._generate_and_score_completions = generate_and_score


def build_trainer(output_dir: str, project: str, run: str, recorder: Recorder) -> GRPOTrainer:
    """GRPO with num_iterations=2, logging_steps=2 and an eval pass every 2 steps, for 4 steps."""
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = hf_tokenizer()
    args = GRPOConfig(
        output_dir=output_dir,
        project=project,
        run_name=run,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        seed=0,
        max_steps=4,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        num_iterations=2,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4,
        num_generations_eval=2,
        reward_weights=list(WEIGHTS),
        log_completions=True,
    )
    return GRPOTrainer(
        model=tiny_model(len(tokenizer)),
        reward_funcs=[recorder.length, recorder.keyword],
        args=args,
        train_dataset=conversations(16, "What is"),
        eval_dataset=conversations(4, "Name"),
        processing_class=tokenizer,
    )


def expected_rows(per_rank: list[list[dict[str, Any]]], num_generations: int = 2) -> list[dict[str, Any]]:
    """The trace each generated row must become: the ranks' batches gathered as TRL gathers
    them (rank order), weighted as TRL weighs them, keyed by (split, batch_index, sample_index)."""
    rows = []
    counts: dict[str, int] = {}
    for batches in zip(*per_rank, strict=True):
        first = batches[0]
        batch = counts.get(first["split"], 0)
        counts[first["split"]] = batch + 1
        gathered: dict[str, list[Any]] = {
            k: [v for b in batches for v in b[k]]
            for k in ("prompts", "completions", "length", "keyword", "advantages")
        }
        for i, (prompt, completion) in enumerate(
            zip(gathered["prompts"], gathered["completions"], strict=True)
        ):
            breakdown = {"length": gathered["length"][i], "keyword": gathered["keyword"][i]}
            scored = [(w, v) for w, v in zip(WEIGHTS, breakdown.values(), strict=True) if v is not None]
            rows.append(
                {
                    "split": first["split"],
                    "step": first["step"],
                    "messages": [*prompt, *completion],
                    "metadata": {
                        "sample_index": i,
                        "prompt_index": i // num_generations,
                        "batch_index": batch,
                        "reward_breakdown": breakdown,
                        "reward": sum(w * v for w, v in scored) if scored else None,
                        "advantage": gathered["advantages"][i],
                        "chars": len(completion[0]["content"]),
                    },
                    "reward_mean": first["reward_mean"],
                }
            )
    return rows


def nanmean(values: list[float | None]) -> float:
    """The mean of the values that are not None (TRL's nanmean)."""
    scored = [v for v in values if v is not None and not math.isnan(v)]
    return sum(scored) / len(scored)
