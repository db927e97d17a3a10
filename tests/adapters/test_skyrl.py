"""SkyRL adapter, on SkyRL's own code (skyrl==0.4.0).

skyrl needs Python >= 3.12, so it cannot be installed where these tests run (3.11); its own
definitions are in `tests/adapters/_upstream/skyrl_source.py`, copied unchanged from the 0.4.0 wheel
(file and lines named there). Inputs are built with them: the `GeneratorInput` /
`GeneratorOutput` TypedDicts, `TrajectoryID`, `BatchMetadata`, `prepare_generator_input`, the
dynamic sampling functions and trainer method, `apply_overlong_filtering`, the trainer's
`generate` / `postprocess_generator_output` and the fully async trainer's
`convert_generation_group_mini_batch_to_training_input`. What cannot run here (Ray workers, an
inference engine, SkyRL's `train()` loops) is replaced by `ToyGenerator` (a `generate` that
returns a real `GeneratorOutput`) and by `train_step` / `async_step`, which call the real
pieces in the order `RayPPOTrainer.train` and `FullyAsyncRayPPOTrainer.train` do.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import asynctrace as at
from asynctrace.adapters import _hooks, skyrl_adapter
from asynctrace.rollouts import toy_tokenizer
from tests._util import read_traces
from tests.adapters._upstream.skyrl_source import (
    BatchMetadata,
    FullyAsyncRayPPOTrainer,
    GeneratedOutputGroup,
    GeneratorInput,
    GeneratorOutput,
    RayPPOTrainer,
    TrajectoryID,
    apply_overlong_filtering,
    handle_dynamic_sampling,
    prepare_generator_input,
)
from tests.adapters.conftest import moved
from tests.rollouts._helpers import encode

SYSTEM = {"role": "system", "content": "You are a careful solver."}


def chat(question: str) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": question}]


def dataset_rows(questions: list[str], first_uid: int = 0) -> list[dict[str, Any]]:
    """A dataloader batch as SkyRL's PromptDataset.collate_fn gives it (uid: the row's index)."""
    return [
        {"prompt": chat(q), "env_class": None, "env_extras": {"answer": q}, "uid": str(first_uid + i)}
        for i, q in enumerate(questions)
    ]


def generator_input(questions: list[str], n: int = 1, step: int = 1, phase: str = "train") -> GeneratorInput:
    """SkyRL's own input for `questions`, `n` samples each (`prepare_generator_input`)."""
    gi, _ = prepare_generator_input(dataset_rows(questions), n, {}, "gsm8k", phase, step)  # type: ignore[arg-type]
    return gi


def generator_output(
    tokenizer: Any, questions: list[str], answers: list[list[tuple[str, str]]], **columns: Any
) -> GeneratorOutput:
    """A `GeneratorOutput` for one row per answer, as SkyRLGymGenerator fills it (non-step-wise)."""
    encoded = [encode(tokenizer, turns) for turns in answers]
    return GeneratorOutput(
        prompt_token_ids=[encode(tokenizer, [("user", q)])[0] for q in questions],
        response_ids=[ids for ids, _ in encoded],
        rewards=columns.pop("rewards", [1.0] * len(answers)),
        loss_masks=[mask for _, mask in encoded],
        stop_reasons=columns.pop("stop_reasons", ["stop"] * len(answers)),
        rollout_metrics=None,
        rollout_logprobs=None,
        trajectory_ids=columns.pop("trajectory_ids", None),
        trajectory_generation_times=None,
        trajectory_time_splits=None,
        rollout_expert_indices=None,
        rollout_sample_support=None,
        is_last_step=columns.pop("is_last_step", None),
        env_metrics=columns.pop("env_metrics", None),
        pixel_values=None,
        image_grid_thw=None,
    )


def question_of(sample: Any) -> str:
    return str(sample.messages[1]["content"])


def answered(sample: Any) -> str:
    """The question a ToyGenerator reply answers ("<question> -> rN")."""
    return str(sample.messages[-1]["content"]).rsplit(" -> ", 1)[0]


