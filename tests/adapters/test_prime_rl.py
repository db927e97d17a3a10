"""prime-rl's episodes, scored by prime-rl's own GRPO and handed out by its monitor fan-out.

The episodes are `verifiers.v1` objects (verifiers 0.4.0 from the package index) built as
prime-rl's own unit tests build them (tests/unit/orchestrator/test_advantage.py): a message
graph of prompt, sampled assistant turns and tool answers, with rewards, group and policy span.
prime-rl is not on the package index: its GRPO scoring (`GRPOAlgorithm.finalize_group`,
`assign_advantages`), its monitor ABC, `FileMonitor` and the `monitors.log` fan-out run from its
source at a pinned commit (tests/adapters/_upstream/prime_rl_source.py). The orchestrator's glue
is emulated as `main_loop` and `finalize_train_batch` call it (orchestrator.py, lines 592 and 684).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import asynctrace as at
from asynctrace.adapters import prime_rl_adapter
from asynctrace.adapters._sessions import session_for
from tests._util import LazyModule, read_traces
from tests.adapters.conftest import moved

# verifiers' import takes seconds: it runs in the first test that uses it, not at collection.
vf = LazyModule("verifiers.v1")
PRIME = "tests.adapters._upstream.prime_rl_source"
prime = LazyModule(PRIME)

# The tests that run docs/frameworks/prime_rl.md's lines as written, in the framework's own code
# (tests/test_doc_snippets.py checks they are here).
RUNS_PAGE_SNIPPETS = ("test_documented_lines_register_the_monitor",)

DOC = Path(__file__).resolve().parents[2] / "docs" / "frameworks" / "prime_rl.md"
STEP = 4
SYSTEM = "Answer with a number. You may call the python tool."
QUESTIONS = {"g-mul": "What is 17 * 23?", "g-add": "What is 2 + 2?", "g-easy": "What is 1 + 0?"}
# Per group, each rollout's turns: (assistant text, tool call or None); a tool answers a call.
ROLLOUTS: dict[str, list[list[str]]] = {
    "g-mul": [["call:17 * 23", "It is 391."], ["It is 401."]],
    "g-add": [["4"], ["call:2 + 2", "5"]],
    "g-easy": [["1"], ["1"]],  # both right: zero advantages, left out of the trained cohort
}
ANSWERS = {"g-mul": "391", "g-add": "4", "g-easy": "1"}


def _node(tokenizer: Any, message: Any, text: str, *, sampled: bool, parent: int | None, k: int) -> Any:
    ids = tokenizer.encode(text).ids
    return vf.MessageNode(
        message=message,
        token_ids=ids,
        mask=[sampled] * len(ids),
        logprobs=[-(j + 1) / (10 * (k + 1)) for j in range(len(ids))] if sampled else [0.0] * len(ids),
        sampled=sampled,
        parent=parent,
    )


def episode(tokenizer: Any, group: str, k: int) -> Any:
    """One rollout as a verifiers environment returns it to prime-rl's orchestrator."""
    question = QUESTIONS[group]
    nodes = [
        _node(tokenizer, vf.SystemMessage(content=SYSTEM), SYSTEM, sampled=False, parent=None, k=k),
        _node(tokenizer, vf.UserMessage(content=question), question, sampled=False, parent=0, k=k),
    ]
    for text in ROLLOUTS[group][k]:
        if text.startswith("call:"):
            call = vf.ToolCall(id=f"c{k}", name="python", arguments=json.dumps({"code": text[5:]}))
            message = vf.AssistantMessage(content="", tool_calls=[call])
            nodes.append(_node(tokenizer, message, text, sampled=True, parent=len(nodes) - 1, k=k))
            result = str(eval(text[5:]))
            tool = vf.ToolMessage(content=result, tool_call_id=f"c{k}")
            nodes.append(_node(tokenizer, tool, result, sampled=False, parent=len(nodes) - 1, k=k))
        else:
            message = vf.AssistantMessage(content=text)
            nodes.append(_node(tokenizer, message, text, sampled=True, parent=len(nodes) - 1, k=k))
    last = ROLLOUTS[group][k][-1]
    trace = vf.Trace[vf.TaskData](
        task=vf.TraceTask(type="Task", data=vf.TaskData(idx=list(QUESTIONS).index(group), prompt=question)),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
        nodes=nodes,
        rewards={
            "correct": vf.Reward(score=float(ANSWERS[group] in last)),
            "short": vf.Reward(score=1.0 / len(nodes), weight=0.5),
        },
        metrics={"turns": len(ROLLOUTS[group][k])},
        ok=True,
    )
    work = vf.TrainWorkInfo(step=STEP - 1, policy=vf.PolicySpan(start=STEP - 2, end=STEP - 1))
    return vf.Episode(
        env=vf.EnvInfo(id="arith", name="arith"),
        task=trace.task,
        group=vf.GroupInfo(id=group),
        run=vf.TrainRunInfo(id="run-1", work=work),
        traces=[trace],
    )


