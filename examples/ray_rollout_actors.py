"""An asynchronous RL job on Ray: 4 rollout actors, one learner, one trace collector.

Rollout actors generate with a policy version that may lag the learner by a step (off-policy),
and log every sample through a `TraceClient`, which never blocks them. The collector owns the
job's one Trackio run and keeps the 8 highest and 8 lowest rewards of each training step across
all four actors. Run it (on a laptop: a local Ray cluster starts), then open the dashboard with:
trackio show --project "asynctrace-ray"
"""

from __future__ import annotations

import random
import time
from typing import Any

import ray

from asynctrace.ray import TraceClient, start_collector

STEPS = 8
PROMPTS_PER_ACTOR = 16
SAMPLES_PER_PROMPT = 4


@ray.remote
class RolloutActor:
    """Stands in for a vLLM/SGLang engine plus reward function."""

    def __init__(self, index: int, collector: Any) -> None:
        self.index = index
        self.rng = random.Random(index)
        # One client per process; batches and ships from a background thread. This toy job
        # runs a step every ~0.1s, so ship often: samples must reach the collector before it
        # closes their step (max_open_steps newer steps later).
        self.traces = TraceClient(collector, flush_interval=0.05)

    def generate(self, step: int, policy_version: int) -> list[float]:
        rewards = []
        for p in range(PROMPTS_PER_ACTOR):
            group = []
            for s in range(SAMPLES_PER_PROMPT):
                reward = self.rng.random()
                rewards.append(reward)
                group.append(
                    {
                        "prompt": f"[actor {self.index}] prompt {p}: what is {p} * {step}?",
                        "response": f"{p * step if reward > 0.3 else p + step}",
                        "reward": reward,
                        "policy_version": policy_version,
                        "prompt_index": p,
                        "sample_index": s,
                    }
                )
            # Traces are capped per *training* step, whichever actor produced them. The client
            # keeps only its own 16 candidates of the step and ships those.
            self.traces.log_samples_nowait(group, step=step)
        # This actor's step is complete: ship its candidates now rather than when the next
        # step starts (or the client's step_timeout passes).
        self.traces.end_step(step)
        time.sleep(0.05)  # generation time
        return rewards

    def close(self) -> str:
        # Ship what is still buffered (with a deadline) before the actor goes away.
        return self.traces.close(timeout=30.0).summary()


@ray.remote
class Learner:
    """Stands in for the trainer: consumes a step's rewards and logs scalar metrics."""

    def __init__(self, collector: Any) -> None:
        self.collector = collector
        self.version = 0

    def train(self, step: int, rewards: list[float]) -> int:
        time.sleep(0.05)  # the optimizer step
        mean = sum(rewards) / len(rewards)
        self.collector.log_metrics.remote({"reward/mean": mean, "samples": len(rewards)}, step=step)
        self.version += 1
        return self.version


def main() -> None:
    ray.init(include_dashboard=False)
    collector = start_collector(
        "asynctrace-ray",
        max_traces_per_step=16,
        sampler="top_bottom",
        max_open_steps=4,  # rollouts run a step ahead of the learner, and shipping takes a moment
    )
    actors = [RolloutActor.remote(i, collector) for i in range(4)]
    learner = Learner.remote(collector)

    version = 0
    pending = [a.generate.remote(0, version) for a in actors]
    for step in range(STEPS):
        # Start the next step's rollouts before training on this one: one step off-policy.
        following = [a.generate.remote(step + 1, version) for a in actors] if step + 1 < STEPS else []
        rewards = [r for batch in ray.get(pending) for r in batch]
        version = ray.get(learner.train.remote(step, rewards))
        pending = following

    for summary in ray.get([a.close.remote() for a in actors]):
        print("client:", summary)
    stats = ray.get(collector.finish.remote())
    run = ray.get(collector.ready.remote())["run"]
    print("collector:", stats.summary())
    print(f'open the dashboard with: trackio show --project "asynctrace-ray"  (run {run})')
    ray.shutdown()
    if not stats.check() or stats.failed or stats.pending:
        raise SystemExit("some traces were not delivered")


if __name__ == "__main__":
    main()
