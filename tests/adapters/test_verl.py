"""verl 0.9.1: DataProto batches built and transformed by verl's own code, mapped row by row.

The batches go through what `RayPPOTrainer.fit` (verl/trainer/ppo/ray_trainer.py) does
before the logging point: the prompt batch gets its `uid`s and is repeated, the generation
output is unioned into it, `_balance_batch` reorders the rows, `extract_reward` gives the
token-level scores, `apply_kl_penalty` the rewards, `compute_advantage` the GRPO advantages.
The generation output is laid out as verl's agent loop `_postprocess` lays it out
(verl/experimental/agent_loop/agent_loop.py): left-padded `prompts`, right-padded
`responses`, `response_mask` 0 on tool output, the score on the last response token.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
import pytest
import torch

import asynctrace as at
from asynctrace.adapters import verl_adapter
from asynctrace.rollouts import toy_tokenizer
from asynctrace.rollouts._toy import encode_turns
from tests._util import LazyModule
from tests.adapters.conftest import moved
from tests.rollouts._helpers import check_text_ends, pad

if TYPE_CHECKING:
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

# verl's import takes seconds: it runs in the first test that uses it, not in
# every worker's collection.
verl = LazyModule("verl")
core_algos = LazyModule("verl.trainer.ppo.core_algos")
ray_trainer = LazyModule("verl.trainer.ppo.ray_trainer")
reward = LazyModule("verl.trainer.ppo.reward")

Turn = tuple[str, str]

PROMPTS = [
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nSay hello in two languages.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nName a prime above 90.<|im_end|>\n<|im_start|>assistant\n",
]
# Three rollouts per prompt; some call a tool, whose output the agent loop masks with 0.
RESPONSES: list[list[list[Turn]]] = [
    [
        [
            ("assistant", '<tool_call>{"name": "python", "code": "print(17 * 23)"}</tool_call><|im_end|>'),
            ("tool", "\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n"),
            ("assistant", "The answer is 391.<|im_end|>"),
        ],
        [("assistant", "It is 391.<|im_end|>")],
        [("assistant", "17 * 23 = 381, I think.<|im_end|>")],
    ],
    [
        [("assistant", "Hello! 你好 🙂<|im_end|>")],
        [("assistant", "Bonjour, hola.<|im_end|>")],
        [
            ("assistant", "Let me look it up.<|im_end|>"),
            ("tool", "\n<|im_start|>tool\nError: no network.<|im_end|>\n<|im_start|>assistant\n"),
            ("assistant", "Hello and hallo.<|im_end|>"),
        ],
    ],
    [
        [("assistant", "97<|im_end|>")],
        [("assistant", "91 is prime.<|im_end|>")],
        [("assistant", "")],
    ],
]
SCORES = [[1.0, 1.0, 0.0], [1.0, 0.5, 0.0], [1.0, 0.0, 0.0]]
N = 3


def _gen_output(tokenizer: Any, *, validate: bool = False) -> tuple[DataProto, list[dict[str, Any]]]:
    """The agent loop's output for the repeated prompts, rows interleaved as verl repeats them."""
    pad_id = tokenizer.token_to_id("<pad>")
    prompts, responses, masks, expected = [], [], [], []
    for p, prompt in enumerate(PROMPTS):
        prompt_ids = tokenizer.encode(prompt).ids
        for k, turns in enumerate(RESPONSES[p]):
            ids, mask = encode_turns(tokenizer, turns)
            prompts.append(prompt_ids)
            responses.append(ids)
            masks.append(mask)
            messages = [{"role": "user", "content": prompt}]
            messages += [{"role": role, "content": text} for role, text in turns]
            expected.append(
                {
                    "messages": messages,
                    "score": SCORES[p][k],
                    "request_id": f"req-{p}-{k}",
                    "prompt": p,
                    "turns": sum(role == "assistant" for role, _ in turns),
                    "verl_turns": 2 * sum(role == "assistant" for role, _ in turns),
                }
            )
    p_width = max(len(x) for x in prompts) + 2
    r_width = max(len(x) for x in responses) + 3
    prompt_t = pad(prompts, p_width, "left", fill=pad_id)
    response_t = pad(responses, r_width, "right", fill=pad_id)
    prompt_attention = pad([[1] * len(x) for x in prompts], p_width, "left")
    attention = torch.cat([prompt_attention, pad([[1] * len(x) for x in responses], r_width)], dim=1)
    response_mask = pad(masks, r_width)
    # As verl's agent loop puts the reward-loop score on the last response token.
    response_length = attention[:, p_width:].sum(dim=1) - 1
    rm_scores = torch.zeros_like(response_mask, dtype=torch.float32)
    flat_scores = torch.tensor([e["score"] for e in expected])
    rm_scores[torch.arange(len(expected)), response_length.clamp(min=0)] = flat_scores
    n = len(expected)
    versions_min = np.empty(n, dtype=object)
    versions_max = np.empty(n, dtype=object)
    # A rollout resumed across a weight update spans two versions; a server that has not been
    # given a version yet reports None.
    versions_min[:] = [None if validate else 4 for _ in range(n)]
    versions_max[:] = [None if validate else (5 if i == 1 else 4) for i in range(n)]
    tensors = {
        "prompts": prompt_t,
        "responses": response_t,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompt_t, response_t], dim=1),
        "attention_mask": attention,
        "rollout_log_probs": -torch.rand(n, r_width) * response_mask,
        "rm_scores": rm_scores,
    }
    non_tensors = {
        "__num_turns__": np.array([e["verl_turns"] for e in expected], dtype=np.int32),
        "min_global_steps": versions_min,
        "max_global_steps": versions_max,
        "request_id": np.array([e["request_id"] for e in expected], dtype=object),
    }
    return verl.DataProto.from_dict(tensors=tensors, non_tensors=non_tensors), expected