class ToyGenerator:
    """`GeneratorInterface.generate` without an inference engine: one reply per input row.

    Each reply quotes the question it answers, so a sample shows whether its prompt is right.
    `reward(question, repetition)` scores it; `length` names (question, repetition) pairs cut
    off at max length, whose loss masks SkyRL's own `apply_overlong_filtering` zeroes, as
    SkyRLGymGenerator does with `apply_overlong_filtering=true`.
    """

    def __init__(self, tokenizer: Any, reward: Any, length: frozenset[tuple[str, int]] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.reward = reward
        self.length = length
        self.calls = 0

    async def generate(self, input_batch: GeneratorInput, disable_tqdm: bool = False) -> GeneratorOutput:
        self.calls += 1
        questions = [p[-1]["content"] for p in input_batch["prompts"]]
        reps = [t.repetition_id for t in input_batch["trajectory_ids"] or []]
        answers = [[("assistant", f"{q} -> r{k}")] for q, k in zip(questions, reps, strict=True)]
        stops = ["length" if (q, k) in self.length else "stop" for q, k in zip(questions, reps, strict=True)]
        out = generator_output(
            self.tokenizer,
            questions,
            answers,
            rewards=[float(self.reward(q, k)) for q, k in zip(questions, reps, strict=True)],
            stop_reasons=stops,
        )
        out["loss_masks"] = apply_overlong_filtering(out["loss_masks"], stops)
        out["rollout_metrics"] = {}
        return out


def config(n: int, batch: int, sampling: str | None = None, step_wise: bool = False) -> Any:
    """The part of SkyRL's config (skyrl.train.config.SkyRLTrainConfig) these methods read."""
    return SimpleNamespace(
        generator=SimpleNamespace(
            n_samples_per_prompt=n,
            step_wise_trajectories=step_wise,
            merge_stepwise_output=False,
            inference_engine=SimpleNamespace(enable_return_routed_experts=False),
        ),
        trainer=SimpleNamespace(
            project_name="skyrl-project",
            run_name="skyrl-run",
            train_batch_size=batch,
            num_logger_train_samples=0,
            algorithm=SimpleNamespace(
                zero_variance_filter=False,
                zero_variance_filter_tol=0.0,
                dynamic_sampling=SimpleNamespace(type=sampling, max_sample_batches=4, min_replace_ratio=0.3),
            ),
        ),
        environment=SimpleNamespace(env_class="gsm8k"),
    )


class Trainer(RayPPOTrainer):
    """SkyRL's RayPPOTrainer methods with the attributes its constructor would set."""

    def __init__(self, cfg: Any, tokenizer: Any, generator: ToyGenerator) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.generator = generator
        self.all_metrics: dict[str, Any] = {}
        self.dynamic_sampling_state = None
        self.trajectory_logger = None
        self.global_step = 1
        self.batches: list[list[dict[str, Any]]] = []

    async def train(self) -> None:
        """RayPPOTrainer.train's loop over the dataloader: a step ends once its batch is trained."""
        for rows in self.batches:
            if await self.train_step(rows) is not None:
                self.global_step += 1

    async def train_step(self, rows: list[dict[str, Any]]) -> Any:
        """One pass of RayPPOTrainer.train's loop body (trainer.py 338-395) up to its logging point.

        Returns `(generator_output, uids)` as the trainer logs them, or None where dynamic
        sampling asks for another batch (the loop `continue`s without logging).
        """
        gi, uids = prepare_generator_input(
            rows, self.cfg.generator.n_samples_per_prompt, {}, "gsm8k", "train", self.global_step
        )
        go = await self.generate(gi)
        if self.cfg.generator.step_wise_trajectories:
            uids = [tid.instance_id for tid in go["trajectory_ids"]]
        if self.cfg.trainer.algorithm.dynamic_sampling.type is not None:
            go, uids, keep_sampling = self.handle_dynamic_sampling(go, uids)
            if keep_sampling:
                return None
        return self.postprocess_generator_output(go, uids)


class AsyncTrainer(FullyAsyncRayPPOTrainer, Trainer):
    """SkyRL's FullyAsyncRayPPOTrainer methods; `convert_to_training_input` (tensors, Ray) left out."""

    max_staleness_steps = 4

    def convert_to_training_input(self, generator_output: Any, uids: Any) -> Any:
        return generator_output, uids

    async def generate_group(self, row: dict[str, Any]) -> GeneratedOutputGroup:
        """One group as `_run_generate_for_a_group_loop` makes it (fully_async_trainer.py 902-942)."""
        gi, uids = prepare_generator_input(
            [row], self.cfg.generator.n_samples_per_prompt, {}, "gsm8k", "train", self.global_step
        )
        scheduled = self.global_step
        go = await self.generator.generate(gi, disable_tqdm=True)
        return GeneratedOutputGroup(
            generator_output=go, uid=uids[0], global_step_when_scheduled=scheduled, prompts=gi["prompts"]
        )


def by_question(rewards: dict[str, list[float]]) -> Any:
    return lambda question, repetition: rewards[question][repetition]


# --- dynamic sampling, overlong filtering and step-wise rewards, run by SkyRL's own code ---


def test_replace_sampling_rows_take_their_uids_prompts(tokenizer: Any) -> None:
    """After "replace" rewrote rows, each sample has the prompt of the uid SkyRL returned for it."""
    questions = ["q0", "q1", "q2", "q3"]
    # q1 and q3 score the same on both samples: no GRPO signal, so "replace" overwrites them.
    rewards = {"q0": [1.0, 0.0], "q1": [1.0, 1.0], "q2": [0.0, 1.0], "q3": [0.0, 0.0]}
    gi, uids = prepare_generator_input(dataset_rows(questions), 2, {}, "gsm8k", "train", 1)  # type: ignore[arg-type]
    go = asyncio.run(ToyGenerator(tokenizer, by_question(rewards)).generate(gi))
    np.random.seed(0)
    config_ = {"type": "replace", "n_samples_per_prompt": 2, "min_replace_ratio": 0.3}
    go, uids, keep_sampling, _ = handle_dynamic_sampling(go, uids, config_)
    assert not keep_sampling and set(uids) == {"0", "2"}
    samples = skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer, uids=uids)
    assert [question_of(s) for s in samples] == [questions[int(u)] for u in uids]
    assert [answered(s) for s in samples] == [question_of(s) for s in samples]
    assert [s.metadata["group_uid"] for s in samples] == uids
    assert [s.metadata["reward"] for s in samples] == [float(r) for r in go["rewards"]]
    # Rows "replace" left in place keep their trajectory ids; copied rows have none they could name.
    assert [s.metadata.get("trajectory_id") for s in samples[:2]] == ["0:0", "0:1"]
    assert all("trajectory_id" not in s.metadata for s in samples if s.metadata["sample_index"] in (2, 3))


def test_filter_sampling_collects_rows_of_several_inputs(tokenizer: Any) -> None:
    """After "filter" collected rows from two batches, every row finds its prompt in its own batch."""
    rewards = {"a": [1.0, 1.0], "b": [0.0, 1.0], "c": [1.0, 0.0], "d": [0.5, 0.0]}
    generator = ToyGenerator(tokenizer, by_question(rewards))
    config_ = {"type": "filter", "n_samples_per_prompt": 2, "train_batch_size": 2}
    state: dict[str, Any] = {"sample_batch_count": 1}
    inputs = []
    for first, batch in ((0, ["a", "b"]), (2, ["c", "d"])):
        gi, uids = prepare_generator_input(
            dataset_rows(batch, first),
            2,
            {},
            "gsm8k",
            "train",
            1,  # type: ignore[arg-type]
        )
        inputs.append(gi)
        go, uids, keep_sampling, state = handle_dynamic_sampling(
            asyncio.run(generator.generate(gi)), uids, config_, state
        )
    assert not keep_sampling and uids == ["1", "1", "2", "2"]
    samples = skyrl_adapter.to_samples(inputs, go, tokenizer=tokenizer, uids=uids)
    assert [question_of(s) for s in samples] == ["b", "b", "c", "c"]
    assert [answered(s) for s in samples] == ["b", "b", "c", "c"]
    assert [s.metadata["prompt_index"] for s in samples] == [0, 0, 1, 1]
    assert [s.metadata["reward"] for s in samples] == [0.0, 1.0, 1.0, 0.0]


