"""OpenRLHF 0.11.2: batches built by its own generation and experience code, logged by the hook lines
of docs/frameworks/openrlhf.md inserted into its own `train_step` and `evaluate`, read back from a
JSONL file and compared with what OpenRLHF computed (tests/adapters/_openrlhf_setup.py says what runs)."""

from __future__ import annotations

import functools
import logging
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

import asynctrace as at
from asynctrace._records.tokens import decode_token_fields
from asynctrace.adapters import openrlhf_adapter
from asynctrace.rollouts import toy_tokenizer
from tests._util import LazyModule
from tests.adapters.conftest import moved

# The tests that run docs/frameworks/openrlhf.md's lines as written, in the framework's own code
# (tests/test_doc_snippets.py checks they are here).
RUNS_PAGE_SNIPPETS = (
    "test_train_step_logs_each_rollout_with_its_prompt_group_and_reward",
    "test_evaluate_logs_its_samples_as_eval",
)

ROOT = Path(__file__).resolve().parents[2]
N = 3
PROMPTS = [
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nName a prime above 90.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nSpell 'cat' backwards.<|im_end|>\n<|im_start|>assistant\n",
]
LABELS = ["391", "97", "tac"]
CALL = '<tool_call>{"name": "python", "code": "print(17 * 23)"}</tool_call><|im_end|>'
# The turns of each rollout; a tool call gets setup.TOOL back before the next turn.
SCRIPT = [
    [[CALL, "The answer is 391.<|im_end|>"], ["It is 391.<|im_end|>"], ["17 * 23 = 381, I think.<|im_end|>"]],
    [["97<|im_end|>"], ["91 is prime.<|im_end|>"], [CALL, "Hm, 391 is not prime.<|im_end|>"]],
    [["tac<|im_end|>"], ["act<|im_end|>"], ["It is tac, of course: t-a-c reversed from c-a-t.<|im_end|>"]],
]
# OpenRLHF's import (with peft, datasets and torch's compiler: seconds) runs with the first test.
setup = LazyModule("tests.adapters._openrlhf_setup")
GEN = {"max_len": 256, "temperature": 1.0, "n_samples_per_prompt": N}


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    """The in-process tokenizer under transformers' API, which OpenRLHF's agents and trainer call."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=toy_tokenizer(), pad_token="<pad>")


def _reward(p: int, k: int) -> float:
    return 1.0 if LABELS[p] in SCRIPT[p][k][-1] else 0.0


def _expected(p: int, k: int) -> dict[str, Any]:
    """What OpenRLHF was scripted to produce for rollout k of prompt p."""
    turns = SCRIPT[p][k]
    messages = [{"role": "user", "content": PROMPTS[p]}]
    for j, turn in enumerate(turns):
        if j:
            messages.append({"role": "tool", "content": setup.TOOL})
        messages.append({"role": "assistant", "content": turn})
    group = torch.tensor([_reward(p, j) for j in range(N)])
    advantage = ((group - group.mean()) / (group.std() + 1e-9))[k].item()
    return {"messages": messages, "reward": _reward(p, k), "advantage": advantage, "turns": len(turns)}


@functools.cache
def _hooked() -> dict[str, Any]:
    """OpenRLHF's functions with the documented lines in them (`setup.page_hooked`), made once."""
    return setup.page_hooked()


def _read(path: Path) -> list[dict[str, Any]]:
    """The trace lines of a JSONL file (its metrics lines left out)."""
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    return [line for line in lines if "sample" in line]


def _run_step(
    hf_tokenizer: Any, tmp_path: Path, *, dynamic_batch: bool, global_step: int = 4
) -> tuple[Any, Any]:
    """One training step of OpenRLHF's loop, as `PPOTrainer.fit` runs it, with the hook line in train_step."""
    args = setup.make_args(N, prompts=len(PROMPTS), dynamic_batch=dynamic_batch)
    trainer = setup.trainer(hf_tokenizer, args, PROMPTS, LABELS, SCRIPT)
    sink = at.JsonlSink(tmp_path / "traces.jsonl")
    with at.TraceSession("openrlhf", sinks=[sink], max_traces_per_step=None) as session:
        trainer.asynctrace_session = session
        rollout_samples, _, _, _ = trainer.samples_generator.generate_samples(**GEN)
        status, next_step = _hooked()["BasePPOTrainer.train_step"](trainer, rollout_samples, global_step)
    assert next_step == global_step + 1 and status["policy_loss"] == 0.25
    return trainer, _read(tmp_path / "traces.jsonl")


