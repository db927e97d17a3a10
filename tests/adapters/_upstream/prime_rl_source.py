# ruff: noqa
# mypy: ignore-errors
"""prime-rl's own code for what its orchestrator does to episodes up to its monitors, unchanged.

Source: PrimeIntellect-ai/prime-rl (https://github.com/PrimeIntellect-ai/prime-rl) at commit
559b44772e471d1538537b8805cc77f3824a5e64 (2026-08-21, v0.8.1.dev67). Licensed under the Apache License, Version 2.0
(http://www.apache.org/licenses/LICENSE-2.0); distributed on an "AS IS" BASIS, WITHOUT
WARRANTIES OR CONDITIONS OF ANY KIND.

Why a copy and not the package: prime-rl is not on the package index (it is installed from its
repository, and requires Python 3.12 with vLLM, torchtitan and flash-attention).

Each definition below is copied byte for byte (by name, with `ast`) from the file and lines
named in the comment above it. The only changes are the imports at the top, standing in for the
modules these files import: `get_logger` (prime_rl.utils.logger, a loguru logger) by `logging`'s,
which these calls use the same way; `sanitize` (prime_rl.utils.utils), used only by
`FileMonitor.log_metrics`, by a function returning the metrics as they are; and the config types
named only in annotations (`GRPOAlgoConfig`, `FileMonitorConfig`, ...) by `Any`. The episodes
themselves are `verifiers.v1` classes from the installed verifiers package.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Literal, TextIO, overload

import orjson
import torch
import verifiers.v1 as vf

GRPOAlgoConfig = Any
AlgoConfig = Any
ActionLossType = Any
FrozenModelConfig = Any
InferencePool = Any
BaseConfig = Any
FileMonitorConfig = Any


def get_logger() -> logging.Logger:
    """Stand-in for prime_rl.utils.logger.get_logger."""
    return logging.getLogger("prime_rl")


def sanitize(metrics: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Stand-in for prime_rl.utils.utils.sanitize (only FileMonitor.log_metrics calls it)."""
    return metrics, []


# src/prime_rl/orchestrator/utils.py, lines 23-27
def episode_env_name(episode: vf.Episode[Any, Any, Any]) -> str:
    name = episode.env.name
    if name is None:
        raise ValueError("Orchestrated episode is missing its environment name")
    return name


# src/prime_rl/orchestrator/utils.py, lines 30-34
def episode_group_id(episode: vf.Episode[Any, Any, Any]) -> str:
    group = episode.group
    if group is None:
        raise ValueError("Orchestrated episode is missing its rollout group")
    return group.id


# src/prime_rl/orchestrator/utils.py, lines 37-41
def train_work(episode: vf.Episode[Any, Any, Any]) -> vf.TrainWorkInfo:
    run = episode.run
    if not isinstance(run, vf.TrainRunInfo) or not isinstance(run.work, vf.TrainWorkInfo):
        raise ValueError("Train episode is missing training-work provenance")
    return run.work


# src/prime_rl/orchestrator/algo/routing.py, lines 11-34
def assign_advantages(trace: vf.Trace, values: float | list[float]) -> None:
    """Assign credit in compact sampled-token order across the trace graph."""
    nodes = [node for node in trace.nodes if any(node.mask)]
    for node in nodes:
        if len(node.mask) != len(node.token_ids):
            raise ValueError(
                f"node masks must align with token ids in trace {trace.id!r}: "
                f"got {len(node.mask)}, expected {len(node.token_ids)}"
            )
    total = sum(sum(node.mask) for node in nodes)
    if isinstance(values, (int, float)):
        advantages = [float(values)] * total
    else:
        if len(values) != total:
            raise ValueError(
                f"advantages must align with trace {trace.id!r}'s sampled tokens: got {len(values)}, expected {total}"
            )
        advantages = [float(value) for value in values]

    offset = 0
    for node in nodes:
        end = offset + sum(node.mask)
        node.advantages = advantages[offset:end]
        offset = end


# src/prime_rl/orchestrator/algo/routing.py, lines 53-59
def scalar_advantage(trace: vf.Trace) -> float | None:
    """Mean nonzero token advantage, or zero for an assigned-zero trace."""
    advantages = [value for node in trace.nodes for value in node.advantages or []]
    if not advantages:
        return None
    nonzero = [value for value in advantages if value != 0.0]
    return sum(nonzero) / len(nonzero) if nonzero else 0.0