def test_prompt_index_numbers_the_prompts_of_a_real_input(tokenizer: Any) -> None:
    """SkyRL repeats each prompt once per sample; prompt_index numbers prompts, not rows."""
    gi = generator_input(["What is 2 + 2?", "Name a prime."], n=2)
    go = asyncio.run(ToyGenerator(tokenizer, lambda q, k: k).generate(gi))
    samples = skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)
    assert [s.metadata["prompt_index"] for s in samples] == [0, 0, 1, 1]
    assert [s.metadata["trajectory_id"] for s in samples] == ["0:0", "0:1", "1:0", "1:1"]
    assert samples[2].messages == [
        *chat("Name a prime."),
        {"role": "assistant", "content": "Name a prime. -> r0"},
    ]
    assert {s.metadata["env_class"] for s in samples} == {"gsm8k"}
    assert [s.metadata["reward"] for s in samples] == [0.0, 1.0, 0.0, 1.0]


def step_wise_rows(
    tokenizer: Any, question: str, steps: list[tuple[str, str]]
) -> tuple[list[list[int]], list[list[int]]]:
    """Observations and actions of a trajectory whose turns alternate (assistant, tool)."""
    observations: list[list[int]] = []
    actions: list[list[int]] = []
    history = encode(tokenizer, [("user", question)])[0]
    for action_text, tool_text in steps:
        observations.append(list(history))
        action = encode(tokenizer, [("assistant", action_text)])[0]
        actions.append(action)
        history += action + encode(tokenizer, [("tool", tool_text)])[0]
    return observations, actions


def step_wise_output(tokenizer: Any, rewards: list[float]) -> GeneratorOutput:
    """Two trajectories of prompt "0" (two steps, then one), one row per step, as SkyRLGymGenerator."""
    steps = [("Let me look.", "result: 42"), ("It is 42.", "")]
    obs_a, act_a = step_wise_rows(tokenizer, "question a", steps)
    obs_b, act_b = step_wise_rows(tokenizer, "question a", steps[:1])
    go = generator_output(tokenizer, [], [])
    go.update(
        prompt_token_ids=[obs_a[0], obs_a[1], obs_b[0]],
        response_ids=[act_a[0], act_a[1], act_b[0]],
        rewards=rewards,
        loss_masks=[[1] * len(a) for a in (act_a[0], act_a[1], act_b[0])],
        stop_reasons=["stop"] * 3,
        trajectory_ids=[TrajectoryID("0", 0), TrajectoryID("0", 0), TrajectoryID("0", 1)],
        is_last_step=[False, True, True],
    )
    return go


def test_step_wise_reward_is_the_last_steps(tokenizer: Any) -> None:
    """A step-wise trajectory's reward is its last step's, as SkyRL's trainer computes it."""
    go = step_wise_output(tokenizer, [0.5, 1.0, 0.25])
    gi = generator_input(["question a"], n=2)
    first, second = skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)
    assert [first.metadata["reward"], second.metadata["reward"]] == [1.0, 0.25]
    assert first.metadata["num_steps"] == 2
    # Through the trainer's postprocessing, which turns each step's reward into per-token rewards
    # and reports the mean trajectory reward over last steps only.
    trainer = Trainer(config(2, 1, step_wise=True), tokenizer, ToyGenerator(tokenizer, None))
    uids = [tid.instance_id for tid in go["trajectory_ids"] or []]
    go, uids = trainer.postprocess_generator_output(go, uids)
    samples = skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer, uids=uids)
    assert [s.metadata["reward"] for s in samples] == [1.0, 0.25]
    assert np.mean([s.metadata["reward"] for s in samples]) == trainer.all_metrics["reward/avg_raw_reward"]
    assert samples[0].messages[2:] == [
        {"role": "assistant", "content": "Let me look."},
        {"role": "tool", "content": "result: 42"},
        {"role": "assistant", "content": "It is 42."},
    ]


def test_overlong_filtered_rows_stay_assistant_turns(tokenizer: Any) -> None:
    """Rows SkyRL's overlong filtering masked out are one assistant turn each, marked loss_masked."""
    generator = ToyGenerator(tokenizer, lambda q, k: 1.0, length=frozenset({("q0", 1)}))
    trainer = Trainer(config(2, 1), tokenizer, generator)
    go, uids = asyncio.run(trainer.train_step(dataset_rows(["q0"])))
    assert go["loss_masks"][1] == [0] * len(go["loss_masks"][1])
    kept, truncated = skyrl_adapter.to_samples(
        generator_input(["q0"], n=2), go, tokenizer=tokenizer, uids=uids
    )
    assert truncated.messages == [*chat("q0"), {"role": "assistant", "content": "q0 -> r1"}]
    assert truncated.metadata["loss_masked"] is True and truncated.metadata["stop_reason"] == "length"
    assert truncated.metadata["num_turns"] == 1
    assert "loss_masked" not in kept.metadata


# --- the hook: one call per training step, never raising into training ---


def records_by_step(sink: at.testing.MemorySink) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for record in sink.records:
        out.setdefault(record.step, []).append(record)
    return out