@pytest.mark.parametrize("dynamic_batch", [False, True])
def test_train_step_logs_each_rollout_with_its_prompt_group_and_reward(
    hf_tokenizer: Any, tmp_path: Path, dynamic_batch: bool
) -> None:
    """Every rollout of the step is logged once with its turns, reward, GRPO advantage, group and
    version, also when dynamic batching puts the rows of a group in different micro-batches."""
    _, lines = _run_step(hf_tokenizer, tmp_path, dynamic_batch=dynamic_batch)
    # Each rollout is found by its text alone (every scripted conversation differs), so a
    # sample given another rollout's group, reward or advantage is caught.
    origin = {
        orjson.dumps(_expected(p, k)["messages"]): (p, k) for p in range(len(PROMPTS)) for k in range(N)
    }
    found = [origin[orjson.dumps(line["sample"]["messages"])] for line in lines]
    assert sorted(found) == sorted(origin.values())
    assert (found != sorted(found)) == dynamic_batch, "only dynamic batching reorders the rows"
    for line, (p, k) in zip(lines, found, strict=True):
        index = p * N + k
        want = _expected(p, k)
        sample, meta = line["sample"], line["sample"]["metadata"]
        assert (line["step"], line["split"]) == (5, "train")
        assert sample["messages"] == want["messages"]
        assert meta["reward"] == want["reward"] and meta["score"] == want["reward"]
        assert meta["advantage"] == pytest.approx(want["advantage"], abs=1e-5)
        assert (meta["prompt_index"], meta["rollout_index"], meta["label"]) == (p, index, LABELS[p])
        assert meta["policy_version"] == 4 and meta["truncated"] is False
        assert meta["num_turns"] == want["turns"] and meta["openrlhf_info"] == {"turns": want["turns"]}
        std = torch.tensor([_reward(p, j) for j in range(N)]).std().item()
        assert meta["group_reward_std"] == pytest.approx(std)


def test_a_group_is_its_rollouts_not_its_neighbours(hf_tokenizer: Any, tmp_path: Path) -> None:
    """Each logged group holds exactly one prompt's N rollouts, with the rewards OpenRLHF normalised."""
    _, lines = _run_step(hf_tokenizer, tmp_path, dynamic_batch=True)
    groups: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        groups.setdefault(line["sample"]["metadata"]["prompt_index"], []).append(line["sample"])
    assert sorted(groups) == list(range(len(PROMPTS)))
    for p, members in groups.items():
        assert {m["messages"][0]["content"] for m in members} == {PROMPTS[p]}
        assert sorted(m["metadata"]["reward"] for m in members) == sorted(_reward(p, k) for k in range(N))
        # group_norm: the advantages of a group sum to zero.
        assert sum(m["metadata"]["advantage"] for m in members) == pytest.approx(0.0, abs=1e-5)


def test_token_fields_are_put_back_on_their_tokens(hf_tokenizer: Any, tmp_path: Path) -> None:
    """token_ids, loss_mask, logprobs and advantages come back per token, the offset of one undone:
    every generated token has the engine's log-prob and the group's advantage, the tool's tokens none."""
    args = setup.make_args(N, prompts=len(PROMPTS), micro_batch_size=2)
    trainer = setup.trainer(hf_tokenizer, args, PROMPTS, LABELS, SCRIPT)
    rollout_samples, _, _, _ = trainer.samples_generator.generate_samples(**GEN)
    experiences = trainer.experience_maker.make_experience_batch(rollout_samples)
    sink = at.JsonlSink(tmp_path / "t.jsonl")
    fields = ("token_ids", "loss_mask", "logprobs", "advantages")
    with at.TraceSession("openrlhf", sinks=[sink], max_traces_per_step=None) as session:
        logged = openrlhf_adapter.log_train_batch(
            trainer, experiences, 0, session=session, token_fields=fields
        )
    assert logged == len(PROMPTS) * N
    for line in _read(tmp_path / "t.jsonl"):
        meta = line["sample"]["metadata"]
        p, k = divmod(meta["rollout_index"], N)
        tokens = decode_token_fields(line["sample"]["tokens"])
        ids = hf_tokenizer(text=PROMPTS[p] + setup.TOOL.join(SCRIPT[p][k]), add_special_tokens=False)[
            "input_ids"
        ]
        assert tokens["token_ids"] == ids
        mask = tokens["loss_mask"]
        assert math.isnan(tokens["logprobs"][0]) and math.isnan(tokens["advantages"][0])
        turn_starts = [j for j in range(len(mask)) if mask[j] and not mask[j - 1]]
        assert len(turn_starts) == len(SCRIPT[p][k])
        for start in turn_starts:
            end = next((j for j in range(start, len(mask)) if not mask[j]), len(mask))
            assert tokens["logprobs"][start:end] == pytest.approx(
                [setup.logprob_of(i) for i in range(end - start)]
            )
        generated = [a for a, m in zip(tokens["advantages"], mask, strict=True) if m]
        assert generated == pytest.approx([_expected(p, k)["advantage"]] * len(generated), abs=1e-5)
        assert all(lp == 0.0 for lp, m in zip(tokens["logprobs"][1:], mask[1:], strict=True) if not m)