async def orchestrate(tokenizer: Any, output_dir: Path) -> list[Any]:
    """Episodes arrive, are logged to `all`, scored per group by GRPO, and the effective cohort is
    logged at ship time; returns that cohort (what the trainer gets)."""
    algorithm = prime.GRPOAlgorithm(SimpleNamespace(length_penalty=None), policy_pool=None)
    arrived = [episode(tokenizer, group, k) for k in range(2) for group in QUESTIONS]
    for item in arrived:
        await prime.log([item], STEP, "train", "all")  # main_loop, on arrival
    effective = []
    for group in QUESTIONS:
        members = [e for e in arrived if e.group.id == group]
        await algorithm.finalize_group(members)  # TrainSink.process_group
        # train.filter_zero_advantages (the default): a group with no credit is not shipped.
        effective += [e for e in members if any(prime.is_trainable(t) for t in e.traces)]
    await prime.log(effective, STEP, "train", "effective")  # finalize_train_batch
    return effective


@pytest.fixture
def monitors(tmp_path: Path) -> Any:
    """prime-rl's monitor registry with its FileMonitor, emptied after the test."""
    file_monitor = prime.FileMonitor(SimpleNamespace(path="metrics.jsonl"))
    asyncio.run(file_monitor.init(output_dir=tmp_path))
    prime.MONITORS.append(file_monitor)
    yield importlib.import_module(PRIME)  # the module itself: tests patch its attributes
    file_monitor.file.close()
    prime.MONITORS.clear()


def _records(tmp_path: Path, subset: str) -> list[dict[str, Any]]:
    """What prime-rl's FileMonitor wrote for the step's train cohort `subset`."""
    path = tmp_path / "rollouts" / f"step_{STEP}" / "train" / subset / "traces.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _as_chat(message: Any) -> dict[str, Any]:
    """A verifiers message as the chat dict it should be logged as."""
    data = message.model_dump(exclude_none=True)
    extra = {k: data[k] for k in ("tool_calls", "tool_call_id", "name") if data.get(k)}
    return {"role": data["role"], "content": data.get("content", ""), **extra}


def _check_against_prime(effective: list[Any], samples: list[at.Sample]) -> None:
    """Each sample says what prime-rl holds for its trace: messages, rewards, advantage, group, span."""
    traces = {t.id: (e, t) for e in effective for t in e.traces}
    assert sorted(s.metadata["trace_id"] for s in samples) == sorted(traces)
    for sample in samples:
        ep, trace = traces[sample.metadata["trace_id"]]
        meta = sample.metadata
        assert sample.messages == [_as_chat(m) for m in trace.messages]
        assert [m["role"] for m in sample.messages[:2]] == ["system", "user"]
        assert sample.messages[1]["content"] == QUESTIONS[ep.group.id]
        assert meta["group_uid"] == ep.group.id == prime.episode_group_id(ep)
        assert meta["episode_id"] == ep.id
        assert meta["reward"] == pytest.approx(trace.reward)
        assert meta["reward_breakdown"] == {k: r.model_dump() for k, r in trace.rewards.items()}
        assert meta["advantage"] == pytest.approx(prime.scalar_advantage(trace))
        work = prime.train_work(ep)
        assert (meta["policy_version_min"], meta["policy_version_max"]) == (
            work.policy.start,
            work.policy.end,
        )
        assert meta["generated_at_step"] == work.step
        assert meta["num_turns"] == trace.num_turns
        assert meta["task_idx"] == trace.task.data.idx and meta["env"] == "arith"


