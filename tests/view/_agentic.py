"""An agentic run written by the real sinks: groups of 16 multi-turn rollouts with tool calls,
groups that tell the step page's filters apart, a prompt sampled in two groups at one step, and an
eval split at some of the same steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio

import asynctrace as at

STEPS = 6  # train steps 0..5
EVAL_STEPS = (0, 5)  # the same step numbers: a 6-step run
MEMBERS = 16
SYSTEM = {"role": "system", "content": "You are an agent: call a tool when you need a fact."}
USER = {"role": "user", "content": "What is the weather in Paris tomorrow?"}
TWICE = "math-14"  # sampled in groups w5-g6 and w7-g6 at step 5 (and w3-g6 at step 3)


def call(i: int) -> dict[str, Any]:
    """Member i's tool call, in OpenAI's form (arguments as a JSON string)."""
    arguments = json.dumps({"city": "Paris", "day": i})
    return {
        "id": f"call-{i}",
        "type": "function",
        "function": {"name": f"lookup_{i}", "arguments": arguments},
    }


def trajectory(i: int) -> list[dict[str, Any]]:
    """Member i: the shared prompt, a tool call (with text beside it for even i, none for odd i),
    the tool's result, the answer."""
    first: dict[str, Any] = {
        "role": "assistant",
        "content": f"I will look it up ({i})." if i % 2 == 0 else None,
    }
    first["tool_calls"] = [call(i)]
    return [
        SYSTEM,
        USER,
        first,
        {
            "role": "tool",
            "tool_call_id": f"call-{i}",
            "name": f"lookup_{i}",
            "content": f"sunny, {20 + i} degrees",
        },
        {"role": "assistant", "content": f"It will be sunny: {20 + i} degrees."},
    ]


def _plain(
    prompt: str, group: str, rewards: list[float], advantages: list[float], **extra: Any
) -> list[at.Sample]:
    return [
        at.Sample(
            messages=[
                {"role": "user", "content": f"Question of {prompt}"},
                {"role": "assistant", "content": f"{i}"},
            ],
            metadata={
                "prompt_id": prompt,
                "group_uid": group,
                "reward": r,
                "advantage": a,
                "stop_reason": extra.get("stops", {}).get(i, "stop"),
                "response_len": 5 + i,
            },
        )
        for i, (r, a) in enumerate(zip(rewards, advantages, strict=True))
    ]


def samples(step: int, split: str) -> list[at.Sample]:
    if split == "eval":
        return _plain("p-up", "e-up", [1.0, 0.0], [0.5, 0.5])
    out = [
        at.Sample(
            messages=trajectory(i),
            metadata={
                "prompt_id": "p-tools",
                "group_uid": f"w{step}-tools",
                "reward": 1.0 if i < MEMBERS // 2 else 0.0,
                "advantage": 0.5 if i < MEMBERS // 2 else -0.5,
                "stop_reason": "length" if i == MEMBERS - 1 else "stop",
                "response_len": 10 + i,
                "policy_version": step,
            },
        )
        for i in range(MEMBERS)
    ]
    out += _plain("p-flat", f"w{step}-flat", [1.0] * 4, [0.0] * 4)
    out += _plain("p-up", f"w{step}-up", [1.0, 0.5, 0.5, 0.0], [0.5] * 4)
    out += _plain("p-down", f"w{step}-down", [1.0, 0.5, 0.5, 0.0], [-0.5] * 4, stops={3: "length"})
    for group in {3: ["w3-g6"], 5: ["w5-g6", "w7-g6"]}.get(step, []):
        out += _plain(TWICE, group, [1.0, 0.0], [0.5, -0.5])
    return out


def write(root: Path) -> tuple[Path, Path]:
    """The run through a real session into `root`: (Parquet directory, JSONL file)."""
    parquet, jsonl = root / "agentic", root / "agentic-jsonl" / "run.jsonl"

    async def main() -> None:
        # In-process writer: the files are what is read here; tests/sinks/ test the writer process.
        sinks = [at.ParquetSink(parquet, process=False), at.JsonlSink(jsonl)]
        async with at.TraceSession("view-agentic", run="r", sinks=sinks, health_metrics=False) as session:
            for step in range(STEPS):
                await session.log_samples(samples(step, "train"), step=step)
                if step in EVAL_STEPS:
                    await session.log_samples(samples(step, "eval"), step=step, split="eval")
        assert session.stats().check()

    anyio.run(main)
    return parquet, jsonl