def test_to_samples_gives_token_fields_as_plain_lists(hf_tokenizer: Any) -> None:
    """`to_samples(token_fields=...)` returns each field as a list of numbers, as the other
    adapters' `to_samples` do, with the values the hook logs."""
    args = setup.make_args(N, prompts=len(PROMPTS))
    trainer = setup.trainer(hf_tokenizer, args, PROMPTS, LABELS, SCRIPT)
    rollout_samples, _, _, _ = trainer.samples_generator.generate_samples(**GEN)
    experiences = trainer.experience_maker.make_experience_batch(rollout_samples)
    fields = ("token_ids", "loss_mask", "logprobs", "advantages")
    samples = openrlhf_adapter.to_samples(
        experiences, tokenizer=hf_tokenizer, samples_per_prompt=N, token_fields=fields
    )
    for sample in samples:
        # text_ends comes with every decoded row's token fields (for the token page).
        assert sample.tokens is not None and set(sample.tokens) == {*fields, "text_ends"}
        assert all(isinstance(values, list) for values in sample.tokens.values()), sample.tokens
        p, k = divmod(sample.metadata["rollout_index"], N)
        text = PROMPTS[p] + setup.TOOL.join(SCRIPT[p][k])
        assert sample.tokens["token_ids"] == hf_tokenizer(text=text, add_special_tokens=False)["input_ids"]
        assert math.isnan(sample.tokens["logprobs"][0]) and set(sample.tokens["loss_mask"]) == {0, 1}


def test_evaluate_logs_its_samples_as_eval(hf_tokenizer: Any, tmp_path: Path) -> None:
    """The page's line in PPOTrainer.evaluate logs each evaluation rollout as "eval" at the step,
    grouped by the evaluation's own samples per prompt."""
    args = setup.make_args(N, prompts=len(PROMPTS))
    eval_batches = [(["data"], [p], [label], [None]) for p, label in zip(PROMPTS, LABELS, strict=True)]
    trainer = setup.trainer(hf_tokenizer, args, PROMPTS, LABELS, SCRIPT, eval_batches=eval_batches)
    sink = at.testing.MemorySink()
    with at.TraceSession("openrlhf", sinks=[sink], max_traces_per_step=None) as session:
        trainer.asynctrace_session = session
        logs = _hooked()["PPOTrainer.evaluate"](trainer, 7, **{**GEN, "n_samples_per_prompt": 2})
    assert logs["eval_data_pass1"] == pytest.approx(sum(_reward(p, 0) + _reward(p, 1) for p in range(3)) / 6)
    records = sink.records
    assert {(r.split, r.step) for r in records} == {("eval", 7)}
    for row, record in enumerate(records):
        p, k = divmod(row, 2)
        meta = record.sample.metadata
        assert record.sample.messages == _expected(p, k)["messages"]
        assert (meta["prompt_index"], meta["reward"], meta["policy_version"]) == (p, _reward(p, k), 7)
        assert "advantage" not in meta


def test_first_call_opens_a_session_named_after_the_run(hf_tokenizer: Any, tmp_path: Path) -> None:
    """open_session names the session after the W&B project and run name, made plain names."""
    args = setup.make_args(N, prompts=len(PROMPTS), project="math/rl")
    trainer = setup.trainer(hf_tokenizer, args, PROMPTS, LABELS, SCRIPT)
    sink = at.testing.MemorySink()
    session = openrlhf_adapter.open_session(trainer, sinks=[sink], shutdown_hooks=False)
    try:
        assert trainer.asynctrace_session is session
        assert (session.project, session.run) == ("math-rl", "grpo-tool")
        rollout_samples, _, _, _ = trainer.samples_generator.generate_samples(**GEN)
        experiences = trainer.experience_maker.make_experience_batch(rollout_samples)
        assert openrlhf_adapter.log_train_batch(trainer, experiences, 2) == len(PROMPTS) * N
    finally:
        session.finish()
    assert {r.step for r in sink.records} == {3}