def test_the_trained_cohort_is_logged_as_prime_rl_scored_it(
    tokenizer: Any, monitors: Any, tmp_path: Path
) -> None:
    """Through prime-rl's fan-out, the monitor logs the shipped cohort with GRPO's advantages."""
    sink = at.testing.MemorySink()
    with at.TraceSession("prime", run="cohort", sinks=[sink], max_traces_per_step=None) as session:
        monitors.MONITORS.append(prime_rl_adapter.TraceMonitor(session))
        effective = asyncio.run(orchestrate(tokenizer, tmp_path))
    assert {e.group.id for e in effective} == {"g-mul", "g-add"}
    assert {r.step for r in sink.records} == {STEP} and {r.split for r in sink.records} == {"train"}
    samples = sink.samples
    _check_against_prime(effective, samples)
    # GRPO: reward minus the group's mean, the same value on every sampled token.
    for group in ("g-mul", "g-add"):
        rows = [s.metadata for s in samples if s.metadata["group_uid"] == group]
        mean = sum(m["reward"] for m in rows) / len(rows)
        assert [m["advantage"] for m in rows] == pytest.approx([m["reward"] - mean for m in rows])
    # prime-rl's own record of the same cohort (FileMonitor) names the same episodes and groups.
    written = _records(tmp_path, "effective")
    assert sorted((r["id"], r["group"]["id"]) for r in written) == sorted(
        (s.metadata["episode_id"], s.metadata["group_uid"]) for s in samples
    )
    assert len(_records(tmp_path, "all")) == 6  # every arrival; not logged by default


def test_a_tool_call_turn_keeps_its_call_and_answer(tokenizer: Any, monitors: Any, tmp_path: Path) -> None:
    """The multi-turn rollout comes back as system, user, assistant(tool call), tool, assistant."""
    sink = at.testing.MemorySink()
    with at.TraceSession("prime", run="turns", sinks=[sink], max_traces_per_step=None) as session:
        monitors.MONITORS.append(prime_rl_adapter.TraceMonitor(session))
        asyncio.run(orchestrate(tokenizer, tmp_path))
    sample = next(
        s for s in sink.samples if s.metadata["group_uid"] == "g-mul" and s.metadata["reward"] > 0.5
    )
    assert [m["role"] for m in sample.messages] == ["system", "user", "assistant", "tool", "assistant"]
    call = sample.messages[2]["tool_calls"][0]
    assert call["name"] == "python" and json.loads(call["arguments"]) == {"code": "17 * 23"}
    assert sample.messages[3] == {"role": "tool", "content": "391", "tool_call_id": call["id"]}
    assert sample.messages[4]["content"] == "It is 391."
    assert sample.metadata["num_turns"] == 2


def test_token_fields_follow_the_message_graph(tokenizer: Any, monitors: Any, tmp_path: Path) -> None:
    """token ids, sampled mask, log-probs and advantages are the final branch's nodes, in order."""
    sink = at.testing.MemorySink()
    fields = ("token_ids", "loss_mask", "logprobs", "advantages")
    with at.TraceSession("prime", run="tokens", sinks=[sink], max_traces_per_step=None) as session:
        monitors.MONITORS.append(prime_rl_adapter.TraceMonitor(session, token_fields=fields))
        effective = asyncio.run(orchestrate(tokenizer, tmp_path))
    branches = {t.id: t.branches[-1] for e in effective for t in e.traces}
    for sample in sink.samples:
        branch = branches[sample.metadata["trace_id"]]
        assert sample.tokens is not None
        assert [int(t) for t in sample.tokens["token_ids"]] == branch.token_ids
        assert [int(m) for m in sample.tokens["loss_mask"]] == [int(m) for m in branch.sampled_mask]
        assert [float(v) for v in sample.tokens["logprobs"]] == pytest.approx(branch.logprobs)
        got = [float(v) for v in sample.tokens["advantages"]]
        assert got == pytest.approx(branch.advantages)
        sampled = [a for a, m in zip(got, branch.sampled_mask, strict=True) if m]
        assert sampled == pytest.approx([sample.metadata["advantage"]] * len(sampled))


