from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

import asynctrace as at
from asynctrace.adapters import skyrl_adapter
from tests._util import read_traces
from tests.rollouts._helpers import encode

# Mirrors of SkyRL's own types (skyrl_train/generators/base.py), same field names.


@dataclass
class TrajectoryID:
    instance_id: str
    repetition_id: int


@dataclass
class BatchMetadata:
    global_step: int
    training_phase: str


@dataclass
class GeneratedOutputGroup:
    generator_input: dict[str, Any]
    generator_output: dict[str, Any]
    uid: str
    global_step_when_scheduled: int


@dataclass
class AsyncGroup:
    """SkyRL's GeneratedOutputGroup (skyrl/train/fully_async_trainer.py), field for field."""

    generator_output: dict[str, Any]
    uid: str
    global_step_when_scheduled: int
    group_completion_time_s: float | None = None
    prompts: list[Any] | None = None


@dataclass
class LegacyAsyncGroup:
    """GeneratedOutputGroup of older skyrl-train releases, which kept no prompts."""

    generator_output: dict[str, Any]
    uid: str
    global_step_when_scheduled: int


SYSTEM = {"role": "system", "content": "You are a careful solver."}


def chat(question: str) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": question}]


def generator_input(questions: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "prompts": [chat(q) for q in questions],
        "env_classes": ["gsm8k"] * len(questions),
        "env_extras": None,
        "sampling_params": None,
        "trajectory_ids": extra.pop("trajectory_ids", None),
        "batch_metadata": extra.pop("batch_metadata", None),
    }


