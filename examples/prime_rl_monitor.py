"""prime-rl's trained cohorts logged through `prime_rl_adapter.TraceMonitor`, as its orchestrator
hands them to every monitor.

Needs verifiers (``pip install --no-deps verifiers==0.4.0`` and the packages listed with it in
tests/frameworks-nodeps.txt); prime-rl itself is not needed. Each step's episodes are
`verifiers.v1.Episode`s with a tool-call turn, rewards, a group and a policy span; their
advantages are GRPO's (reward minus the group mean on every sampled token, as prime-rl's
`GRPOAlgorithm` assigns them), and the monitor gets them through its `log(episodes, step, kind,
subset)`, the call of prime-rl's `monitors.log`. Nothing is downloaded: the tokenizer is built
in-process. Open the dashboard with: trackio show --project "prime-rl-example"
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import verifiers.v1 as vf

from asynctrace.adapters import prime_rl_adapter
from asynctrace.rollouts import toy_tokenizer

GROUP_SIZE = 4
QUESTIONS = [("What is 17 * 23?", "17 * 23", 391), ("What is 12 * 12?", "12 * 12", 144)]


def _node(tokenizer: Any, message: Any, text: str, sampled: bool, parent: int | None) -> Any:
    ids = tokenizer.encode(text).ids
    logprobs = [-random.random() for _ in ids] if sampled else [0.0] * len(ids)
    mask = [sampled] * len(ids)
    return vf.MessageNode(
        message=message, token_ids=ids, mask=mask, logprobs=logprobs, sampled=sampled, parent=parent
    )


def episode(tokenizer: Any, step: int, q: int, k: int) -> Any:
    """One rollout: the question, a python tool call, its answer, then the reply."""
    question, expression, right = QUESTIONS[q]
    answer = str(right + random.choice([0, 0, 1]))  # the tool's result, sometimes off by one
    call = vf.ToolCall(id=f"c{k}", name="python", arguments=json.dumps({"code": expression}))
    nodes = [_node(tokenizer, vf.UserMessage(content=question), question, False, None)]
    nodes.append(_node(tokenizer, vf.AssistantMessage(content="", tool_calls=[call]), expression, True, 0))
    nodes.append(_node(tokenizer, vf.ToolMessage(content=answer, tool_call_id=f"c{k}"), answer, False, 1))
    reply = f"It is {answer}."
    nodes.append(_node(tokenizer, vf.AssistantMessage(content=reply), reply, True, 2))
    trace = vf.Trace[vf.TaskData](
        task=vf.TraceTask(type="Task", data=vf.TaskData(idx=q, prompt=question)),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
        nodes=nodes,
        rewards={"correct": vf.Reward(score=float(answer == str(right)))},
        ok=True,
    )
    work = vf.TrainWorkInfo(step=step, policy=vf.PolicySpan(start=max(step - 2, 0), end=max(step - 1, 0)))
    return vf.Episode(
        env=vf.EnvInfo(id="arith", name="arith"),
        task=trace.task,
        group=vf.GroupInfo(id=f"step{step}-q{q}"),
        run=vf.TrainRunInfo(id="example", work=work),
        traces=[trace],
    )


def grpo(group: list[Any]) -> None:
    """GRPO's credit, as prime-rl assigns it: reward minus the group mean, on each sampled token."""
    mean = sum(e.traces[0].reward for e in group) / len(group)
    for e in group:
        trace = e.traces[0]
        for node in trace.nodes:
            if any(node.mask):
                node.advantages = [trace.reward - mean] * sum(node.mask)


async def main() -> None:
    random.seed(0)
    tokenizer = toy_tokenizer()
    monitor = prime_rl_adapter.TraceMonitor("prime-rl-example")
    for step in range(1, 4):
        cohort = []
        for q in range(len(QUESTIONS)):
            group = [episode(tokenizer, step, q, k) for k in range(GROUP_SIZE)]
            grpo(group)
            cohort += group
        await monitor.log(cohort, step, "train", "effective")  # what monitors.log hands each monitor
    await monitor.finalize()  # prime-rl's monitors.finalize() at the end of the run
    print("logged 3 steps of", len(QUESTIONS) * GROUP_SIZE, "rollouts to project prime-rl-example")


if __name__ == "__main__":
    asyncio.run(main())