def test_documented_lines_register_the_monitor(tokenizer: Any, monitors: Any, tmp_path: Path) -> None:
    """The lines of docs/frameworks/prime_rl.md, run as written after monitors.setup, log the
    trained cohort and the session is finished by prime-rl's monitors.finalize."""
    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    exec(block, {"monitors": monitors})  # orchestrator.py imports `from prime_rl import monitors`
    effective = asyncio.run(orchestrate(tokenizer, tmp_path))
    session = session_for("prime-rl", on_full="drop_newest", where="test")
    assert isinstance(session, at.SyncTraceSession)
    asyncio.run(monitors.finalize())
    assert session.stats().written == 4
    traces = read_traces("prime-rl", session.run)
    assert {t["step"] for t in traces} == {STEP}
    _check_against_prime(
        effective, [at.Sample(messages=t["messages"], metadata=t["metadata"]) for t in traces]
    )


def test_a_moved_hook_point_is_named_and_nothing_registered(
    monitors: Any, monkeypatch: pytest.MonkeyPatch, hook_warnings: list[str]
) -> None:
    """A prime-rl that renamed its monitor registry: `register` says so once, naming the commit
    tested and what is missing, registers nothing and returns None; nothing raises."""
    monkeypatch.delattr(monitors, "MONITORS")
    monkeypatch.setattr(monitors, "REGISTERED_MONITORS", [], raising=False)
    assert prime_rl_adapter.register(monitors, "prime-rl-moved") is None
    moved(hook_warnings, "prime_rl_adapter.register", "commit 559b447", "MONITORS.append is missing")
    assert monitors.REGISTERED_MONITORS == []


def test_episodes_of_another_verifiers_are_named_and_counted(
    tokenizer: Any, monitors: Any, hook_warnings: list[str]
) -> None:
    """Episodes without `traces` (as another verifiers version might name them): the monitor says
    so once, naming verifiers 0.4.0, counts the cohort and returns."""

    class Renamed:
        def __init__(self, e: Any) -> None:
            self.id, self.group, self.run, self.trace_list = e.id, e.group, e.run, e.traces

    cohort = [Renamed(episode(tokenizer, group, 0)) for group in QUESTIONS]
    with at.TraceSession("prime", run="moved", sinks=[at.testing.MemorySink()]) as session:
        monitor = prime_rl_adapter.register(monitors, session)
        assert monitor is not None and monitor in monitors.MONITORS
        asyncio.run(monitors.log(cohort, STEP, "train", "effective"))
    moved(hook_warnings, "prime_rl_adapter.TraceMonitor", "verifiers 0.4.0", "Renamed.traces")
    stats = session.stats()
    assert stats.dropped["invalid"] == len(cohort) and stats.check()


