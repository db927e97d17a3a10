"""NeMo RL's GRPO step, built by NeMo RL's own code, to samples.

NeMo RL's release on the package index is a placeholder and its source needs Python >= 3.13, so
its functions are run from its source at a pinned commit (tests/adapters/_upstream/nemo_rl_source.py):
`add_grpo_token_loss_masks_and_generation_logprobs`, `extract_initial_prompt_messages`,
`batched_message_log_to_flat_message` and `GRPOAdvantageEstimator`, called in the order and with
the arguments of `grpo_train` (nemo_rl/algorithms/grpo.py, lines 3114-3294 at that commit). The
model is not run: the generation appends assistant messages as `generate_responses` does
(nemo_rl/experience/rollouts.py, lines 514-522) and the environment answers as a tool would.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import asynctrace as at
from asynctrace.adapters import nemo_rl_adapter
from asynctrace.adapters._sessions import session_for
from tests._util import read_traces
from tests.adapters._upstream import nemo_rl_source as nemo
from tests.adapters.conftest import moved

# The tests that run docs/frameworks/nemo_rl.md's lines as written, in the framework's own code
# (tests/test_doc_snippets.py checks they are here).
RUNS_PAGE_SNIPPETS = ("test_documented_lines_run_in_grpo_train",)

DOC = Path(__file__).resolve().parents[2] / "docs" / "frameworks" / "nemo_rl.md"
PAD = 0
GENERATIONS = 2
SYSTEM = "You are a careful calculator. Use the python tool."
# Dataset rows (DatumSpec): rows 0 and 2 hold the same prompt, as a dataset may; NeMo RL's GRPO
# baseline then puts their four rollouts in one group, whatever their `idx`.
QUESTIONS = ["What is 17 * 23?", "Say hello.", "What is 17 * 23?"]
# Per dataset row and generation: the turns the policy writes, separated by tool answers.
ANSWERS = [
    [["<tool_call>python: 17 * 23</tool_call>", "It is 391."], ["It is 401."]],
    [["Hello!"], ["Hi there"]],
    [["391"], ["<tool_call>python: 17 * 23</tool_call>", "I think 400."]],
]
TOOL_OUTPUT = "391"


def _tokens(tokenizer: Any, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids, dtype=torch.long)


def _reward(message_log: list[dict[str, Any]]) -> float:
    """The environment's score: the last answer names 391."""
    return 1.0 if "391" in message_log[-1]["content"] else 0.0