def test_attach_logs_each_sync_training_step_once(tokenizer: Any) -> None:
    """In the sync trainer, each step is logged once, after "filter" sampling, with the right prompts."""
    rewards = {"a": [1.0, 0.0], "b": [1.0, 1.0], "c": [0.0, 1.0], "d": [0.5, 0.0], "e": [0, 1], "f": [1, 0]}
    generator = ToyGenerator(tokenizer, by_question(rewards))
    trainer = Trainer(config(2, 2, sampling="filter"), tokenizer, generator)
    trainer.batches = [dataset_rows(batch, first) for first, batch in ((0, "ab"), (2, "cd"), (4, "ef"))]
    sink = at.testing.MemorySink()
    # Without a session, attach opens one named after the config and finishes it with train().
    assert skyrl_adapter.attach(trainer, sinks=[sink]) is trainer
    asyncio.run(trainer.train())
    assert sink.closed
    assert generator.calls == 3 and trainer.global_step == 3
    steps = records_by_step(sink)
    assert sorted(steps) == [1, 2]
    logged = {step: [r.sample for r in records] for step, records in steps.items()}
    assert [question_of(s) for s in logged[1]] == ["a", "a", "c", "c"]
    assert [question_of(s) for s in logged[2]] == ["e", "e", "f", "f"]
    for samples in logged.values():
        assert [answered(s) for s in samples] == [question_of(s) for s in samples]
    assert [s.metadata["reward"] for s in logged[1]] == [1.0, 0.0, 0.0, 1.0]
    assert [s.metadata["generated_at_step"] for s in logged[1]] == [1, 1, 1, 1]
    assert {r.split for r in sink.records} == {"train"}


def test_attach_logs_each_fully_async_training_step_once(tokenizer: Any) -> None:
    """In the fully async trainer, the groups of a step are logged once, each under its prompt."""
    generator = ToyGenerator(tokenizer, lambda q, k: float(k))
    trainer = AsyncTrainer(config(2, 3), tokenizer, generator)
    sink = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[sink]) as session:
        skyrl_adapter.attach(trainer, session)
        # The trainer looks for this parameter on the generator's generate (fully_async_trainer.py 923).
        assert "disable_tqdm" in inspect.signature(trainer.generator.generate).parameters
        groups = []
        for i, question in enumerate(["x", "y", "z"]):
            trainer.global_step = 1 + i // 2  # the last group was scheduled after a weight update
            groups.append(asyncio.run(trainer.generate_group(dataset_rows([question], 10 + i)[0])))
        trainer.global_step = 3
        _, uids = trainer.convert_generation_group_mini_batch_to_training_input(groups)
    samples = [r.sample for r in sink.records]
    assert {r.step for r in sink.records} == {3}
    assert [question_of(s) for s in samples] == ["x", "x", "y", "y", "z", "z"]
    assert [answered(s) for s in samples] == [question_of(s) for s in samples]
    assert [s.metadata["group_uid"] for s in samples] == uids == ["10", "10", "11", "11", "12", "12"]
    assert [s.metadata["prompt_index"] for s in samples] == [0, 0, 1, 1, 2, 2]
    assert [s.metadata["generated_at_step"] for s in samples] == [1, 1, 1, 1, 2, 2]
    assert [s.metadata["reward"] for s in samples] == [0.0, 1.0] * 3
    assert session.stats().check()