def _prompt_batch(uids: Sequence[str]) -> DataProto:
    """The dataloader's batch with the uids `fit` gives each prompt before repeating it."""
    return verl.DataProto.from_single_dict(
        {
            "index": torch.arange(len(uids)),
            "data_source": np.array(["openai/gsm8k", "greetings", "primes"], dtype=object),
            "uid": np.array(list(uids), dtype=object),
        }
    )


def _balance(batch: DataProto) -> None:
    """verl's own `RayPPOTrainer._balance_batch`, on a trainer whose actor has 3 DP ranks."""
    trainer = SimpleNamespace(_get_dp_size=lambda worker_group, role: 3, actor_rollout_wg=None)
    ray_trainer.RayPPOTrainer._balance_batch(trainer, batch, metrics={})


def _train_batch(tokenizer: Any, *, kl: float = 0.0) -> tuple[DataProto, list[dict[str, Any]], list[int]]:
    """A training batch at the logging point of `fit`, the expectations, and each row's origin."""
    uids = ["uid-a", "uid-b", "uid-c"]
    batch = _prompt_batch(uids).repeat(repeat_times=N, interleave=True)
    gen, expected = _gen_output(tokenizer)
    batch = batch.union(gen)
    # TensorDict has no `in`: verl's own check, as fit spells it.
    if "response_mask" not in batch.batch.keys():  # noqa: SIM118
        batch.batch["response_mask"] = ray_trainer.compute_response_mask(batch)
    before = list(batch.non_tensor_batch["request_id"])
    _balance(batch)
    order = [before.index(r) for r in batch.non_tensor_batch["request_id"]]
    reward_tensor, _ = reward.extract_reward(batch)
    batch.batch["token_level_scores"] = reward_tensor
    if kl:
        response = batch.batch["responses"]
        batch.batch["old_log_probs"] = -torch.full(response.shape, 0.5)
        batch.batch["ref_log_prob"] = -torch.full(response.shape, 0.25)
        batch, _ = ray_trainer.apply_kl_penalty(
            batch, kl_ctrl=core_algos.FixedKLController(kl), kl_penalty="kl"
        )
    else:
        batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    batch = ray_trainer.compute_advantage(
        batch, adv_estimator=core_algos.AdvantageEstimator.GRPO, num_repeat=N
    )
    for e in expected:
        e["uid"] = uids[e["prompt"]]
    return batch, expected, order


def _grpo(scores: Sequence[float]) -> list[float]:
    """GRPO's outcome advantage of one group, computed here from the scores."""
    t = torch.tensor(scores)
    return ((t - t.mean()) / (t.std() + 1e-6)).tolist()


