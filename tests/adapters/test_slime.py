"""slime (624b824a898a): rollouts built with its own `Sample` API and data source, logged by the
plugins docs/frameworks/slime.md names, called from slime's own `log_rollout_data` /
`log_eval_rollout_data`, and compared with what slime computed: the training data of
`RolloutManager._convert_samples_to_train_data` and the trainer's `compute_advantages_and_returns`
(slime's source at that commit: tests/adapters/_upstream/slime_*.py)."""

from __future__ import annotations

import argparse
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
from asynctrace.adapters import slime_adapter
from asynctrace.rollouts import toy_tokenizer
from tests.adapters._slime_setup import LABELS, PROMPTS, SCRIPT, TOOL, N, make_args, rollout
from tests.adapters._upstream.slime_loss import compute_advantages_and_returns
from tests.adapters._upstream.slime_metric_utils import compute_rollout_step
from tests.adapters._upstream.slime_rollout import RolloutManager
from tests.adapters._upstream.slime_rollout_metrics import log_eval_rollout_data, log_rollout_data
from tests.adapters._upstream.slime_types import Sample
from tests.adapters.conftest import moved

# The tests that run docs/frameworks/slime.md's lines as written, in the framework's own code
# (tests/test_doc_snippets.py checks they are here).
RUNS_PAGE_SNIPPETS = (
    "test_the_rollout_plugin_logs_what_slime_trains_on",
    "test_eval_plugin_logs_each_dataset",
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `--hf-checkpoint` directory holding the in-process tokenizer (nothing is downloaded)."""
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("checkpoint")
    PreTrainedTokenizerFast(tokenizer_object=toy_tokenizer(), pad_token="<pad>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(checkpoint)


def _expected(p: int, k: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": PROMPTS[p]}]
    for j, turn in enumerate(SCRIPT[p][k]):
        if j:
            messages.append({"role": "tool", "content": TOOL})
        messages.append({"role": "assistant", "content": turn})
    return {"messages": messages, "reward": 1.0 if LABELS[p] in SCRIPT[p][k][-1] else 0.0}


def _read(path: Path) -> list[dict[str, Any]]:
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    return [line for line in lines if "sample" in line]


def _trainer_advantages(args: argparse.Namespace, train_data: dict[str, Any]) -> list[Any]:
    """The trainer's advantages for slime's training data (one data-parallel rank holding it all)."""
    rollout_data = {
        "rewards": train_data["rewards"],
        "rollout_log_probs": [torch.tensor(x) for x in train_data["rollout_log_probs"]],
        "loss_masks": [torch.tensor(m) for m in train_data["loss_masks"]],
        "response_lengths": train_data["response_lengths"],
        "total_lengths": [len(t) for t in train_data["tokens"]],
    }
    compute_advantages_and_returns(args, rollout_data)
    return list(rollout_data["advantages"])


def test_the_rollout_plugin_logs_what_slime_trains_on(
    checkpoint: Path, hf_tokenizer: Any, tmp_path: Path
) -> None:
    """slime calls the page's plugin with the rollout; each sample is logged with its turns, reward,
    group, version and the advantage slime's trainer computes from the training data."""
    args = make_args(checkpoint)
    sink = at.JsonlSink(tmp_path / "traces.jsonl")
    session = slime_adapter.open_session(args, sinks=[sink], shutdown_hooks=False, max_traces_per_step=None)
    data = rollout(args, hf_tokenizer)
    log_rollout_data(4, args, data, None, 1.5)
    # RolloutManager.generate, after the plugin: the samples become training data.
    manager = object.__new__(RolloutManager)
    manager.args = args
    manager.custom_reward_post_process_func = None
    manager.custom_convert_samples_to_train_data_func = None
    train_data = manager._convert_samples_to_train_data(data)
    advantages = _trainer_advantages(args, train_data)
    session.finish()
    lines = _read(tmp_path / "traces.jsonl")
    assert len(lines) == len(PROMPTS) * N
    by_index = {line["sample"]["metadata"]["sample_id"]: line for line in lines}
    assert sorted(by_index) == sorted(train_data["sample_indices"])
    for row, index in enumerate(train_data["sample_indices"]):
        p, k = divmod(index, N)
        line = by_index[index]
        meta = line["sample"]["metadata"]
        assert (line["step"], line["split"]) == (compute_rollout_step(args, 4), "train")
        assert line["sample"]["messages"] == _expected(p, k)["messages"]
        assert meta["reward"] == train_data["raw_reward"][row] == _expected(p, k)["reward"]
        per_token = advantages[row].tolist()
        assert per_token == pytest.approx([meta["advantage"]] * len(per_token), abs=1e-6)
        assert meta["advantage"] == pytest.approx(train_data["rewards"][row], abs=1e-6)
        assert (meta["prompt_index"], meta["label"]) == (p, LABELS[p])
        turns = len(SCRIPT[p][k])
        assert meta["weight_versions"] == ["12"] * turns
        assert (meta["policy_version_min"], meta["policy_version_max"]) == (12, 12)
        assert (meta["stop_reason"], meta["truncated"], meta["num_turns"]) == ("completed", False, turns)
        assert meta["response_len"] == train_data["response_lengths"][row]


def test_groups_are_slimes_groups(checkpoint: Path, hf_tokenizer: Any, tmp_path: Path) -> None:
    """The samples of a logged group are one prompt's, found by their text: a mislabelled group,
    prompt or reward fails here whatever the adapter says about itself."""
    args = make_args(checkpoint)
    sink = at.testing.MemorySink()
    slime_adapter.open_session(args, sinks=[sink], shutdown_hooks=False, max_traces_per_step=None)
    data = rollout(args, hf_tokenizer)
    log_rollout_data(0, args, data, None, 1.0)
    slime_adapter.open_session(args).finish()
    origin = {
        orjson.dumps(_expected(p, k)["messages"]): (p, k) for p in range(len(PROMPTS)) for k in range(N)
    }
    groups: dict[int, list[Any]] = {}
    for record in sink.records:
        p, k = origin[orjson.dumps(record.sample.messages)]
        assert record.sample.metadata["reward"] == _expected(p, k)["reward"]
        groups.setdefault(record.sample.metadata["prompt_index"], []).append(p)
    assert groups == {p: [p] * N for p in range(len(PROMPTS))}


def test_token_fields_follow_the_sample(checkpoint: Path, hf_tokenizer: Any) -> None:
    """token_ids, loss_mask and logprobs are the sample's, the prompt masked and without log-probs."""
    args = make_args(checkpoint)
    data = rollout(args, hf_tokenizer)
    fields = ("token_ids", "loss_mask", "logprobs")
    sink = at.testing.MemorySink()
    with at.TraceSession("slime", sinks=[sink], max_traces_per_step=None) as session:
        session.log_samples(slime_adapter.to_samples(data, args=args, token_fields=fields), step=0)
    held = [record.sample.tokens for record in sink.records]
    for sample, tokens in zip(data, held, strict=True):
        decoded = tokens  # the record's sample gives the arrays back as lists
        prompt = len(sample.tokens) - sample.response_length
        assert decoded["token_ids"] == sample.tokens
        assert decoded["loss_mask"] == [0] * prompt + sample.loss_mask
        assert all(math.isnan(v) for v in decoded["logprobs"][:prompt])
        assert decoded["logprobs"][prompt:] == pytest.approx(sample.rollout_log_probs)


def test_eval_plugin_logs_each_dataset(checkpoint: Path, hf_tokenizer: Any) -> None:
    """slime's eval logging calls the page's eval plugin; each dataset's samples are logged as "eval"."""
    args = make_args(checkpoint)
    sink = at.testing.MemorySink()
    slime_adapter.open_session(args, sinks=[sink], shutdown_hooks=False, max_traces_per_step=None)
    data = rollout(args, hf_tokenizer)
    evals = {
        "gsm8k": {"rewards": [s.reward for s in data[:6]], "truncated": [0] * 6, "samples": data[:6]},
        "words": {"rewards": [s.reward for s in data[6:8]], "truncated": [0] * 2, "samples": data[6:8]},
    }
    logged = log_eval_rollout_data(2, args, evals)
    slime_adapter.open_session(args).finish()
    assert logged["eval/gsm8k"] == pytest.approx(sum(evals["gsm8k"]["rewards"]) / 6)
    assert {(r.split, r.step) for r in sink.records} == {("eval", 2)}
    assert [r.sample.metadata["eval_dataset"] for r in sink.records] == ["gsm8k"] * 6 + ["words"] * 2
    assert [r.sample.metadata["reward"] for r in sink.records] == [s.reward for s in data[:8]]
    assert all("advantage" not in r.sample.metadata for r in sink.records)


def test_without_a_tokenizer_the_response_is_one_turn(tmp_path: Path, hf_tokenizer: Any) -> None:
    """A checkpoint with no tokenizer leaves multi-turn responses whole: slime's response text."""
    args = make_args(tmp_path / "missing")
    sink = at.testing.MemorySink()
    slime_adapter.open_session(args, sinks=[sink], shutdown_hooks=False, max_traces_per_step=None)
    data = rollout(args, hf_tokenizer)
    slime_adapter.log_rollout(0, args, data)
    slime_adapter.open_session(args).finish()
    first = sink.records[0].sample.messages
    assert first == [
        {"role": "user", "content": PROMPTS[0]},
        {"role": "assistant", "content": SCRIPT[0][0][0] + TOOL + SCRIPT[0][0][1]},
    ]


def test_ppo_has_no_advantage_at_rollout_time(checkpoint: Path, hf_tokenizer: Any) -> None:
    """PPO's advantages need the critic: none is logged; the reward key picks a dict reward's value."""
    args = make_args(checkpoint, advantage_estimator="ppo", reward_key="acc")
    data = rollout(args, hf_tokenizer)
    for sample in data:
        sample.reward = {"acc": sample.reward, "format": 0.5}
    assert slime_adapter.advantages(data, args) is None
    out = slime_adapter.to_samples(data, args=args)
    assert [s.metadata["reward"] for s in out] == [s.reward["acc"] for s in data]
    assert out[0].metadata["reward_breakdown"] == {"acc": data[0].reward["acc"], "format": 0.5}


def test_the_step_is_slimes_rollout_step(checkpoint: Path) -> None:
    """The logged step is the one slime logs the rollout's metrics at, with either step setting."""
    for train_step in (False, True):
        args = make_args(checkpoint, wandb_always_use_train_step=train_step, global_batch_size=6)
        steps = [slime_adapter.rollout_step(args, rollout_id) for rollout_id in range(5)]
        assert steps == [compute_rollout_step(args, rollout_id) for rollout_id in range(5)]
        assert steps == ([0, 1, 3, 4, 6] if train_step else [0, 1, 2, 3, 4])


def test_a_conversation_prompt_keeps_its_messages() -> None:
    """A prompt given as messages (slime's chat prompts) stays those messages, roles included."""
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    sample = Sample(prompt=prompt, response="4", response_length=1, tokens=[7, 8, 9], reward=1.0)
    (out,) = slime_adapter.to_samples([sample])
    assert out.messages == [*prompt, {"role": "assistant", "content": "4"}]
    assert (out.metadata["prompt_len"], out.metadata["response_len"], out.metadata["num_turns"]) == (2, 1, 1)


def test_plugin_never_raises_and_counts_the_rows(
    checkpoint: Path, hf_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Samples the adapter cannot read are counted as invalid with one warning; slime goes on."""
    caplog.set_level(logging.WARNING, logger="asynctrace")
    args = make_args(checkpoint)
    session = slime_adapter.open_session(args, sinks=[at.testing.MemorySink()], shutdown_hooks=False)
    data = rollout(args, hf_tokenizer)
    data[1].loss_mask = data[1].loss_mask[:-1]
    for _ in range(2):
        assert slime_adapter.log_rollout(0, args, data) is False
    session.finish()
    stats = session.stats()
    assert stats.dropped["invalid"] == 2 * len(data) and stats.check()
    warned = [r for r in caplog.records if "slime_adapter.log_rollout" in r.getMessage()]
    assert len(warned) == 1 and "loss_mask" in warned[0].getMessage()


def test_a_moved_hook_point_is_named_and_its_rollouts_counted(
    checkpoint: Path, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, hook_warnings: list[str]
) -> None:
    """The plugin, called as slime's `log_rollout_data` calls it, with Samples whose slime renamed
    `group_index` (slime's own metrics would then fail on their own): it says so once, naming the
    commit tested and the field, counts every sample and returns False, as slime expects."""
    args = make_args(checkpoint)
    session = slime_adapter.open_session(args, sinks=[at.testing.MemorySink()], shutdown_hooks=False)
    data = rollout(args, hf_tokenizer)
    monkeypatch.delattr(Sample, "group_index")
    for sample in data:
        sample.group_id = vars(sample).pop("group_index")
    for _ in range(2):
        assert slime_adapter.log_rollout(0, args, data, None, 1.0) is False
    session.finish()
    moved(hook_warnings, "slime_adapter.log_rollout", "commit 624b824a898a", "Sample.group_index")
    stats = session.stats()
    assert stats.dropped["invalid"] == 2 * len(data) and stats.written == 0 and stats.check()


def test_importing_the_adapter_imports_no_slime() -> None:
    """`asynctrace.adapters.slime_adapter` imports without slime, SGLang, torch or transformers."""
    code = (
        "import sys\n"
        "from asynctrace.adapters import slime_adapter\n"
        "assert not {'slime', 'sglang', 'torch', 'transformers', 'megatron'} & set(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