def test_attach_never_raises_into_training(tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A step the adapter cannot convert is counted as invalid rows; the trainer's result is untouched."""
    trainer = Trainer(config(2, 1), tokenizer, ToyGenerator(tokenizer, lambda q, k: float(k)))
    postprocess = trainer.postprocess_generator_output

    def broken(generator_output: Any, uids: Any) -> Any:
        generator_output, uids = postprocess(generator_output, uids)
        generator_output["loss_masks"][0] = [*generator_output["loss_masks"][0], 1]
        return generator_output, uids

    trainer.postprocess_generator_output = broken  # type: ignore[method-assign]
    with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as session:
        skyrl_adapter.attach(trainer, session)
        go, uids = asyncio.run(trainer.train_step(dataset_rows(["q"])))
    assert uids == ["0", "0"] and len(go["response_ids"]) == 2
    stats = session.stats()
    assert stats.dropped["invalid"] == 2 and stats.written == 0 and stats.check()
    assert any("skyrl_adapter.attach" in r.getMessage() for r in caplog.records)


def test_a_moved_hook_point_is_named_and_the_trainer_left_as_it_is(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch, hook_warnings: list[str]
) -> None:
    """A trainer whose SkyRL renamed the method attach wraps, built by an attached experiment, and
    one whose generator's `generate` is no coroutine: attach says so once, naming SkyRL 0.4.0 and
    what does not fit, opens no session and leaves the trainer as it was; nothing raises."""
    method = RayPPOTrainer.postprocess_generator_output
    monkeypatch.delattr(RayPPOTrainer, "postprocess_generator_output")
    monkeypatch.setattr(RayPPOTrainer, "postprocess_generated_output", method, raising=False)
    sink = at.testing.MemorySink()
    exp = skyrl_adapter.attach(_BasePPOExp(config(2, 1)), sinks=[sink])
    generator = ToyGenerator(tokenizer, lambda q, k: 0.0)
    trainer = exp.get_trainer(cfg=exp.cfg, tokenizer=tokenizer, generator=generator)
    assert isinstance(trainer, Trainer) and not hasattr(generator.generate, "__wrapped__")
    moved(hook_warnings, "skyrl_adapter.attach", "SkyRL 0.4.0", "Trainer.postprocess_generator_output")
    monkeypatch.undo()
    plain = Trainer(config(2, 1), tokenizer, generator)
    plain.generator.generate = lambda input_batch: None  # type: ignore[method-assign]
    assert skyrl_adapter.attach(plain, sinks=[sink]) is plain
    assert sum("Trainer.generator.generate is not a coroutine function" in m for m in hook_warnings) == 1
    assert "postprocess_generator_output" not in vars(plain) and not sink.opened


def test_a_renamed_field_is_counted_row_by_row(
    tokenizer: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose output lacks `response_ids` (renamed in another SkyRL version) is counted in
    full, by the trainer's uids, with a warning naming the field; training goes on."""
    monkeypatch.setattr(_hooks, "_warned", set())  # warnings are once per hook and process
    trainer = Trainer(config(2, 2), tokenizer, ToyGenerator(tokenizer, lambda q, k: float(k)))
    postprocess = trainer.postprocess_generator_output

    def renamed(generator_output: Any, uids: Any) -> Any:
        generator_output, uids = postprocess(generator_output, uids)
        generator_output["response_token_ids"] = generator_output.pop("response_ids")
        return generator_output, uids

    trainer.postprocess_generator_output = renamed  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, logger="asynctrace")
    with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as session:
        skyrl_adapter.attach(trainer, session)
        go, uids = asyncio.run(trainer.train_step(dataset_rows(["q", "r"])))
    assert len(uids) == 4 and "response_token_ids" in go
    stats = session.stats()
    assert stats.dropped["invalid"] == 4 and stats.written == 0 and stats.check()
    (warning,) = [r.getMessage() for r in caplog.records if "skyrl_adapter.attach" in r.getMessage()]
    assert "4 rows" in warning and "response_ids" in warning


@pytest.mark.parametrize("sampling", [None, "filter", "replace"])
def test_attach_gives_training_traces_their_trajectory_ids(tokenizer: Any, sampling: str | None) -> None:
    """Non-step-wise training traces carry `instance_id:repetition_id`, as the mapping says: rows in
    place, rows "filter" collected from several batches, and never a guess for "replace" copies."""
    # b has no reward spread: "filter" drops it and samples c and d; "replace" overwrites it.
    rewards = {"a": [1.0, 0.0], "b": [1.0, 1.0], "c": [0.0, 1.0], "d": [0.5, 0.0]}
    trainer = Trainer(
        config(2, 2, sampling=sampling), tokenizer, ToyGenerator(tokenizer, by_question(rewards))
    )
    trainer.batches = [dataset_rows(list("ab")), dataset_rows(list("cd"), 2)]
    sink = at.testing.MemorySink()
    np.random.seed(0)
    with at.TraceSession("p", sinks=[sink]) as session:
        skyrl_adapter.attach(trainer, session)
        asyncio.run(trainer.train())
    first = [r.sample for r in sink.records if r.step == 1]
    tids = [(question_of(s), s.metadata.get("trajectory_id")) for s in first]
    if sampling is None:
        assert tids == [("a", "0:0"), ("a", "0:1"), ("b", "1:0"), ("b", "1:1")]
    elif sampling == "filter":
        assert tids == [("a", "0:0"), ("a", "0:1"), ("c", "2:0"), ("c", "2:1")]
    else:
        assert tids == [("a", "0:0"), ("a", "0:1"), ("a", None), ("a", None)]
    assert [answered(s) for s in first] == [q for q, _ in tids]


def test_fully_async_training_traces_have_trajectory_ids(tokenizer: Any) -> None:
    """The fully async trainer's groups, generated one by one, give each row its trajectory id."""
    trainer = AsyncTrainer(config(2, 2), tokenizer, ToyGenerator(tokenizer, lambda q, k: float(k)))
    sink = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[sink]) as session:
        skyrl_adapter.attach(trainer, session)
        groups = [
            asyncio.run(trainer.generate_group(dataset_rows([q], 7 + i)[0])) for i, q in enumerate("xy")
        ]
        trainer.convert_generation_group_mini_batch_to_training_input(groups[::-1])
    assert [s.metadata.get("trajectory_id") for s in (r.sample for r in sink.records)] == [
        "8:0",
        "8:1",
        "7:0",
        "7:1",
    ]


def test_evaluation_batches_are_logged_as_eval(tokenizer: Any) -> None:
    """Eval batches are logged as they come back, split "eval"; their uids never name training prompts."""
    generator = ToyGenerator(tokenizer, lambda q, k: float(k))
    trainer = Trainer(config(2, 1), tokenizer, generator)
    sink = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[sink]) as session:
        skyrl_adapter.attach(trainer, session)
        gi, uids = prepare_generator_input(dataset_rows(["train q"]), 2, {}, "gsm8k", "train", 1)  # type: ignore[arg-type]
        go = asyncio.run(trainer.generator.generate(gi))
        # SkyRL's evaluate() prepares eval batches with training_phase "eval", uids from 0 again.
        asyncio.run(trainer.generator.generate(generator_input(["eval q"], n=2, step=5, phase="eval")))
        trainer.postprocess_generator_output(go, uids)
    logged = [(r.split, r.step, question_of(r.sample), r.sample.metadata["reward"]) for r in sink.records]
    assert logged == [
        ("eval", 5, "eval q", 0.0),
        ("eval", 5, "eval q", 1.0),
        ("train", 1, "train q", 0.0),
        ("train", 1, "train q", 1.0),
    ]


# --- conversions kept from before, on SkyRL's own types ---


def test_tool_turns_come_from_the_loss_mask(tokenizer: Any) -> None:
    """0-runs of a response's loss mask are tool turns between the assistant turns."""
    turns = [
        ("assistant", '<tool_call>{"name": "python"}</tool_call>'),
        ("tool", "<|im_start|>tool\n4\n<|im_end|>\n"),
        ("assistant", "The answer is 4."),
    ]
    gi = generator_input(["What is 2 + 2?"])
    go = generator_output(tokenizer, ["What is 2 + 2?"], [turns])
    (sample,) = skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)
    assert sample.messages == [*chat("What is 2 + 2?"), *({"role": r, "content": t} for r, t in turns)]
    assert sample.metadata["num_turns"] == 2


def test_per_token_rewards_are_summed(tokenizer: Any) -> None:
    """Per-token rewards become one scalar reward per sample."""
    gi = generator_input(["q"])
    go = generator_output(tokenizer, ["q"], [[("assistant", "a b c")]])
    go["rewards"] = [[0.0] * (len(go["response_ids"][0]) - 1) + [0.75]]
    (sample,) = skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)
    assert sample.metadata["reward"] == 0.75