def test_rows_keep_their_group_after_balance_batch(tokenizer: Any) -> None:
    """After balance_batch reorders rows, each sample keeps its messages, reward, advantage and group."""
    batch, expected, order = _train_batch(tokenizer)
    assert order != sorted(order), "balance_batch should have reordered the rows"
    samples = verl_adapter.to_samples(batch, tokenizer=tokenizer)
    assert len(samples) == len(expected)
    seen_prompts: dict[str, int] = {}
    for row, (sample, origin) in enumerate(zip(samples, order, strict=True)):
        e = expected[origin]
        meta = sample.metadata
        assert sample.messages == e["messages"]
        assert meta["request_id"] == e["request_id"]
        assert meta["reward"] == pytest.approx(e["score"])
        assert meta["sequence_reward"] == pytest.approx(e["score"])
        if e["turns"] and e["messages"][-1]["content"]:
            group = _grpo(SCORES[e["prompt"]])
            assert meta["advantage"] == pytest.approx(group[origin % N], abs=1e-5)
        assert meta["group_uid"] == e["uid"]
        assert meta["prompt_index"] == seen_prompts.setdefault(e["uid"], len(seen_prompts))
        assert meta["data_source"] == ["openai/gsm8k", "greetings", "primes"][e["prompt"]]
        assert meta["num_turns"] == e["turns"]
        assert meta["verl_num_turns"] == e["verl_turns"]
        assert meta["sample_index"] == row
        assert (meta["policy_version_min"], meta["policy_version_max"]) == ((4, 5) if origin == 1 else (4, 4))


def test_tool_output_is_its_own_turn(tokenizer: Any) -> None:
    """response_mask 0 inside a response is a tool turn between the assistant turns, named by env_role."""
    batch, _, order = _train_batch(tokenizer)
    samples = verl_adapter.to_samples(batch, tokenizer=tokenizer, env_role="observation")
    row = order.index(0)
    roles = [m["role"] for m in samples[row].messages]
    assert roles == ["user", "assistant", "observation", "assistant"]
    assert samples[row].messages[2]["content"] == RESPONSES[0][0][1][1]
    empty = samples[order.index(8)]
    assert empty.messages == [{"role": "user", "content": PROMPTS[2]}, {"role": "assistant", "content": ""}]
    assert empty.metadata["num_turns"] == 1 and "advantage" not in empty.metadata


def test_without_response_mask_the_response_is_one_turn(tokenizer: Any) -> None:
    """A batch without response_mask is read as compute_response_mask makes it: one assistant turn."""
    batch, _, order = _train_batch(tokenizer)
    batch.pop(batch_keys=["response_mask"])
    samples = verl_adapter.to_samples(batch, tokenizer=tokenizer)
    batch.batch["response_mask"] = ray_trainer.compute_response_mask(batch)
    assert [s.messages for s in verl_adapter.to_samples(batch, tokenizer=tokenizer)] == [
        s.messages for s in samples
    ]
    multi = samples[order.index(0)].messages
    assert [m["role"] for m in multi] == ["user", "assistant"]
    assert multi[1]["content"] == "".join(text for _, text in RESPONSES[0][0])


def test_reward_is_the_score_and_the_kl_penalty_is_apart(tokenizer: Any) -> None:
    """reward sums token_level_scores; a KL penalty in the reward shows only in sequence_reward."""
    batch, expected, order = _train_batch(tokenizer, kl=0.5)
    samples = verl_adapter.to_samples(batch, tokenizer=tokenizer)
    penalties = (batch.batch["token_level_scores"] - batch.batch["token_level_rewards"]).sum(-1)
    assert bool((penalties != 0).any())
    for row, (sample, origin) in enumerate(zip(samples, order, strict=True)):
        assert sample.metadata["reward"] == pytest.approx(expected[origin]["score"])
        assert sample.metadata["sequence_reward"] == pytest.approx(
            expected[origin]["score"] - float(penalties[row]), abs=1e-5
        )