def test_unreadable_traces_are_counted_not_raised(
    tokenizer: Any, monitors: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A trace whose advantages do not match its sampled tokens is left out and counted, with one
    warning; an episode without traces is counted; the fan-out never sees an error."""
    caplog.set_level(logging.WARNING)
    good, bad = episode(tokenizer, "g-mul", 0), episode(tokenizer, "g-mul", 1)
    bad.traces[0].nodes[2].advantages = [1.0]  # one value for several sampled tokens
    empty = episode(tokenizer, "g-add", 0).model_copy(update={"traces": []})
    sink = at.testing.MemorySink()
    with at.TraceSession("prime", run="bad", sinks=[sink]) as session:
        monitors.MONITORS.append(prime_rl_adapter.TraceMonitor(session))
        asyncio.run(monitors.log([good, bad, empty], STEP, "train", "effective"))
        asyncio.run(monitors.log([good], "not a step", "train", "effective"))
    stats = session.stats()
    assert stats.written == 1 and stats.dropped["invalid"] == 3 and stats.check()
    assert [s.metadata["trace_id"] for s in sink.samples] == [good.traces[0].id]
    warned = [r for r in caplog.records if "prime_rl_adapter.TraceMonitor" in r.getMessage()]
    assert len(warned) == 1
    assert not [r for r in caplog.records if r.name == "prime_rl"]  # prime-rl's fan-out saw no error


def test_the_file_monitors_records_convert_as_the_live_episodes(
    tokenizer: Any, monitors: Any, tmp_path: Path
) -> None:
    """Episodes read back from prime-rl's own traces.jsonl (vf.WireEpisode) give the same samples."""
    sink = at.testing.MemorySink()
    fields = ("token_ids", "loss_mask", "logprobs", "advantages")
    with at.TraceSession("prime", run="wire", sinks=[sink], max_traces_per_step=None) as session:
        monitors.MONITORS.append(prime_rl_adapter.TraceMonitor(session, token_fields=fields))
        asyncio.run(orchestrate(tokenizer, tmp_path))
    path = tmp_path / "rollouts" / f"step_{STEP}" / "train" / "effective" / "traces.jsonl"
    wire = [vf.WireEpisode.model_validate_json(line) for line in path.read_text().splitlines()]
    read_back = prime_rl_adapter.to_samples(wire, token_fields=fields)
    live = sorted(sink.samples, key=lambda s: s.metadata["sample_index"])
    assert [s.messages for s in read_back] == [s.messages for s in live]
    for got, want in zip(read_back, live, strict=True):
        # verifiers' records round advantages to 4 decimals (Episode.to_record).
        advantage = pytest.approx(want.metadata["advantage"], abs=1e-4)
        assert got.metadata == {**want.metadata, "advantage": advantage}
    for got, want in zip(read_back, live, strict=True):
        assert got.tokens is not None and want.tokens is not None
        for name in fields:
            want_values = [float(v) for v in want.tokens[name]]
            assert [float(v) for v in got.tokens[name]] == pytest.approx(want_values, abs=1e-4), name


def test_cohorts_are_chosen_by_kind_and_subset(tokenizer: Any, monitors: Any, tmp_path: Path) -> None:
    """Evaluations are logged as split "eval" at their step; `subsets` can add the arrivals, which
    have no advantage yet."""
    sink = at.testing.MemorySink()
    subsets = {("train", "all"), ("eval", "effective")}
    with at.TraceSession("prime", run="cohorts", sinks=[sink], max_traces_per_step=None) as session:
        monitors.MONITORS.append(prime_rl_adapter.TraceMonitor(session, subsets=subsets))
        asyncio.run(orchestrate(tokenizer, tmp_path))
        evaluated = [episode(tokenizer, "g-add", 0)]
        asyncio.run(monitors.log(evaluated, 2, "eval", "effective"))  # finalize_eval_batch
        asyncio.run(monitors.log({"reward/mean": 0.5}, step=2))  # scalar metrics are not traces
    train = [s for s, r in zip(sink.samples, sink.records, strict=True) if r.split == "train"]
    evals = [(s, r) for s, r in zip(sink.samples, sink.records, strict=True) if r.split == "eval"]
    assert len(train) == 6 and all("advantage" not in s.metadata for s in train)
    assert [(s.metadata["trace_id"], r.step) for s, r in evals] == [(evaluated[0].traces[0].id, 2)]


def test_an_async_session_on_the_orchestrators_loop(tokenizer: Any, monitors: Any, tmp_path: Path) -> None:
    """A session opened with `async with` on the orchestrator's event loop gets the cohort too."""
    sink = at.testing.MemorySink()

    async def run() -> list[Any]:
        async with at.TraceSession("prime", run="async", sinks=[sink], max_traces_per_step=None) as session:
            monitors.MONITORS.append(prime_rl_adapter.TraceMonitor(session))
            return await orchestrate(tokenizer, tmp_path)

    effective = asyncio.run(run())
    _check_against_prime(effective, sink.samples)