def test_output_trajectory_ids_map_samples_to_prompts(tokenizer: Any) -> None:
    """Trajectory ids on the output pick the prompt, whatever the output order."""
    gi = generator_input(["first question", "second question"], n=2)
    in_ids = gi["trajectory_ids"] or []
    out_ids = [in_ids[3], in_ids[0], in_ids[2], in_ids[1]]
    go = generator_output(
        tokenizer,
        ["second question", "first question", "second question", "first question"],
        [[("assistant", f"reply {i}")] for i in range(4)],
        trajectory_ids=out_ids,
    )
    samples = skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)
    assert [s.metadata["prompt_index"] for s in samples] == [1, 0, 1, 0]
    assert [s.metadata["trajectory_id"] for s in samples] == ["1:1", "0:0", "1:0", "0:1"]
    assert [question_of(s) for s in samples] == [
        "second question",
        "first question",
        "second question",
        "first question",
    ]


def test_batch_metadata_gives_step_and_split() -> None:
    """training_phase "eval" logs to the eval split; without batch_metadata the default step is used."""
    train = generator_input(["q"], step=7)
    evaluation = generator_input(["q"], step=9, phase="eval")
    assert isinstance(train["batch_metadata"], BatchMetadata)
    assert skyrl_adapter.step_and_split(train) == (7, "train")
    assert skyrl_adapter.step_and_split(evaluation) == (9, "eval")
    no_metadata = GeneratorInput(**{**train, "batch_metadata": None})
    assert skyrl_adapter.step_and_split(no_metadata, default_step=3) == (3, "train")


def test_step_wise_rows_merge_into_one_sample_per_trajectory(tokenizer: Any) -> None:
    """Step-wise rows of a trajectory become one multi-turn sample with the chat prompt."""
    steps = [("Let me look.", "result: 42"), ("It is 42.", "")]
    obs_a, act_a = step_wise_rows(tokenizer, "question a", steps)
    obs_b, act_b = step_wise_rows(tokenizer, "question b", steps[:1])
    gi = generator_input(["question a", "question b"])
    go = generator_output(tokenizer, [], [])
    go.update(
        prompt_token_ids=[obs_a[0], obs_b[0], obs_a[1]],
        response_ids=[act_a[0], act_b[0], act_a[1]],
        rewards=[0.0, 0.5, 1.0],
        loss_masks=[[1] * len(a) for a in (act_a[0], act_b[0], act_a[1])],
        stop_reasons=["tool", "stop", "stop"],
        trajectory_ids=[TrajectoryID("0", 0), TrajectoryID("1", 0), TrajectoryID("0", 0)],
        is_last_step=[False, True, True],
    )
    first, second = skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)
    assert first.messages == [
        *chat("question a"),
        {"role": "assistant", "content": "Let me look."},
        {"role": "tool", "content": "result: 42"},
        {"role": "assistant", "content": "It is 42."},
    ]
    assert first.metadata["num_steps"] == 2
    assert first.metadata["reward"] == 1.0
    assert first.metadata["stop_reason"] == "stop"
    assert first.metadata["trajectory_id"] == "0:0"
    assert first.metadata["prompt_index"] == 0
    assert second.messages == [*chat("question b"), {"role": "assistant", "content": "Let me look."}]
    assert second.metadata["prompt_index"] == 1


def test_step_wise_prefix_mismatch_starts_a_sample_from_the_observation(tokenizer: Any) -> None:
    """After a rewritten context, the new sample's prompt is the decoded observation."""
    summary = encode(tokenizer, [("user", "summary so far")])[0]
    act = encode(tokenizer, [("assistant", "continue")])[0]
    first_obs = encode(tokenizer, [("user", "question")])[0]
    go = generator_output(tokenizer, [], [])
    go.update(
        prompt_token_ids=[first_obs, summary],
        response_ids=[act, act],
        rewards=[0.5, 1.0],
        loss_masks=[[1] * len(act)] * 2,
        stop_reasons=None,
        trajectory_ids=[TrajectoryID("0", 0)] * 2,
        is_last_step=[False, True],
    )
    first, second = skyrl_adapter.to_samples(generator_input(["question"]), go, tokenizer=tokenizer)
    assert first.messages[:2] == chat("question")
    assert second.messages == [
        {"role": "user", "content": "summary so far"},
        {"role": "assistant", "content": "continue"},
    ]
    assert second.metadata["prompt_index"] == 0
    # Only the part holding the last step carries the trajectory's reward.
    assert "reward" not in first.metadata and second.metadata["reward"] == 1.0


def test_short_optional_lists_warn_once(tokenizer: Any) -> None:
    """Short stop_reasons / rewards / env_metrics never raise; the fields are left out, one warning."""
    gi = generator_input(["q1", "q2"])
    go = generator_output(
        tokenizer,
        ["q1", "q2"],
        [[("assistant", "x")], [("assistant", "y")]],
        rewards=[1.0],
        stop_reasons=["length"],
        env_metrics=[{"steps": 1}],
    )
    with pytest.warns(UserWarning) as record:
        samples = skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)
    assert len(record) == 1
    assert "rewards" in str(record[0].message) and "stop_reasons" in str(record[0].message)
    assert [s.metadata.get("reward") for s in samples] == [1.0, None]
    assert [s.metadata.get("stop_reason") for s in samples] == ["length", None]
    assert [s.metadata.get("env_metrics") for s in samples] == [{"steps": 1}, None]


def test_required_columns_that_disagree_are_refused(tokenizer: Any) -> None:
    """Structural mismatches are ValueErrors naming the field."""
    gi = generator_input(["q1", "q2"])
    go = generator_output(tokenizer, ["q1", "q2", "q2"], [[("assistant", "x")]] * 3)
    with pytest.raises(ValueError, match="do not split evenly"):
        skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="uids: has 2 values"):
        skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer, uids=["0", "1"])
    go = generator_output(tokenizer, ["q1", "q2"], [[("assistant", "x")]] * 2)
    go["loss_masks"][0] = [*go["loss_masks"][0], 1]
    with pytest.raises(ValueError, match="loss_masks: row 0"):
        skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)
    go["prompt_token_ids"] = go["prompt_token_ids"][:1]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)