# src/prime_rl/orchestrator/algo/routing.py, lines 62-64
def is_trainable(trace: vf.Trace) -> bool:
    """Whether any sampled token carries nonzero RL credit."""
    return any(value != 0.0 for node in trace.nodes for value in node.advantages or [])


# src/prime_rl/orchestrator/algo/base.py, lines 35-42
def iter_trainable_traces(episodes: list[vf.Episode]):
    """Yield clean trainable traces that contain sampled tokens."""
    for episode in episodes:
        for trace in episode.traces:
            if trace.has_error or not trace.agent.trainable:
                continue
            if any(any(node.mask) for node in trace.nodes):
                yield episode, trace


# src/prime_rl/orchestrator/algo/base.py, lines 45-81
class Algorithm:
    """Assign training annotations directly to verifier episodes.

    Override :meth:`score_episode` for rollout-local work and
    :meth:`score_group` for cohort-relative work. The train sink compiles the
    annotated traces into transport samples only after admission.
    """

    action_loss_type: ClassVar[ActionLossType] = "rl"

    def __init__(self, config: AlgoConfig, policy_pool: InferencePool):
        self.policy_pool = policy_pool
        self.connected_pools: list[InferencePool] = []

    async def setup(self) -> None:
        """Connect resources owned by the algorithm."""

    async def connect(self, reference: FrozenModelConfig) -> InferencePool:
        """Connect and track a frozen model pool owned by this algorithm."""
        pool = await connect_frozen_pool(reference)
        self.connected_pools.append(pool)
        return pool

    async def score_episode(self, episode: vf.Episode) -> None:
        """Assign rollout-local annotations to one finalized episode."""

    async def score_group(self, episodes: list[vf.Episode]) -> None:
        """Assign group-relative annotations to a finalized cohort."""

    async def finalize_episode(self, episode: vf.Episode) -> None:
        """Run rollout-local scoring when the episode has trainable traces."""
        if any(True for _ in iter_trainable_traces([episode])):
            await self.score_episode(episode)

    async def finalize_group(self, episodes: list[vf.Episode]) -> None:
        """Run group-relative scoring over the native episodes."""
        await self.score_group(episodes)


# src/prime_rl/orchestrator/algo/grpo.py, lines 16-45
class GRPOAlgorithm(Algorithm):
    """Group Relative Policy Optimization: sample a group of rollouts from the
    policy per example; credit = reward minus the group mean (optionally
    length-shaped); action tokens feed the ``rl`` loss."""

    def __init__(self, config: GRPOAlgoConfig, policy_pool: InferencePool):
        super().__init__(config, policy_pool)
        self.length_penalty = config.length_penalty

    async def score_group(self, episodes: list[vf.Episode]) -> None:
        traces = [trace for _, trace in iter_trainable_traces(episodes)]
        rewards = torch.tensor([trace.reward for trace in traces], dtype=torch.float32)
        length_penalty = self.length_penalty
        if length_penalty is None:
            advantages = rewards - rewards.mean()
        else:
            output = torch.tensor([trace.num_output_tokens for trace in traces], dtype=rewards.dtype)
            total = torch.tensor([trace.num_total_tokens for trace in traces], dtype=rewards.dtype)
            turns = torch.tensor([trace.num_turns for trace in traces], dtype=rewards.dtype)
            input = total - output
            penalty_frac = (
                length_penalty.num_output_tokens_weight * (output / output.max().clamp(min=1))
                + length_penalty.num_input_tokens_weight * (input / input.max().clamp(min=1))
                + length_penalty.num_turns_weight * (turns / turns.max().clamp(min=1))
            )
            penalty = rewards.mean() * penalty_frac
            shaped_rewards = rewards - penalty
            advantages = shaped_rewards - shaped_rewards.mean()
        for trace, advantage in zip(traces, advantages.tolist(), strict=True):
            assign_advantages(trace, advantage)


# src/prime_rl/monitors/base.py, lines 12-12
Kind = Literal["train", "eval"]


# src/prime_rl/monitors/base.py, lines 13-13
Subset = Literal["all", "effective"]


