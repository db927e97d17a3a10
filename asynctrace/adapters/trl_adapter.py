"""TRL (GRPO): the columns of `log_completions` to samples.

    logs = trainer._logs
    samples = trl_adapter.to_samples(logs["prompt"], logs["completion"], rewards=logs["rewards"],
                             advantages=logs["advantages"], num_generations=args.num_generations)
    await session.log_samples(samples, step=trainer.state.global_step, split=mode)

Prompts and completions are strings or conversations (lists of messages, tool turns
included). `rewards` holds one column per reward function: the columns are kept together as
the nested `reward_breakdown`, and `reward` is their weighted sum, skipping NaN (TRL's mark
for a reward function that does not apply), as TRL computes it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .._record import Sample
from ..rollouts._align import MISSING, Shortfall
from ..rollouts._mapping import prompt_indices
from ._common import as_sequence, jsonable, role_name

__all__ = ["to_samples"]

_WHERE = "trl_adapter.to_samples"


def to_samples(
    prompt: Sequence[Any],
    completion: Sequence[Any],
    *,
    rewards: Mapping[str, Sequence[float]] | None = None,
    advantages: Sequence[float] | None = None,
    extra: Mapping[str, Sequence[Any]] | None = None,
    num_generations: int | None = None,
    reward_weights: Sequence[float] | None = None,
) -> list[Sample]:
    """One sample per completion, with its prompt, rewards, advantage and extra columns.

    `num_generations` (completions per prompt, in blocks as TRL lays them out) adds
    `prompt_index`. Optional columns shorter than the completions are left out where they fall
    short, with one warning.
    """
    prompts = as_sequence(prompt, "prompt")
    completions = as_sequence(completion, "completion")
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"prompt: has {len(prompts)} entries but completion has {n}")
    groups = None
    if num_generations is not None:
        if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 1:
            raise ValueError(f"num_generations: expected a positive int, got {num_generations!r}")
        if n % num_generations:
            raise ValueError(f"num_generations: {n} completions are not whole groups of {num_generations}")
        groups = prompt_indices(n_prompts=n // num_generations, n_samples=n)
    columns = dict(rewards or {})
    # Plain floats: TRL keeps its weights as a tensor, whose elements would make `reward` a tensor.
    weights = (
        [float(w) for w in _weights(reward_weights)] if reward_weights is not None else [1.0] * len(columns)
    )
    if len(weights) != len(columns):
        raise ValueError(f"reward_weights: has {len(weights)} weights for {len(columns)} reward functions")
    own = {"sample_index"}
    if groups is not None:
        own.add("prompt_index")
    if columns:
        own |= {"reward", "reward_breakdown"}
    if advantages is not None:
        own.add("advantage")
    for name in extra or {}:
        if name in own:
            # Written last, it would silently replace the adapter's own value (the sampler ranks by reward).
            raise ValueError(
                f"extra[{name!r}]: clashes with a metadata key the adapter sets here; rename the column"
            )

    short = Shortfall(_WHERE, n)
    samples = []
    for i in range(n):
        messages = _messages(prompts[i], "user", f"prompt[{i}]") + _messages(
            completions[i], "assistant", f"completion[{i}]"
        )
        metadata: dict[str, Any] = {"sample_index": i}
        if groups is not None:
            metadata["prompt_index"] = groups[i]
        breakdown: dict[str, float | None] = {}
        total = 0.0
        for (name, column), weight in zip(columns.items(), weights, strict=True):
            value = short.pick(column, i, f"rewards[{name!r}]")
            if value is MISSING or value is None:
                continue
            value = float(value)
            if math.isnan(value):
                breakdown[name] = None
                continue
            breakdown[name] = value
            total += weight * value
        if columns and breakdown:
            metadata["reward_breakdown"] = breakdown
            # TRL's nansum: a row whose every reward function returned NaN gets 0.0.
            metadata["reward"] = total
        advantage = short.pick(advantages, i, "advantages")
        if advantage is not MISSING and advantage is not None:
            metadata["advantage"] = float(advantage)
        for name, column in (extra or {}).items():
            value = short.pick(column, i, f"extra[{name!r}]")
            if value is not MISSING:
                metadata[name] = jsonable(value)
        samples.append(Sample(messages=messages, metadata=metadata))
    short.warn()
    return samples


def _weights(value: Any) -> list[Any]:
    """The reward weights as a list: a tensor or array (as TRL keeps them), or any iterable."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    try:
        return list(value)
    except TypeError:
        raise ValueError(
            f"reward_weights: expected a sequence of numbers, got {type(value).__name__}"
        ) from None


def _messages(value: Any, role: str, name: str) -> list[dict[str, Any]]:
    """A string as one message of `role`, a conversation as fresh copies of its messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, Sequence):
        raise ValueError(f"{name}: expected a string or a list of messages, got {type(value).__name__}")
    out = []
    for j, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise ValueError(f"{name}[{j}]: expected a message (a dict), got {type(message).__name__}")
        copy = {str(k): jsonable(v) for k, v in dict(message).items()}
        copy["role"] = role_name(message.get("role", role))
        out.append(copy)
    return out