def groups_of_a_step(tokenizer: Any) -> list[Any]:
    """Three generation groups (one prompt, two samples each); the first as an (input, output) pair."""
    trainer = AsyncTrainer(config(2, 3), tokenizer, ToyGenerator(tokenizer, lambda q, k: k + 0.5 * len(q)))
    groups: list[Any] = []
    for g in range(3):
        trainer.global_step = 10 + g
        group = asyncio.run(trainer.generate_group(dataset_rows(["q" * (g + 1)], g)[0]))
        groups.append((generator_input(["q"], n=2), group.generator_output) if g == 0 else group)
    return groups


def test_fully_async_groups_become_one_training_step(tokenizer: Any) -> None:
    """Several generation groups give one list of samples with indices running across the step."""
    samples = skyrl_adapter.to_step_samples(groups_of_a_step(tokenizer), tokenizer=tokenizer)
    assert [s.metadata["sample_index"] for s in samples] == list(range(6))
    assert [s.metadata["prompt_index"] for s in samples] == [0, 0, 1, 1, 2, 2]
    assert [s.metadata["group_index"] for s in samples] == [0, 0, 1, 1, 2, 2]
    assert [s.metadata.get("policy_version") for s in samples] == [None, None, 11, 11, 12, 12]
    assert [s.metadata["trajectory_id"] for s in samples[2:4]] == ["1:0", "1:1"]
    assert samples[3].metadata["group_uid"] == "1"
    assert samples[5].messages == [*chat("qqq"), {"role": "assistant", "content": "qqq -> r1"}]


def test_end_to_end_cap_holds_per_training_step(tokenizer: Any, project: str) -> None:
    """Logged once per training step, the cap keeps 3 of the 6 samples of three groups in Trackio."""
    samples = skyrl_adapter.to_step_samples(groups_of_a_step(tokenizer), tokenizer=tokenizer)
    step, split = skyrl_adapter.step_and_split(generator_input(["q"], step=4))
    assert step is not None
    with at.TraceSession(project, run="r", max_traces_per_step=3, sampler="first") as session:
        session.log_samples(samples, step=step, split=split)
    traces = read_traces(project, "r")
    assert len(traces) == 3
    assert {t["step"] for t in traces} == {4}
    assert traces[0]["messages"][-1]["content"] == "q -> r0"


def test_overlong_filtered_step_stays_an_assistant_turn(tokenizer: Any) -> None:
    """A truncated step-wise row masked out entirely is still an assistant turn after the merge."""
    obs, act = step_wise_rows(tokenizer, "question", [("Let me look.", "result: 42"), ("It is", "")])
    stops = ["stop", "length"]
    go = generator_output(tokenizer, [], [])
    go.update(
        prompt_token_ids=obs,
        response_ids=act,
        rewards=[0.0, 0.0],
        loss_masks=apply_overlong_filtering([[1] * len(a) for a in act], stops),
        stop_reasons=stops,
        trajectory_ids=[TrajectoryID("0", 0)] * 2,
        is_last_step=[False, True],
    )
    (sample,) = skyrl_adapter.to_samples(generator_input(["question"]), go, tokenizer=tokenizer)
    assert sample.messages[2:] == [
        {"role": "assistant", "content": "Let me look."},
        {"role": "tool", "content": "result: 42"},
        {"role": "assistant", "content": "It is"},
    ]
    assert sample.metadata["num_turns"] == 2
    assert sample.metadata["loss_masked"] is True