# src/prime_rl/monitors/base.py, lines 16-55
class Monitor(ABC):
    """Base class for monitors."""

    def __init__(self, config: BaseConfig):
        self.config = config
        self.logger = get_logger()

    async def init(self, **kwargs: Any) -> None:
        """Initialize run. Overrides name their own kwargs."""

    @overload
    async def log(self, data: dict[str, Any], step: int) -> None: ...

    @overload
    async def log(self, data: vf.Episode | list[vf.Episode], step: int, kind: Kind, subset: Subset) -> None: ...

    async def log(
        self,
        data: dict[str, Any] | vf.Episode | list[vf.Episode],
        step: int,
        kind: Kind = "train",
        subset: Subset = "effective",
    ) -> None:
        """Log scalar metrics, or episodes."""
        if isinstance(data, dict):
            await self.log_metrics(data, step=step)
        else:
            episodes = data if isinstance(data, list) else [data]
            await self.log_episodes(episodes, step=step, kind=kind, subset=subset)

    @abstractmethod
    async def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        """Log scalar metrics."""

    @abstractmethod
    async def log_episodes(self, episodes: list[vf.Episode], step: int, kind: Kind, subset: Subset) -> None:
        """Log episodes."""

    async def finalize(self) -> None:
        """Finalize run."""


# src/prime_rl/monitors/file.py, lines 19-62
class FileMonitor(Monitor):
    """Logs metrics and episodes to local JSONL files."""

    config: FileMonitorConfig
    file: TextIO

    async def init(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.path = output_dir / self.config.path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered append so a concurrently-running dashboard can tail the file.
        self.file = open(self.path, "a", buffering=1)  # noqa: SIM115
        self.logger.info(f"Logging metrics to {self.path} and episodes to {output_dir / 'rollouts'}")

    async def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        sanitized, dropped = sanitize(metrics)
        if dropped:
            self.logger.warning(
                f"Dropping {len(dropped)} non-finite value(s) from {self.config.path}: {', '.join(dropped[:5])}"
            )

        row = {"step": step, "time": time.time(), **sanitized}
        self.file.write(json.dumps(row) + "\n")

    async def log_episodes(self, episodes: list[vf.Episode], step: int, kind: Kind, subset: Subset) -> None:
        """Append the cohort to its per-step episode file. ``all`` grows one
        episode at a time as they complete, ``effective`` one batch at a time on finalize,
        so an in-progress run can be inspected live. Episode-level failures are
        preserved even when no trace was produced."""

        def write() -> None:
            path = self.output_dir / "rollouts" / f"step_{step}" / kind / subset / "traces.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            opts = orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY
            with open(path, "ab") as f:
                for episode in episodes:
                    f.write(orjson.dumps(episode.to_record(), default=str, option=opts))

        # Record serialization is heavy pure-Python work; keep it off the event loop.
        # Awaited (not fire-and-forget) so appends to one file never interleave.
        await asyncio.to_thread(write)

    async def finalize(self) -> None:
        self.logger.info(f"Finalized metrics at {self.path}")


# src/prime_rl/monitors/__init__.py, lines 38-38
MONITORS: list[Monitor] = []


# src/prime_rl/monitors/__init__.py, lines 93-94
@overload
async def log(data: dict[str, Any], step: int) -> None: ...


# src/prime_rl/monitors/__init__.py, lines 97-98
@overload
async def log(data: vf.Episode | list[vf.Episode], step: int, kind: Kind, subset: Subset) -> None: ...


# src/prime_rl/monitors/__init__.py, lines 101-113
async def log(
    data: dict[str, Any] | vf.Episode | list[vf.Episode],
    step: int,
    kind: Kind = "train",
    subset: Subset = "effective",
) -> None:
    """Log to all registered monitors: a dict of scalar metrics, or episodes
    with their cohort coordinates (train/eval x all/effective)."""
    for monitor in MONITORS:
        try:
            await monitor.log(data, step=step, kind=kind, subset=subset)
        except Exception as e:
            get_logger().warning(f"Failed to log to {monitor.__class__.__name__}: {e}")


# src/prime_rl/monitors/__init__.py, lines 116-122
async def finalize() -> None:
    """Finalize the run on all registered monitors."""
    for monitor in MONITORS:
        try:
            await monitor.finalize()
        except Exception as e:
            get_logger().warning(f"Failed to finalize {monitor.__class__.__name__}: {e}")