def test_token_fields_round_trip_through_the_parquet_archive(tokenizer: Any, tmp_path: Any) -> None:
    """log_batch(token_fields=...) keeps each row's token ids, response mask, log-probs and advantages
    over its real tokens, and the Parquet archive gives them back bit for bit."""
    batch, _, _ = _train_batch(tokenizer)
    fields = ("token_ids", "loss_mask", "logprobs", "advantages")
    # In-process writer: the files are what is read here; tests/sinks/ test the writer process.
    sink = at.ParquetSink(tmp_path, process=False)
    with at.TraceSession("verl", run="r", sinks=[sink], max_traces_per_step=None) as session:
        trainer = _trainer(tokenizer, step=1, session=session)
        assert verl_adapter.log_batch(trainer, batch, token_fields=fields) == len(batch)
    prompts, responses = batch.batch["prompts"], batch.batch["responses"]
    width = prompts.shape[1]
    attention = batch.batch["attention_mask"].bool()
    nan_prompt = torch.full(prompts.shape, float("nan"))
    full = {
        "token_ids": (torch.cat([prompts, responses], dim=1), np.int32),
        "loss_mask": (torch.cat([torch.zeros_like(prompts), batch.batch["response_mask"]], dim=1), np.int8),
        "logprobs": (torch.cat([nan_prompt, batch.batch["rollout_log_probs"].float()], dim=1), np.float32),
        "advantages": (torch.cat([nan_prompt, batch.batch["advantages"].float()], dim=1), np.float32),
    }
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path).to_pylist()
    assert len(rows) == len(batch)
    for row in rows:
        r = orjson.loads(row["metadata"])["sample_index"]
        for name, (values, dtype) in full.items():
            want = values[r][attention[r]].numpy().astype(dtype)
            assert np.asarray(row[name], dtype=dtype).tobytes() == want.tobytes(), name
        assert np.isnan(row["logprobs"][: int(attention[r, :width].sum())]).all()
        # Without being asked: where each token's text ends in the messages, for the token page.
        check_text_ends(
            orjson.loads(row["messages"]),
            row["token_ids"],
            row["text_ends"],
            lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        )
    # to_samples gives the same values as plain lists of numbers.
    for r, sample in enumerate(verl_adapter.to_samples(batch, tokenizer=tokenizer, token_fields=fields)):
        assert sample.tokens is not None and all(isinstance(v, list) for v in sample.tokens.values())
        for name, (values, dtype) in full.items():
            want = values[r][attention[r]].numpy().astype(dtype)
            assert np.asarray(sample.tokens[name], dtype=dtype).tobytes() == want.tobytes(), name
    with pytest.raises(ValueError, match="logits"):
        verl_adapter.to_samples(batch, tokenizer=tokenizer, token_fields=("logits",))


def _trainer(tokenizer: Any, step: int, session: Any = None) -> RayPPOTrainer:
    """A RayPPOTrainer with only what the hook reads (building one for real needs Ray workers)."""
    trainer: RayPPOTrainer = object.__new__(ray_trainer.RayPPOTrainer)
    trainer.tokenizer = tokenizer
    trainer.global_steps = step
    names = SimpleNamespace(project_name="verl_gsm8k", experiment_name="qwen2.5/grpo")
    trainer.config = SimpleNamespace(trainer=names)
    if session is not None:
        trainer.asynctrace_session = session
    return trainer


def test_hook_logs_training_and_validation_splits(tokenizer: Any) -> None:
    """The hook logs fit's batch as "train" and _validate's as "eval", at the trainer's global step."""
    sink = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[sink]) as session:
        trainer = _trainer(tokenizer, step=3, session=session)
        batch, _, _ = _train_batch(tokenizer)
        assert verl_adapter.log_batch(trainer, batch) == len(batch)

        # _validate: repeat, generate, union, then extract_reward; scores are not in the batch.
        test_batch = _prompt_batch(["v-a", "v-b", "v-c"]).repeat(repeat_times=N, interleave=True)
        gen, expected = _gen_output(tokenizer, validate=True)
        test_batch = test_batch.union(gen)
        reward_tensor, _ = reward.extract_reward(test_batch)
        logged = verl_adapter.log_batch(trainer, test_batch, split="eval", token_level_scores=reward_tensor)
        assert logged == len(test_batch)
    assert {r.split for r in sink.records} == {"train", "eval"}
    assert {r.step for r in sink.records} == {3}
    evals = [r.sample for r in sink.records if r.split == "eval"]
    assert [s.metadata["reward"] for s in evals] == pytest.approx([e["score"] for e in expected])
    assert [s.messages for s in evals] == [e["messages"] for e in expected]
    assert all("policy_version_min" not in s.metadata and "advantage" not in s.metadata for s in evals)
    assert [s.metadata["group_uid"] for s in evals] == [u for u in ("v-a", "v-b", "v-c") for _ in range(N)]