def test_the_asynchronous_trainer_gets_no_made_up_version(hf_tokenizer: Any) -> None:
    """With --train.async_enable, where OpenRLHF records no weight version, none is logged."""
    args = setup.make_args(N, prompts=len(PROMPTS))
    args.train.async_enable = True
    trainer = setup.trainer(hf_tokenizer, args, PROMPTS, LABELS, SCRIPT)
    rollout_samples, _, _, _ = trainer.samples_generator.generate_samples(**GEN)
    experiences = trainer.experience_maker.make_experience_batch(rollout_samples)
    sink = at.testing.MemorySink()
    with at.TraceSession("openrlhf", sinks=[sink], max_traces_per_step=None) as session:
        assert openrlhf_adapter.log_train_batch(trainer, experiences, 6, session=session) == len(PROMPTS) * N
    assert {r.step for r in sink.records} == {7}
    assert not any("policy_version" in r.sample.metadata for r in sink.records)


def test_hook_never_raises_and_counts_the_rows(
    hf_tokenizer: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch the adapter cannot read is counted as invalid with one warning; training goes on."""
    caplog.set_level(logging.WARNING, logger="asynctrace")
    args = setup.make_args(N, prompts=len(PROMPTS))
    trainer = setup.trainer(hf_tokenizer, args, PROMPTS, LABELS, SCRIPT)
    rollout_samples, _, _, _ = trainer.samples_generator.generate_samples(**GEN)
    experiences = trainer.experience_maker.make_experience_batch(rollout_samples)
    for experience in experiences:
        experience.action_mask = None
    with at.TraceSession("openrlhf", sinks=[at.testing.MemorySink()]) as session:
        for _ in range(2):
            assert openrlhf_adapter.log_train_batch(trainer, experiences, 0, session=session) == 0
    stats = session.stats()
    assert stats.dropped["invalid"] == 2 * len(PROMPTS) * N and stats.check()
    warned = [r for r in caplog.records if "openrlhf_adapter.log_train_batch" in r.getMessage()]
    assert len(warned) == 1 and "action_mask" in warned[0].getMessage()
    with pytest.raises(ValueError, match="samples_per_prompt"):
        openrlhf_adapter.to_samples(experiences, tokenizer=hf_tokenizer, samples_per_prompt=0)


def test_a_moved_hook_point_is_named_and_its_batches_counted(
    hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, hook_warnings: list[str]
) -> None:
    """Experiences whose OpenRLHF renamed `action_mask`: the hook says so once, naming OpenRLHF
    0.11.2 and the field, counts every row (sized by the fields that remain) and returns."""
    args = setup.make_args(N, prompts=len(PROMPTS))
    trainer = setup.trainer(hf_tokenizer, args, PROMPTS, LABELS, SCRIPT)
    rollout_samples, _, _, _ = trainer.samples_generator.generate_samples(**GEN)
    experiences = trainer.experience_maker.make_experience_batch(rollout_samples)
    monkeypatch.delattr(setup.openrlhf.experience.Experience, "action_mask")
    for experience in experiences:
        experience.response_mask = vars(experience).pop("action_mask")
    with at.TraceSession("openrlhf", sinks=[at.testing.MemorySink()]) as session:
        for _ in range(2):
            assert openrlhf_adapter.log_train_batch(trainer, experiences, 0, session=session) == 0
    moved(hook_warnings, "openrlhf_adapter.log_train_batch", "OpenRLHF 0.11.2", "Experience.action_mask")
    stats = session.stats()
    assert stats.dropped["invalid"] == 2 * len(PROMPTS) * N and stats.check()


def test_importing_the_adapter_imports_no_openrlhf() -> None:
    """`asynctrace.adapters.openrlhf_adapter` imports without OpenRLHF, Ray or torch being loaded."""
    code = (
        "import sys\n"
        "from asynctrace.adapters import openrlhf_adapter\n"
        "assert not {'openrlhf', 'torch', 'ray', 'vllm', 'deepspeed'} & set(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