def response(tokenizer: Any, turns: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
    return encode(tokenizer, turns)


def generator_output(
    tokenizer: Any, questions: list[str], answers: list[list[tuple[str, str]]], **columns: Any
) -> dict[str, Any]:
    encoded = [response(tokenizer, turns) for turns in answers]
    return {
        "prompt_token_ids": [encode(tokenizer, [("user", q)])[0] for q in questions],
        "response_ids": [ids for ids, _ in encoded],
        "rewards": columns.pop("rewards", [1.0] * len(answers)),
        "loss_masks": [mask for _, mask in encoded],
        "stop_reasons": columns.pop("stop_reasons", ["stop"] * len(answers)),
        "rollout_metrics": None,
        "rollout_logprobs": None,
        "trajectory_ids": columns.pop("trajectory_ids", None),
        "is_last_step": columns.pop("is_last_step", None),
        **columns,
    }


def test_several_samples_per_prompt_use_the_blocked_layout(tokenizer: Any) -> None:
    """Without trajectory ids, samples map to prompts in blocks and keep the chat prompt as is."""
    questions = ["What is 2 + 2?", "Name a prime."]
    answers = [[("assistant", f"answer {i}")] for i in range(4)]
    gi = generator_input(questions)
    go = generator_output(tokenizer, [questions[i // 2] for i in range(4)], answers, rewards=[1, 0, 0.5, 1])
    samples = skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)
    assert [s.metadata["prompt_index"] for s in samples] == [0, 0, 1, 1]
    assert samples[2].messages == [*chat(questions[1]), {"role": "assistant", "content": "answer 2"}]
    assert [s.metadata["reward"] for s in samples] == [1.0, 0.0, 0.5, 1.0]
    assert {s.metadata["stop_reason"] for s in samples} == {"stop"}
    assert {s.metadata["env_class"] for s in samples} == {"gsm8k"}
    assert [s.metadata["sample_index"] for s in samples] == [0, 1, 2, 3]


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


def test_trajectory_ids_map_samples_to_prompts(tokenizer: Any) -> None:
    """Trajectory ids on both sides pick the prompt, whatever the output order."""
    questions = ["first question", "second question"]
    in_ids = [TrajectoryID("q1", 0), TrajectoryID("q1", 1), TrajectoryID("q2", 0), TrajectoryID("q2", 1)]
    out_ids = [in_ids[3], in_ids[0], in_ids[2], in_ids[1]]
    gi = generator_input([questions[0], questions[0], questions[1], questions[1]], trajectory_ids=in_ids)
    go = generator_output(
        tokenizer,
        [questions[1], questions[0], questions[1], questions[0]],
        [[("assistant", f"reply {i}")] for i in range(4)],
        trajectory_ids=out_ids,
    )
    samples = skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)
    assert [s.metadata["prompt_index"] for s in samples] == [3, 0, 2, 1]
    assert [s.metadata["trajectory_id"] for s in samples] == ["q2:1", "q1:0", "q2:0", "q1:1"]
    assert [s.messages[1]["content"] for s in samples] == [
        questions[1],
        questions[0],
        questions[1],
        questions[0],
    ]


def test_batch_metadata_gives_step_and_split() -> None:
    """training_phase "eval" logs to the eval split; without batch_metadata the default step is used."""
    train = generator_input(["q"], batch_metadata=BatchMetadata(global_step=7, training_phase="train"))
    evaluation = generator_input(["q"], batch_metadata={"global_step": 9, "training_phase": "eval"})
    assert skyrl_adapter.step_and_split(train) == (7, "train")
    assert skyrl_adapter.step_and_split(evaluation) == (9, "eval")
    assert skyrl_adapter.step_and_split(generator_input(["q"]), default_step=3) == (3, "train")


def step_wise_rows(
    tokenizer: Any, question: str, steps: list[tuple[str, str]]
) -> tuple[list[list[int]], ...]:
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


def test_step_wise_rows_merge_into_one_sample_per_trajectory(tokenizer: Any) -> None:
    """Step-wise rows of a trajectory become one multi-turn sample with the chat prompt."""
    steps = [("Let me look.", "result: 42"), ("It is 42.", "")]
    obs_a, act_a = step_wise_rows(tokenizer, "question a", steps)
    obs_b, act_b = step_wise_rows(tokenizer, "question b", steps[:1])
    gi = generator_input(["question a", "question b"])
    go = {
        "prompt_token_ids": [obs_a[0], obs_b[0], obs_a[1]],
        "response_ids": [act_a[0], act_b[0], act_a[1]],
        "rewards": [0.0, 0.5, 1.0],
        "loss_masks": [[1] * len(a) for a in (act_a[0], act_b[0], act_a[1])],
        "stop_reasons": ["tool", "stop", "stop"],
        "trajectory_ids": [TrajectoryID("a", 0), TrajectoryID("b", 0), TrajectoryID("a", 0)],
        "is_last_step": [False, True, True],
    }
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
    assert first.metadata["trajectory_id"] == "a:0"
    assert first.metadata["prompt_index"] == 0
    assert second.messages == [*chat("question b"), {"role": "assistant", "content": "Let me look."}]
    assert second.metadata["prompt_index"] == 1


def test_step_wise_without_ids_groups_rows_by_last_step(tokenizer: Any) -> None:
    """Without trajectory ids, consecutive rows up to a last step are one trajectory, mapped in blocks."""
    steps = [("Let me look.", "result: 42"), ("It is 42.", "")]
    obs_a, act_a = step_wise_rows(tokenizer, "question a", steps)
    obs_b, act_b = step_wise_rows(tokenizer, "question b", steps)
    go = {
        "prompt_token_ids": [*obs_a, *obs_b],
        "response_ids": [*act_a, *act_b],
        "rewards": [0.0, 1.0, 0.0, 0.0],
        "loss_masks": [[1] * len(a) for a in (*act_a, *act_b)],
        "stop_reasons": None,
        "trajectory_ids": None,
        "is_last_step": [False, True, False, True],
    }
    first, second = skyrl_adapter.to_samples(
        generator_input(["question a", "question b"]), go, tokenizer=tokenizer
    )
    assert [first.metadata["prompt_index"], second.metadata["prompt_index"]] == [0, 1]
    assert second.messages[1] == {"role": "user", "content": "question b"}
    assert [m["role"] for m in second.messages[2:]] == ["assistant", "tool", "assistant"]
    assert [first.metadata["reward"], second.metadata["reward"]] == [1.0, 0.0]


def test_step_wise_prefix_mismatch_starts_a_sample_from_the_observation(tokenizer: Any) -> None:
    """After a rewritten context, the new sample's prompt is the decoded observation."""
    summary = encode(tokenizer, [("user", "summary so far")])[0]
    act = encode(tokenizer, [("assistant", "continue")])[0]
    first_obs = encode(tokenizer, [("user", "question")])[0]
    go = {
        "prompt_token_ids": [first_obs, summary],
        "response_ids": [act, act],
        "rewards": [0.0, 1.0],
        "loss_masks": [[1] * len(act)] * 2,
        "stop_reasons": None,
        "trajectory_ids": [TrajectoryID("a", 0)] * 2,
        "is_last_step": [False, True],
    }
    first, second = skyrl_adapter.to_samples(generator_input(["question"]), go, tokenizer=tokenizer)
    assert first.messages[:2] == chat("question")
    assert second.messages == [
        {"role": "user", "content": "summary so far"},
        {"role": "assistant", "content": "continue"},
    ]
    assert second.metadata["prompt_index"] == 0


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
    go = generator_output(tokenizer, ["q1", "q2"], [[("assistant", "x")]] * 2)
    go["loss_masks"][0] = go["loss_masks"][0] + [1]
    with pytest.raises(ValueError, match="loss_masks: row 0"):
        skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)
    go["prompt_token_ids"] = go["prompt_token_ids"][:1]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)