def test_hook_never_raises_and_counts_the_rows(tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A batch verl_adapter cannot read is counted as invalid with one warning; training goes on."""
    caplog.set_level(logging.WARNING, logger="asynctrace")
    with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as session:
        trainer = _trainer(tokenizer, step=1, session=session)
        batch, _, _ = _train_batch(tokenizer)
        batch.pop(batch_keys=["responses"])
        for _ in range(2):
            assert verl_adapter.log_batch(trainer, batch) == 0
    stats = session.stats()
    assert stats.dropped["invalid"] == 2 * len(batch) and stats.check()
    warned = [r for r in caplog.records if "verl_adapter.log_batch" in r.getMessage()]
    assert len(warned) == 1 and "responses" in warned[0].getMessage()


def test_a_moved_hook_point_is_named_and_its_batches_counted(
    tokenizer: Any, hook_warnings: list[str]
) -> None:
    """A RayPPOTrainer whose verl renamed `global_steps`, and a DataProto without `prompts`: the
    hook says so once each, naming verl 0.9.1 and what is missing, counts every row and returns;
    nothing raises into the loop."""
    with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as session:
        trainer = _trainer(tokenizer, step=1, session=session)
        del trainer.global_steps
        trainer.global_step = 1  # type: ignore[attr-defined]
        batch, _, _ = _train_batch(tokenizer)
        for _ in range(2):
            assert verl_adapter.log_batch(trainer, batch) == 0
        moved(hook_warnings, "verl_adapter.log_batch", "verl 0.9.1", "RayPPOTrainer.global_steps")
        renamed, _, _ = _train_batch(tokenizer)
        renamed.rename(old_keys="prompts", new_keys="prompt_ids")
        assert verl_adapter.log_batch(trainer, renamed, step=1) == 0
        assert sum("batch.batch has no 'prompts'" in m for m in hook_warnings) == 1
    stats = session.stats()
    assert stats.dropped["invalid"] == 3 * len(batch) and stats.written == 0 and stats.check()


def test_first_call_opens_a_session_named_after_the_run(tokenizer: Any) -> None:
    """open_session names the session after verl's project and experiment, made plain names."""
    sink = at.testing.MemorySink()
    trainer = _trainer(tokenizer, step=2)
    session = verl_adapter.open_session(trainer, sinks=[sink], shutdown_hooks=False)
    try:
        assert trainer.asynctrace_session is session
        assert (session.project, session.run) == ("verl_gsm8k", "qwen2.5-grpo")
        batch, _, _ = _train_batch(tokenizer)
        assert verl_adapter.log_batch(trainer, batch) == len(batch)
    finally:
        session.finish()
    assert len(sink.records) == len(batch) and {r.step for r in sink.records} == {2}


@contextlib.contextmanager
def doc_snippet(request: pytest.FixtureRequest) -> Iterator[tuple[dict[str, Any], Callable[..., None]]]:
    """What docs/frameworks/verl.md's lines find in `RayPPOTrainer.fit` and `_validate`: the
    trainer as `self`, fit's batch after `compute_advantage`, and _validate's batch and scores."""
    tokenizer = toy_tokenizer()
    sink = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[sink]) as session:
        trainer = _trainer(tokenizer, step=3, session=session)
        batch, _, _ = _train_batch(tokenizer)
        test_batch = _prompt_batch(["v-a", "v-b", "v-c"]).repeat(repeat_times=N, interleave=True)
        test_batch = test_batch.union(_gen_output(tokenizer, validate=True)[0])
        reward_tensor, _ = reward.extract_reward(test_batch)
        names = {"self": trainer, "batch": batch, "test_batch": test_batch, "reward_tensor": reward_tensor}

        def check(namespace: dict[str, Any]) -> None:
            assert session.flush(timeout=30)
            splits = [r.split for r in sink.records]
            assert splits.count("train") == len(batch) and splits.count("eval") == len(test_batch)

        yield names, check
