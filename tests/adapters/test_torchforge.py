"""torchforge's GRPO episodes, built by torchforge's own code, to samples.

torchforge's package-index release is a placeholder: its definitions are run from its source at
a pinned commit (tests/adapters/_upstream/torchforge_*.py). Completions come from the
generator's `_to_completions`, episodes, rewards and advantages from the GRPO app's rollout loop.
vLLM (the generator's engine) is not installed: its `RequestOutput` is given as a namespace with
the fields `_to_completions` reads.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import asynctrace as at
from asynctrace.adapters import torchforge_adapter
from asynctrace.adapters._sessions import session_for
from asynctrace.rollouts import toy_tokenizer
from tests._util import read_traces
from tests.adapters._upstream import torchforge_generator as generator
from tests.adapters._upstream.torchforge_completion import Completion
from tests.adapters._upstream.torchforge_grpo_main import Episode, RewardActor, rollout_group
from tests.adapters._upstream.torchforge_grpo_main_2025_10 import Group as OldGroup
from tests.adapters._upstream.torchforge_prompt import Message, Prompt, Role
from tests.adapters._upstream.torchforge_rewards import MathReward, ThinkingReward
from tests.adapters.conftest import moved
from tests.rollouts._helpers import encode

# The GRPO app's DatasetActor formats the request with the chat template before generation.
REQUEST = (
    "<|im_start|>system\nPut your answer in <answer></answer>.<|im_end|>\n<|im_start|>user\nWhat is 3 + 4?"
)
TARGET = "7"
ANSWERS = ["<think>3 + 4</think><answer>7</answer>", "<answer>8</answer>", "It is 7."]
VERSION = 5


def completions(tokenizer: Any, answers: list[str] = ANSWERS, request: str = REQUEST) -> list[Completion]:
    """What Generator.generate returns: `_to_completions` of vLLM's output for the request."""
    outputs = [
        SimpleNamespace(
            finish_reason="stop" if k else "length",
            text=answer,
            token_ids=encode(tokenizer, [("assistant", answer)])[0],
            logprobs=None,
        )
        for k, answer in enumerate(answers)
    ]
    request_output = SimpleNamespace(
        prompt=request,
        prompt_token_ids=encode(tokenizer, [("user", request)])[0],
        outputs=outputs,
        num_cached_tokens=3,
    )
    gen = SimpleNamespace(generator_version=VERSION)
    gen._extract_logprobs = lambda sample: generator._extract_logprobs(gen, sample)
    return generator._to_completions(gen, request_output)


def episodes(tokenizer: Any) -> list[Episode]:
    """One GRPO group as continuous_rollouts builds it: episodes, rewards, advantages."""
    responses = completions(tokenizer)
    return rollout_group(
        responses,
        prompt=REQUEST,
        target=TARGET,
        pad_id=0,
        group_size=len(responses),
        max_req_tokens=64,
        max_res_tokens=64,
        reward_actor=RewardActor(reward_functions=[MathReward(), ThinkingReward()]),
    )


def test_generator_prompts_give_their_text(tokenizer: Any) -> None:
    """The Completion's Prompt of Message(chunks, role) becomes the user message with its text."""
    samples = torchforge_adapter.to_samples(episodes(tokenizer))
    assert samples[0].messages == [
        {"role": "user", "content": REQUEST},
        {"role": "assistant", "content": ANSWERS[0]},
    ]
    assert all(s.messages[0]["content"] == REQUEST for s in samples)


def test_system_instructions_and_chunks(tokenizer: Any) -> None:
    """Prompt.from_prompt's system message keeps its role; a message's chunks are joined."""
    (completion, *_) = completions(tokenizer)
    completion.prompt = Prompt.from_prompt("What is 3 + 4?", system_instruction="Be brief.")
    completion.prompt.messages.append(Message(chunks=["Answer ", "in digits."], role=Role.USER))
    episode = Episode(episode_id="e", pad_id=0, request_len=64, response_len=64, completion=completion)
    (sample,) = torchforge_adapter.to_samples(episode)
    assert sample.messages[:3] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "user", "content": "Answer in digits."},
    ]


def test_metadata_is_what_the_rollout_loop_computed(tokenizer: Any) -> None:
    """Reward, advantage, policy version and lengths are the episode's and its completion's."""
    group = episodes(tokenizer)
    samples = torchforge_adapter.to_samples(group)
    for sample, episode in zip(samples, group, strict=True):
        meta = sample.metadata
        assert episode.completion is not None
        assert meta["episode_id"] == episode.episode_id and meta["target"] == TARGET
        assert meta["reward"] == episode.reward and meta["advantage"] == episode.advantage
        assert meta["policy_version"] == episode.policy_version == VERSION
        assert meta["prompt_len"] == len(episode.completion.prompt_ids) < 64
        assert meta["response_len"] == len(episode.completion.token_ids) < 64
        assert meta["max_request_len"] == meta["max_response_len"] == 64
        assert meta["completion_metadata"] == {"num_cached_tokens": 3}
    # MathReward and ThinkingReward averaged, as RewardActor.evaluate_response does.
    assert [s.metadata["reward"] for s in samples] == [1.0, 0.0, 0.05]
    assert [s.metadata["stop_reason"] for s in samples] == ["length", "stop", "stop"]