def groups_of_a_step(tokenizer: Any) -> list[Any]:
    """Three generation groups (one prompt, two samples each), as the fully async trainer holds them."""
    groups: list[Any] = []
    for g in range(3):
        question = f"question {g}"
        gi = generator_input([question])
        go = generator_output(
            tokenizer,
            [question] * 2,
            [[("assistant", f"group {g} sample {k}")] for k in range(2)],
            rewards=[float(g), float(g) + 0.5],
        )
        groups.append(
            (gi, go)
            if g == 0
            else GeneratedOutputGroup(gi, go, uid=f"uid-{g}", global_step_when_scheduled=10 + g)
        )
    return groups


def test_fully_async_groups_become_one_training_step(tokenizer: Any) -> None:
    """Several generation groups give one list of samples with indices running across the step."""
    samples = skyrl_adapter.to_step_samples(groups_of_a_step(tokenizer), tokenizer=tokenizer)
    assert [s.metadata["sample_index"] for s in samples] == list(range(6))
    assert [s.metadata["prompt_index"] for s in samples] == [0, 0, 1, 1, 2, 2]
    assert [s.metadata["group_index"] for s in samples] == [0, 0, 1, 1, 2, 2]
    assert [s.metadata.get("policy_version") for s in samples] == [None, None, 11, 11, 12, 12]
    assert samples[3].metadata["group_uid"] == "uid-1"
    assert samples[5].messages[-1] == {"role": "assistant", "content": "group 2 sample 1"}


@pytest.mark.anyio
async def test_end_to_end_cap_holds_per_training_step(tokenizer: Any, project: str) -> None:
    """Logged once per training step, the cap keeps 3 of the 6 samples of three groups in Trackio."""
    samples = skyrl_adapter.to_step_samples(groups_of_a_step(tokenizer), tokenizer=tokenizer)
    step, split = skyrl_adapter.step_and_split(
        generator_input(["q"], batch_metadata=BatchMetadata(global_step=4, training_phase="train"))
    )
    assert step is not None
    async with at.TraceSession(project, run="r", max_traces_per_step=3, sampler="first") as session:
        await session.log_samples(samples, step=step, split=split)
    traces = read_traces(project, "r")
    assert len(traces) == 3
    assert {t["step"] for t in traces} == {4}
    assert traces[0]["messages"][-1]["content"] == "group 0 sample 0"


def test_overlong_filtered_response_is_one_assistant_turn(tokenizer: Any) -> None:
    """A response whose loss mask overlong filtering zeroed is an assistant turn marked loss_masked."""
    gi = generator_input(["Count to a million."] * 2)
    go = generator_output(
        tokenizer,
        ["Count to a million."] * 2,
        [[("assistant", "1, 2, 3, 4")]] * 2,
        stop_reasons=["stop", "length"],
    )
    go["loss_masks"][1] = [0] * len(go["loss_masks"][1])
    kept, truncated = skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)
    assert truncated.messages == [
        *chat("Count to a million."),
        {"role": "assistant", "content": "1, 2, 3, 4"},
    ]
    assert truncated.metadata["num_turns"] == 1
    assert truncated.metadata["loss_masked"] is True
    assert "loss_masked" not in kept.metadata


def test_overlong_filtered_step_stays_an_assistant_turn(tokenizer: Any) -> None:
    """A truncated step-wise row masked out entirely is still an assistant turn after the merge."""
    obs, act = step_wise_rows(tokenizer, "question", [("Let me look.", "result: 42"), ("It is", "")])
    go = {
        "prompt_token_ids": obs,
        "response_ids": act,
        "rewards": [0.0, 0.0],
        "loss_masks": [[1] * len(act[0]), [0] * len(act[1])],
        "stop_reasons": ["stop", "length"],
        "trajectory_ids": [TrajectoryID("a", 0)] * 2,
        "is_last_step": [False, True],
    }
    (sample,) = skyrl_adapter.to_samples(generator_input(["question"]), go, tokenizer=tokenizer)
    assert sample.messages[2:] == [
        {"role": "assistant", "content": "Let me look."},
        {"role": "tool", "content": "result: 42"},
        {"role": "assistant", "content": "It is"},
    ]
    assert sample.metadata["num_turns"] == 2
    assert sample.metadata["loss_masked"] is True