def grpo_step(tokenizer: Any, answers: list[list[list[str]]] = ANSWERS) -> dict[str, Any]:
    """One `grpo_train` step up to its logging point: the locals the hook line reads."""
    # The dataloader's DatumSpecs, repeated per generation (`batch.repeat_interleave`).
    repeated: list[dict[str, Any]] = []
    for idx, question in enumerate(QUESTIONS):
        prompt = [
            {"role": "system", "content": SYSTEM, "token_ids": _tokens(tokenizer, SYSTEM)},
            {"role": "user", "content": question, "token_ids": _tokens(tokenizer, question)},
        ]
        datum = {
            "message_log": prompt,
            "length": sum(len(m["token_ids"]) for m in prompt),
            "idx": idx,
            "task_name": "math",
            "loss_multiplier": 1.0,
        }
        repeated += [copy.deepcopy(datum) for _ in range(GENERATIONS)]
    # The rollout: each assistant turn as generate_responses appends it, tool answers between.
    for k, datum in enumerate(repeated):
        turns = answers[k // GENERATIONS][k % GENERATIONS]
        for t, text in enumerate(turns):
            ids = _tokens(tokenizer, text)
            logprobs = -torch.arange(1, len(ids) + 1, dtype=torch.float32) / (10 * (k + 1))
            datum["message_log"].append(
                {"role": "assistant", "content": text, "token_ids": ids, "generation_logprobs": logprobs}
            )
            if t < len(turns) - 1:
                datum["message_log"].append(
                    {"role": "tool", "content": TOOL_OUTPUT, "token_ids": _tokens(tokenizer, TOOL_OUTPUT)}
                )
    repeated_batch = nemo.BatchedDataDict(
        {key: [d[key] for d in repeated] for key in ("message_log", "idx", "task_name")}
    )
    repeated_batch["length"] = torch.tensor([d["length"] for d in repeated])
    repeated_batch["loss_multiplier"] = torch.tensor([d["loss_multiplier"] for d in repeated])
    repeated_batch["total_reward"] = torch.tensor([_reward(d["message_log"]) for d in repeated])
    repeated_batch["truncated"] = torch.zeros(len(repeated), dtype=torch.bool)

    # grpo_train, from here on as at the pinned commit (lines 3095-3294).
    rewards = repeated_batch["total_reward"]
    initial_prompt_message_logs = nemo.extract_initial_prompt_messages(
        repeated_batch["message_log"], repeated_batch["length"]
    )
    prompt_batched_flat, _ = nemo.batched_message_log_to_flat_message(
        initial_prompt_message_logs, pad_value_dict={"token_ids": PAD}
    )
    prompt_ids_for_adv = prompt_batched_flat["token_ids"]
    nemo.add_grpo_token_loss_masks_and_generation_logprobs(repeated_batch["message_log"])
    flat_messages, input_lengths = nemo.batched_message_log_to_flat_message(
        repeated_batch["message_log"], pad_value_dict={"token_ids": PAD}, make_sequence_length_divisible_by=8
    )
    train_data = nemo.BatchedDataDict(
        {
            "input_ids": flat_messages["token_ids"],
            "input_lengths": input_lengths,
            "generation_logprobs": flat_messages["generation_logprobs"],
            "token_mask": flat_messages["token_loss_mask"],
            "sample_mask": repeated_batch["loss_multiplier"],
        }
    )
    # The policy's log-probs (a model forward) are not computed: GRPO's advantages do not use them.
    train_data["prev_logprobs"] = torch.zeros_like(train_data["generation_logprobs"])
    mask = train_data["token_mask"] * train_data["sample_mask"].unsqueeze(-1)
    estimator = nemo.GRPOAdvantageEstimator(nemo.AdvEstimatorConfig(), None)
    train_data["advantages"] = estimator.compute_advantage(
        prompt_ids=prompt_ids_for_adv, rewards=rewards, mask=mask, repeated_batch=repeated_batch
    )
    return {
        "repeated_batch": repeated_batch,
        "train_data": train_data,
        "flat_messages": flat_messages,
        "prompt_ids_for_adv": prompt_ids_for_adv,
        "rewards": rewards,
        "total_steps": 6,
    }


def doc_blocks() -> list[str]:
    """The Python blocks of docs/frameworks/nemo_rl.md, as written."""
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def step(tokenizer: Any) -> dict[str, Any]:
    return grpo_step(tokenizer)


def _check_against_nemo(step: dict[str, Any], samples: list[at.Sample]) -> None:
    """Every sample says what NeMo RL computed for its row: prompt, turns, reward, group, advantage."""
    batch, train_data, flat = step["repeated_batch"], step["train_data"], step["flat_messages"]
    prompts = step["prompt_ids_for_adv"]
    n = len(batch["message_log"])
    assert [s.metadata["sample_index"] for s in samples] == list(range(n))
    for i, sample in enumerate(samples):
        meta = sample.metadata
        # NeMo's flattened content and roles: every message, prompt and turns, in order.
        assert [m["content"] for m in sample.messages] == flat["content"][i]
        assert [m["role"] for m in sample.messages] == flat["role"][i]
        assert meta["reward"] == float(batch["total_reward"][i])
        assert meta["dataset_idx"] == batch["idx"][i] and meta["task_name"] == "math"
        trained = train_data["token_mask"][i].bool()
        assert meta["advantage"] == pytest.approx(float(train_data["advantages"][i][trained].mean()))
        assert meta["prompt_len"] == int(batch["length"][i])
        assert meta["prompt_len"] + meta["response_len"] == int(train_data["input_lengths"][i])
        generated = sum(
            1 for m in batch["message_log"][i] if "generation_logprobs" in m and m["role"] == "assistant"
        )
        assert meta["num_turns"] == generated
        for j in range(n):
            same_prompt = torch.equal(prompts[i], prompts[j])
            assert (meta["group_uid"] == samples[j].metadata["group_uid"]) is same_prompt
            assert (meta["prompt_index"] == samples[j].metadata["prompt_index"]) is same_prompt


def test_samples_carry_what_grpo_train_computed(step: dict[str, Any]) -> None:
    """Prompt, turns, reward, advantage, group and lengths match NeMo RL's own batch, row by row."""
    samples = nemo_rl_adapter.to_samples(step["repeated_batch"], step["train_data"], policy_version=6)
    _check_against_nemo(step, samples)
    assert {s.metadata["policy_version"] for s in samples} == {6}
    first = samples[0].messages
    assert first[:2] == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    assert [m["role"] for m in first[2:]] == ["assistant", "tool", "assistant"]


def test_rows_with_one_prompt_share_a_group_whatever_their_dataset_row(step: dict[str, Any]) -> None:
    """Dataset rows 0 and 2 hold one prompt: NeMo RL's baseline pools their 4 rollouts, so do the groups."""
    samples = nemo_rl_adapter.to_samples(step["repeated_batch"], step["train_data"])
    by_group: dict[str, list[int]] = {}
    for s in samples:
        by_group.setdefault(s.metadata["group_uid"], []).append(s.metadata["dataset_idx"])
    assert sorted(sorted(v) for v in by_group.values()) == [[0, 0, 2, 2], [1, 1]]
    # The leave-one-out baseline over 4 rewards (1, 0, 1, 0), normalised: not the ±0.707 of pairs.
    rewards = [s.metadata["reward"] for s in samples if s.metadata["dataset_idx"] in (0, 2)]
    assert rewards == [1.0, 0.0, 1.0, 0.0]
    advantages = [s.metadata["advantage"] for s in samples if s.metadata["dataset_idx"] in (0, 2)]
    assert advantages[0] == pytest.approx(-advantages[1]) and abs(advantages[0]) > 0.9


def test_token_fields_are_the_flattened_training_rows(step: dict[str, Any]) -> None:
    """token_ids, loss mask, generation log-probs and advantages equal train_data over each real row."""
    train_data = step["train_data"]
    sink = at.testing.MemorySink()
    with at.TraceSession("nemo", run="tokens", sinks=[sink], max_traces_per_step=None) as session:
        fields = ("token_ids", "loss_mask", "logprobs", "advantages")
        logged = nemo_rl_adapter.log_step(
            session, step["repeated_batch"], train_data, step=7, token_fields=fields
        )
        assert logged == len(train_data["input_ids"])
    columns = {
        "token_ids": train_data["input_ids"],
        "loss_mask": train_data["token_mask"],
        "logprobs": train_data["generation_logprobs"],
        "advantages": train_data["advantages"],
    }
    assert len(sink.samples) == logged
    for sample in sink.samples:
        i = sample.metadata["sample_index"]
        length = int(train_data["input_lengths"][i])
        assert sample.tokens is not None
        for name, column in columns.items():
            got = [float(v) for v in sample.tokens[name]]
            assert got == pytest.approx([float(v) for v in column[i][:length]]), name


def test_documented_lines_run_in_grpo_train(step: dict[str, Any]) -> None:
    """The lines of docs/frameworks/nemo_rl.md, run as written among grpo_train's locals, log the step."""
    sync_block, async_block = doc_blocks()
    project = "nemo-rl-grpo"
    exec(sync_block, dict(step))
    # async_grpo_train is in the same file, under the import of line 1.
    async_locals = {**step, "step": 8, "nemo_rl_adapter": nemo_rl_adapter}
    exec(async_block, async_locals)
    session = session_for(project, on_full="block", where="test")
    assert isinstance(session, at.SyncTraceSession)
    assert session.finish().written == 2 * len(step["repeated_batch"]["message_log"])
    traces = read_traces(project, session.run)
    assert sorted({t["step"] for t in traces}) == [7, 9]
    sync_traces = [t for t in traces if t["step"] == 7]
    assert all(t["metadata"]["policy_version"] == 6 for t in sync_traces)
    samples = sorted(
        (at.Sample(messages=t["messages"], metadata=t["metadata"]) for t in sync_traces),
        key=lambda s: s.metadata["sample_index"],
    )
    _check_against_nemo(step, samples)


def test_unreadable_rows_are_counted_not_raised(
    step: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A row without token ids is left out and counted, with one warning; a batch that is no batch
    is counted whole; training never sees an error."""
    caplog.set_level(logging.WARNING, logger="asynctrace")
    batch = nemo.BatchedDataDict(step["repeated_batch"])
    batch["message_log"] = [list(log) for log in batch["message_log"]]
    batch["message_log"][1] = [{"role": "user", "content": "no tokens"}]
    sink = at.testing.MemorySink()
    with at.TraceSession("nemo", run="bad", sinks=[sink]) as session:
        assert nemo_rl_adapter.log_step(session, batch, step["train_data"], step=1) == 5
        assert nemo_rl_adapter.log_step(session, None, step=2) == 0
        assert nemo_rl_adapter.log_step(session, batch, step="x") == 0
    stats = session.stats()
    assert stats.dropped["invalid"] == 1 + 1 + 6 and stats.check()
    assert 1 not in {s.metadata["sample_index"] for s in sink.samples}
    warned = [r for r in caplog.records if "nemo_rl_adapter.log_step" in r.getMessage()]
    assert len(warned) == 1


def test_a_moved_hook_point_is_named_and_its_steps_counted(
    step: dict[str, Any], hook_warnings: list[str]
) -> None:
    """A `repeated_batch` whose NeMo RL renamed `length`: the hook says so once, naming the commit
    tested and the key, counts every rollout of the step and returns; nothing raises."""
    batch = nemo.BatchedDataDict(step["repeated_batch"])
    batch["prompt_length"] = batch.pop("length")
    with at.TraceSession("nemo", run="moved", sinks=[at.testing.MemorySink()]) as session:
        for n in range(2):
            assert nemo_rl_adapter.log_step(session, batch, step["train_data"], step=n) == 0
    moved(hook_warnings, "nemo_rl_adapter.log_step", "commit 7ea279abfbeb", "repeated_batch has no 'length'")
    stats = session.stats()
    assert stats.dropped["invalid"] == 2 * len(batch["message_log"]) and stats.check()


def test_nan_rewards_are_left_out(step: dict[str, Any]) -> None:
    """A reward NeMo RL could not compute (NaN) is no reward, not a number to rank by."""
    batch = nemo.BatchedDataDict(step["repeated_batch"])
    batch["total_reward"] = batch["total_reward"].clone()
    batch["total_reward"][0] = math.nan
    samples = nemo_rl_adapter.to_samples(batch)
    assert "reward" not in samples[0].metadata and samples[1].metadata["reward"] == 0.0
    assert all("advantage" not in s.metadata for s in samples)


def test_a_row_with_no_trained_token_keeps_its_advantage(tokenizer: Any) -> None:
    """An empty generation trains no token, yet NeMo RL's advantage row holds the sample's value
    (GRPO spreads it over the row): the sample keeps it, as every other sample keeps its own."""
    answers = copy.deepcopy(ANSWERS)
    answers[0][1] = [""]  # the second generation of dataset row 0 is empty (and wrong)
    step = grpo_step(tokenizer, answers)
    train_data = step["train_data"]
    assert not train_data["token_mask"][1].any()
    samples = nemo_rl_adapter.to_samples(step["repeated_batch"], train_data)
    assert samples[1].metadata["response_len"] == 0 and samples[1].metadata["num_turns"] == 1
    assert samples[1].metadata["advantage"] == pytest.approx(float(train_data["advantages"][1][0]))
    assert samples[1].metadata["advantage"] < -0.5
    for i, sample in enumerate(samples):
        row = train_data["advantages"][i][: int(train_data["input_lengths"][i])]
        assert sample.metadata["advantage"] == pytest.approx(float(row.mean()))


def test_plain_lists_give_the_same_samples_as_tensors(step: dict[str, Any]) -> None:
    """A batch of lists (as a JSON round trip leaves it) converts exactly as the tensors do."""

    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    fields = ("token_ids", "loss_mask", "logprobs", "advantages")
    batch, train_data = step["repeated_batch"], step["train_data"]
    tensors = nemo_rl_adapter.to_samples(batch, train_data, token_fields=fields)
    lists = nemo_rl_adapter.to_samples(plain(dict(batch)), plain(dict(train_data)), token_fields=fields)
    assert [s.messages for s in lists] == [s.messages for s in tensors]
    for got, want in zip(lists, tensors, strict=True):
        assert got.metadata == {**want.metadata, "advantage": pytest.approx(want.metadata["advantage"])}
    assert [s.tokens for s in lists] == [s.tokens for s in tensors]