def test_older_episodes_fall_back_to_request_and_tokens(tokenizer: Any) -> None:
    """Episodes of the earlier GRPO app (request text, token lists, no completion) still convert."""
    group = OldGroup.new_group(
        group_id=0, group_size=2, request=REQUEST, policy_version=4, pad_id=0, request_len=64, response_len=64
    )
    # What that app's continuous_rollouts set from each Completion.
    for episode, response in zip(group.episodes, completions(tokenizer, ANSWERS[:2]), strict=True):
        episode.request_tokens = response.prompt_ids
        episode.response_tokens = response.token_ids
        episode.response = response.text
    samples = torchforge_adapter.to_samples(group.episodes)
    assert samples[1].messages == [
        {"role": "user", "content": REQUEST},
        {"role": "assistant", "content": ANSWERS[1]},
    ]
    assert samples[1].metadata["policy_version"] == 4
    tokens = group.episodes[1].request_tokens
    assert tokens is not None and samples[1].metadata["prompt_len"] == len(tokens)
    # Before the response is set, the tokens are decoded.
    group.episodes[0].response = None
    decoded = torchforge_adapter.to_samples(group.episodes, tokenizer=tokenizer)
    assert decoded[0].messages[-1] == {"role": "assistant", "content": ANSWERS[0]}


def test_a_prompt_without_text_is_decoded_from_its_ids(tokenizer: Any) -> None:
    """A Prompt with no messages falls back to the completion's prompt_ids, decoded."""
    (completion, *_) = completions(tokenizer)
    completion.prompt = Prompt(messages=[])
    episode = Episode(episode_id="e", pad_id=0, request_len=64, response_len=64, completion=completion)
    (sample,) = torchforge_adapter.to_samples([episode], tokenizer=tokenizer)
    assert sample.messages[0] == {"role": "user", "content": REQUEST}


def test_groups_or_other_objects_are_refused_not_logged_empty(tokenizer: Any) -> None:
    """A list of GRPO groups is refused naming the entry, not turned into blank samples."""
    group = episodes(tokenizer)
    with pytest.raises(ValueError, match=r"episodes\[0\]: expected an Episode"):
        torchforge_adapter.to_samples([group, group])
    with pytest.raises(ValueError, match="episodes: expected an Episode"):
        torchforge_adapter.to_samples(None)


def test_log_group_logs_at_the_policy_version_and_never_raises(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The hook logs a group at its policy version with group ids; what it cannot convert is counted."""
    group = episodes(tokenizer)
    caplog.set_level(logging.WARNING, logger="asynctrace")
    sink = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[sink]) as session:
        assert torchforge_adapter.log_group(session, group) == 3
        assert torchforge_adapter.log_group(session, [group, group]) == 0
        assert torchforge_adapter.log_group(session, None) == 0
    stats = session.stats()
    assert stats.written == 3 and stats.dropped["invalid"] == 3 and stats.check()
    assert {record.step for record in sink.records} == {VERSION}
    metas = [s.metadata for s in sink.samples]
    assert {m["group_uid"] for m in metas} == {group[0].episode_id}
    assert sorted(m["sample_index"] for m in metas) == [0, 1, 2]
    assert any("torchforge_adapter.log_group" in r.getMessage() for r in caplog.records)


def test_a_moved_hook_point_is_named_and_its_groups_counted(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch, hook_warnings: list[str]
) -> None:
    """Episodes whose torchforge renamed `advantage`: the hook says so once, naming the commit
    tested and the field, counts every episode of the group and returns; nothing raises into
    the rollout loop."""
    group = episodes(tokenizer)
    monkeypatch.delattr(Episode, "advantage")
    for episode in group:
        episode.advantages = vars(episode).pop("advantage")
    with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as session:
        for _ in range(2):
            assert torchforge_adapter.log_group(session, group) == 0
    moved(hook_warnings, "torchforge_adapter.log_group", "commit 6e77f0b37596", "Episode.advantage")
    stats = session.stats()
    assert stats.dropped["invalid"] == 2 * len(group) and stats.written == 0 and stats.check()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # torchforge's loops run on asyncio
async def test_end_to_end_into_trackio(tokenizer: Any, project: str) -> None:
    """Groups logged from the async rollout loop reach the sinks; a project name opens a session."""
    group = episodes(tokenizer)
    sink = at.testing.MemorySink()
    async with at.TraceSession(project, sinks=[sink]) as session:
        assert torchforge_adapter.log_group(session, group) == 3  # queued without waiting
    assert sorted(s.metadata["reward"] for s in sink.samples) == [0.0, 0.05, 1.0]
    # Given a project name, the hook opens the process's session itself (and reuses it).
    assert torchforge_adapter.log_group(project, group) == torchforge_adapter.log_group(project, group) == 3
    opened = session_for(project, on_full="drop_newest", where="test")
    assert isinstance(opened, at.SyncTraceSession)
    assert opened.finish().written == 6
    traces = read_traces(project, opened.run)
    assert len(traces) == 6 and {t["step"] for t in traces} == {VERSION}
    assert all(t["messages"][0] == {"role": "user", "content": REQUEST} for t in traces)


@contextlib.contextmanager
def doc_snippet(request: pytest.FixtureRequest) -> Iterator[tuple[dict[str, Any], Callable[..., None]]]:
    """What docs/frameworks/torchforge.md's lines find in `continuous_rollouts`: a scored group
    of episodes, its advantages (not yet set) and the replay buffer actor."""
    group = episodes(toy_tokenizer())
    advantages = [episode.advantage for episode in group]
    for episode in group:
        episode.advantage = None
    buffered: list[Any] = []

    async def call_one(episode: Any) -> None:
        buffered.append(episode)

    replay_buffer = SimpleNamespace(add=SimpleNamespace(call_one=call_one))

    def check(namespace: dict[str, Any]) -> None:
        assert buffered == group
        opened = session_for("my-project", on_full="drop_newest", where="test")
        assert isinstance(opened, at.SyncTraceSession) and opened.flush(timeout=60)
        traces = read_traces("my-project", opened.run)
        assert sorted(t["metadata"]["advantage"] for t in traces[-3:]) == sorted(advantages)

    yield {"episodes": group, "advantages": advantages, "replay_buffer": replay_buffer}, check
