"""What the viewer's pages show: one step, one group, one completion, one prompt at one step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = [
    "TRUNCATED",
    "Completion",
    "GroupRow",
    "PromptStep",
    "StepRow",
    "prompt_steps",
    "split_messages",
]

# Stop reasons that mean the completion hit its token budget (vLLM and SGLang say "length").
TRUNCATED: tuple[str, ...] = ("length", "max_tokens", "truncated")


@dataclass(frozen=True, slots=True)
class StepRow:
    """One step of one split, as the overview shows it."""

    split: str
    step: int
    samples: int
    reward_mean: float | None
    reward_std: float | None
    groups: int
    zero_signal: int
    mean_spread: float | None
    truncated: float | None
    length_mean: float | None
    lag_mean: float | None
    lag_max: int | None


@dataclass(frozen=True, slots=True)
class GroupRow:
    """One prompt group of a step: its size, reward mean and spread (population standard deviation)."""

    group: str
    prompt: str | None
    samples: int
    reward_mean: float | None
    spread: float | None
    truncated: int
    first_id: str


@dataclass(frozen=True, slots=True)
class Completion:
    """One record with its texts: the prompt (every message before the last) and the completion."""

    id: str
    step: int
    split: str
    group: str | None
    prompt_id: str | None
    reward: float | None
    advantage: float | None
    policy_version: int | None
    stop_reason: str | None
    length: int | None
    has_tokens: bool
    prompt: str
    text: str
    messages: list[dict[str, Any]]
    metadata: dict[str, Any]
    loaded: bool = True


@dataclass(frozen=True, slots=True)
class PromptStep:
    """One prompt at one step: how many completions, their rewards and policy versions."""

    step: int
    group: str | None
    samples: int
    reward_mean: float | None
    reward_min: float | None
    reward_max: float | None
    spread: float | None
    versions: str


def _content(message: dict[str, Any]) -> str:
    """A message's text: its content (the text parts of a list of parts), else its tool calls as JSON."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    if not content and message.get("tool_calls"):
        return "[tool_calls] " + orjson.dumps(message["tool_calls"]).decode()
    return content if isinstance(content, str) else ""


def split_messages(messages: list[dict[str, Any]]) -> tuple[str, str]:
    """(prompt, completion): the last message is the completion when the assistant wrote it."""
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        head, last = messages[:-1], _content(messages[-1])
    else:
        head, last = messages, ""
    prompt = "\n\n".join(f"{m.get('role', '?')}: {_content(m)}" for m in head if isinstance(m, dict))
    return prompt, last


def prompt_steps(completions: Sequence[Completion]) -> list[PromptStep]:
    """One prompt's completions summed up per step (from the index's values: no text needed)."""
    by_step: dict[int, list[Completion]] = {}
    for c in completions:
        by_step.setdefault(c.step, []).append(c)
    out = []
    for step, items in sorted(by_step.items()):
        rewards = [c.reward for c in items if c.reward is not None]
        mean = math.fsum(rewards) / len(rewards) if rewards else None
        spread = (
            math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
            if mean is not None
            else None
        )
        versions = sorted({c.policy_version for c in items if c.policy_version is not None})
        out.append(
            PromptStep(
                step=step,
                group=min((c.group for c in items if c.group is not None), default=None),
                samples=len(items),
                reward_mean=mean,
                reward_min=min(rewards, default=None),
                reward_max=max(rewards, default=None),
                spread=spread,
                versions=", ".join(str(v) for v in versions),
            )
        )
    return out