def test_fully_async_step_wise_group_maps_trajectories_to_prompts(tokenizer: Any) -> None:
    """A step-wise group with one prompt per trajectory merges each trajectory under its prompt."""
    go = step_wise_output(tokenizer, [0.0, 1.0, 0.0])
    group = GeneratedOutputGroup(go, uid="0", global_step_when_scheduled=2, prompts=[chat("question a")] * 2)
    first, second = skyrl_adapter.to_step_samples([group], tokenizer=tokenizer)
    assert [m["role"] for m in first.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert second.messages == [*chat("question a"), {"role": "assistant", "content": "Let me look."}]
    assert [first.metadata["trajectory_id"], second.metadata["trajectory_id"]] == ["0:0", "0:1"]
    assert [first.metadata["prompt_index"], second.metadata["prompt_index"]] == [0, 0]
    assert [first.metadata["policy_version"], second.metadata["policy_version"]] == [2, 2]


def _one_sample(tokenizer: Any, prompt: str, turns: list[tuple[str, str]]) -> Any:
    """The sample SkyRL's adapter makes of one prompt and its response, given as turns."""
    go = generator_output(tokenizer, [prompt], [turns])
    (sample,) = skyrl_adapter.to_samples(generator_input([prompt]), go, tokenizer=tokenizer)
    return sample


def test_appended_eos_stays_with_the_last_assistant_turn(tokenizer: Any) -> None:
    """The EOS SkyRL appends after a stop string (mask 0) ends the last assistant turn, not a tool turn."""
    observation = "<|im_end|>\n<|im_start|>user\nresult<|im_end|>\n<|im_start|>assistant\n"
    turns = [
        ("assistant", "<search>x</search>"),
        ("tool", observation),
        ("assistant", "<answer>4</answer>"),
        ("tool", "<|im_end|>"),
    ]
    sample = _one_sample(tokenizer, "q", turns)
    assert sample.messages[2:] == [
        {"role": "assistant", "content": "<search>x</search>"},
        {"role": "tool", "content": observation},
        {"role": "assistant", "content": "<answer>4</answer><|im_end|>"},
    ]
    assert sample.metadata["num_turns"] == 2


def test_masked_chat_template_framing_stays_with_the_assistant_turns(tokenizer: Any) -> None:
    """The masked header before the first answer and newline after the last join those turns."""
    user = "\n<|im_start|>user\nfile.txt<|im_end|>\n<|im_start|>assistant\n"
    turns = [
        ("header", "<|im_start|>assistant\n"),
        ("assistant", "ls<|im_end|>"),
        ("user", user),
        ("assistant", "done<|im_end|>"),
        ("newline", "\n"),
    ]
    sample = _one_sample(tokenizer, "list files", turns)
    assert sample.messages[2:] == [
        {"role": "assistant", "content": "<|im_start|>assistant\nls<|im_end|>"},
        {"role": "tool", "content": user},
        {"role": "assistant", "content": "done<|im_end|>\n"},
    ]
    assert sample.metadata["num_turns"] == 2


def test_step_wise_final_observation_stays_an_environment_turn(tokenizer: Any) -> None:
    """SkyRL's step-wise rows end with their observation; the last one is not folded into the answer."""
    prompt = encode(tokenizer, [("user", "question")])[0]
    first_ids, first_mask = encode(tokenizer, [("assistant", "Let me look."), ("tool", "result: 42")])
    last_ids, last_mask = encode(tokenizer, [("assistant", "It is 42."), ("tool", "Correct!")])
    go = generator_output(tokenizer, [], [])
    go.update(
        prompt_token_ids=[prompt, prompt + first_ids],
        response_ids=[first_ids, last_ids],
        rewards=[0.0, 1.0],
        loss_masks=[first_mask, last_mask],
        stop_reasons=["stop", "stop"],
        trajectory_ids=[TrajectoryID("0", 0)] * 2,
        is_last_step=[False, True],
    )
    (sample,) = skyrl_adapter.to_samples(generator_input(["question"]), go, tokenizer=tokenizer)
    assert sample.messages[2:] == [
        {"role": "assistant", "content": "Let me look."},
        {"role": "tool", "content": "result: 42"},
        {"role": "assistant", "content": "It is 42."},
        {"role": "tool", "content": "Correct!"},
    ]


class TrainerOfSkyrlTrain03(Trainer):
    """skyrl-train 0.3's shape: a plain `train()`; `postprocess_generator_output` returns the output."""

    def train(self) -> None:  # type: ignore[override]
        for rows in self.batches:
            asyncio.run(self.train_step(rows))
            self.global_step += 1

    def postprocess_generator_output(self, generator_output: Any, uids: Any, *args: Any) -> Any:  # type: ignore[override]
        return super().postprocess_generator_output(generator_output, uids)[0]


def test_attach_handles_skyrl_train_03_trainers(tokenizer: Any) -> None:
    """With skyrl-train 0.3's return shape and plain train(), steps are logged and the session finished."""
    trainer = TrainerOfSkyrlTrain03(config(2, 1), tokenizer, ToyGenerator(tokenizer, lambda q, k: float(k)))
    trainer.batches = [dataset_rows(["q0"]), dataset_rows(["q1"], 1)]
    sink = at.testing.MemorySink()
    skyrl_adapter.attach(trainer, sinks=[sink])
    trainer.train()
    assert sink.closed
    assert [(r.step, question_of(r.sample)) for r in sink.records] == [
        (1, "q0"),
        (1, "q0"),
        (2, "q1"),
        (2, "q1"),
    ]


class _BasePPOExp:
    """skyrl.train.entrypoints.main_base.BasePPOExp as far as a subclass sees it: `run` builds
    the trainer with `get_trainer` (keyword arguments, as `_setup_trainer` passes them) and runs
    `asyncio.run(trainer.train())`. Its trainer is the tests' RayPPOTrainer on SkyRL's code, with
    two batches of two prompts; the real class needs Ray workers and inference engines."""

    trainer_class: type[Trainer] = Trainer

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def get_trainer(self, **kwargs: Any) -> Trainer:
        trainer = self.trainer_class(kwargs["cfg"], kwargs["tokenizer"], kwargs["generator"])
        trainer.batches = [dataset_rows(list("ab")), dataset_rows(list("cd"), 2)]
        return trainer

    def run(self) -> None:
        tokenizer = toy_tokenizer()
        generator = ToyGenerator(tokenizer, lambda q, k: float(k))
        trainer = self.get_trainer(cfg=self.cfg, tokenizer=tokenizer, generator=generator)
        asyncio.run(trainer.train())


class _FullyAsyncPPOExp(_BasePPOExp):
    trainer_class = AsyncTrainer


@contextlib.contextmanager
def doc_snippet(request: pytest.FixtureRequest) -> Iterator[tuple[dict[str, Any], Callable[..., None]]]:
    """What docs/frameworks/skyrl.md's lines find: in the `skyrl_entrypoint` Ray task, its config
    and SkyRL's experiment classes (as above: `run` builds the trainer with `get_trainer` and
    trains it), and a step's generator input and output."""
    from trackio.sqlite_storage import SQLiteStorage

    tokenizer = toy_tokenizer()
    gi, uids = prepare_generator_input(dataset_rows(["q0", "q1"]), 2, {}, "gsm8k", "train", 1)  # type: ignore[arg-type]
    go = asyncio.run(ToyGenerator(tokenizer, lambda q, k: float(k)).generate(gi))
    project = f"skyrl-{uuid.uuid4().hex[:8]}"
    cfg = config(2, 2)
    cfg.trainer.project_name = project
    names = {
        "BasePPOExp": _BasePPOExp,
        "FullyAsyncPPOExp": _FullyAsyncPPOExp,
        "cfg": cfg,
        "generator_input": gi,
        "generator_output": go,
        "tokenizer": tokenizer,
        "uids": uids,
    }

    def check(namespace: dict[str, Any]) -> None:
        # Each of the two experiments trained two steps of 4 rows, through the trainer it built.
        traces = SQLiteStorage.get_traces(project, run="skyrl-run")
        assert sorted(t["step"] for t in traces) == [1] * 8 + [2] * 8
        assert all(t["metadata"]["trajectory_id"] for t in traces)
        assert isinstance(namespace["exp"], _FullyAsyncPPOExp)
        assert [question_of(s) for s in namespace["samples"]] == ["q0", "q0", "q1", "q1"]

    yield names, check