def test_fully_async_groups_with_skyrl_field_list(tokenizer: Any) -> None:
    """Groups with SkyRL's real fields (prompts, no generator_input) and legacy ones both convert."""
    question = "What is 2 + 2?"
    go = generator_output(tokenizer, [question] * 2, [[("assistant", "4")], [("assistant", "5")]])
    groups = [
        AsyncGroup(
            go,
            uid="17",
            global_step_when_scheduled=3,
            group_completion_time_s=1.5,
            prompts=[chat(question)] * 2,
        ),
        LegacyAsyncGroup(go, uid="18", global_step_when_scheduled=4),
    ]
    samples = skyrl_adapter.to_step_samples(groups, tokenizer=tokenizer)
    assert [s.messages for s in samples[:2]] == [
        [*chat(question), {"role": "assistant", "content": "4"}],
        [*chat(question), {"role": "assistant", "content": "5"}],
    ]
    assert samples[2].messages == [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "4"},
    ]
    assert [s.metadata["trajectory_id"] for s in samples] == ["17:0", "17:1", "18:0", "18:1"]
    assert [s.metadata["group_uid"] for s in samples] == ["17", "17", "18", "18"]
    assert [s.metadata["policy_version"] for s in samples] == [3, 3, 4, 4]
    assert [s.metadata["prompt_index"] for s in samples] == [0, 1, 2, 3]


def test_fully_async_step_wise_group_maps_trajectories_to_prompts(tokenizer: Any) -> None:
    """A step-wise group with one prompt per trajectory merges each trajectory under its prompt."""
    steps = [("Let me look.", "result: 42"), ("It is 42.", "")]
    obs, act = step_wise_rows(tokenizer, "question", steps)
    go = {
        "prompt_token_ids": [obs[0], obs[0], obs[1]],
        "response_ids": [act[0], act[0], act[1]],
        "rewards": [0.0, 0.0, 1.0],
        "loss_masks": [[1] * len(a) for a in (act[0], act[0], act[1])],
        "stop_reasons": ["stop"] * 3,
        "trajectory_ids": [TrajectoryID("7", 0), TrajectoryID("7", 1), TrajectoryID("7", 0)],
        "is_last_step": [False, True, True],
    }
    group = AsyncGroup(go, uid="7", global_step_when_scheduled=2, prompts=[chat("question")] * 2)
    first, second = skyrl_adapter.to_step_samples([group], tokenizer=tokenizer)
    assert [m["role"] for m in first.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert second.messages == [*chat("question"), {"role": "assistant", "content": "Let me look."}]
    assert [first.metadata["trajectory_id"], second.metadata["trajectory_id"]] == ["7:0", "7:1"]
    assert [first.metadata["prompt_index"], second.metadata["prompt_index"]] == [0, 1]


def test_input_trajectory_ids_name_non_step_wise_samples(tokenizer: Any) -> None:
    """Without ids on the output, the input's per-row ids give trajectory_id and group_uid."""
    questions = ["question q17", "question q17", "question q42", "question q42"]
    in_ids = [TrajectoryID("q17", 0), TrajectoryID("q17", 1), TrajectoryID("q42", 0), TrajectoryID("q42", 1)]
    gi = generator_input(questions, trajectory_ids=in_ids)
    go = generator_output(tokenizer, questions, [[("assistant", f"answer {i}")] for i in range(4)])
    samples = skyrl_adapter.to_samples(gi, go, tokenizer=tokenizer)
    assert [s.metadata["trajectory_id"] for s in samples] == ["q17:0", "q17:1", "q42:0", "q42:1"]
    assert [s.metadata["group_uid"] for s in samples] == ["q17", "q17", "q42", "q42"]
    assert [s.metadata["prompt_index"] for s in samples] == [0, 1, 2, 3]


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
    go = {
        "prompt_token_ids": [prompt, prompt + first_ids],
        "response_ids": [first_ids, last_ids],
        "rewards": [0.0, 1.0],
        "loss_masks": [first_mask, last_mask],
        "stop_reasons": ["stop", "stop"],
        "trajectory_ids": [TrajectoryID("a", 0)] * 2,
        "is_last_step": [False, True],
    }
    (sample,) = skyrl_adapter.to_samples(generator_input(["question"]), go, tokenizer=tokenizer)
    assert sample.messages[2:] == [
        {"role": "assistant", "content": "Let me look."},
        {"role": "tool", "content": "result: 42"},
        {"role": "assistant", "content": "It is 42."},
        {"role": "tool", "content": "Correct!"},
    ]
