"""The AReaL adapter on AReaL 1.0.4's own objects.

Trajectories come from AReaL's real workflows (`RLVRWorkflow`, `MultiTurnWorkflow`), grouped
by its `GroupedRolloutWorkflow` (which joins a group with `concat_padded_tensors`), turned
into advantages by `PPOActor.compute_advantages`, and moved to RTensors by
`RTensor.remotize` as the single controller receives them. The one stand-in is the
inference server (SGLang / vLLM cannot run here): `ScriptedServer.agenerate` answers each
`ModelRequest` with a real `ModelResponse` holding scripted tokens (tests/adapters/_areal_setup.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import torch

import asynctrace as at
from asynctrace.adapters import _hooks, areal_adapter
from tests._util import read_traces
from tests.adapters.conftest import LOGGING, moved
from tests.rollouts._helpers import check_text_ends

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from tests.adapters._areal_setup import StorageBackend

# Each test imports AReaL's objects from _areal_setup when it runs: AReaL's import is most of what
# collecting the suite costs, and a run that selects no AReaL test skips it.


@pytest.fixture(autouse=True)
def _keep_logging() -> Iterator[None]:
    """Whatever AReaL's getLogger swaps during a test is put back (see tests/adapters/conftest.py)."""
    yield
    logging.Logger.manager, logging.Logger.root = LOGGING


@pytest.fixture(scope="module")
def hf_tokenizer() -> PreTrainedTokenizerFast:
    """AReaL's trainer holds a transformers tokenizer: the in-process BPE one, with a chat template."""
    from tests.adapters._areal_setup import make_hf_tokenizer

    return make_hf_tokenizer()


@pytest.fixture
def backend() -> Iterator[StorageBackend]:
    """AReaL's RTensor backend for the test, and its storage emptied afterwards."""
    from tests.adapters._areal_setup import StorageBackend, rtensor

    storage = StorageBackend()
    rtensor.set_backend(storage)
    try:
        yield storage
    finally:
        rtensor.set_backend(None)
        rtensor.clear_fetch_buffer()
        for sid in list(rtensor._storage):
            rtensor.remove(sid)


@pytest.fixture
def warnings_seen() -> Iterator[list[str]]:
    """asynctrace's warnings, read on `logging.root`, which they reach whatever manager AReaL's
    `getLogger` swapped in."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.name == "asynctrace":
                seen.append(record.getMessage())

    handler = Collect(logging.WARNING)
    _hooks._warned.discard("areal_adapter.log_batch")
    logging.root.addHandler(handler)
    try:
        yield seen
    finally:
        logging.root.removeHandler(handler)


def test_prepare_batch_list_of_groups(hf_tokenizer: PreTrainedTokenizerFast) -> None:
    """A list of group dicts decodes row by row, with its group id, reward and policy version."""
    from tests.adapters._areal_setup import expected, prepare_batch

    batch = prepare_batch(hf_tokenizer)
    assert isinstance(batch, list) and [g["input_ids"].shape[0] for g in batch] == [2, 2]
    samples = areal_adapter.to_samples(batch, tokenizer=hf_tokenizer)
    assert [s.messages for s in samples] == expected(hf_tokenizer)
    assert [s.metadata["group_id"] for s in samples] == [0, 0, 1, 1]
    assert [s.metadata["reward"] for s in samples] == [1.0, 0.0, 0.0, 1.0]
    assert all(s.metadata["policy_version_min"] == s.metadata["policy_version_max"] == 3 for s in samples)
    assert [s.metadata["sample_index"] for s in samples] == [0, 1, 2, 3]


def test_rollout_kwargs_takes_the_list_through_log_rollouts(
    hf_tokenizer: PreTrainedTokenizerFast, project: str
) -> None:
    """The documented `log_rollouts(**rollout_kwargs(batch))` accepts the list and keeps the best/worst."""
    from tests.adapters._areal_setup import expected, prepare_batch

    batch = prepare_batch(hf_tokenizer)
    with at.TraceSession(project, run="r", max_traces_per_step=2, sampler="top_bottom") as session:
        session.log_rollouts(**areal_adapter.rollout_kwargs(batch), tokenizer=hf_tokenizer, step=4)
    assert session.stats().dropped.get("capped") == 2
    traces = sorted(read_traces(project, "r"), key=lambda t: t["metadata"]["reward"])
    rows = expected(hf_tokenizer)
    assert [t["messages"] for t in traces] == [rows[1], rows[0]]
    assert [t["metadata"]["group_id"] for t in traces] == [0, 0]


def test_one_concatenated_dict_with_group_size(hf_tokenizer: PreTrainedTokenizerFast) -> None:
    """One dict (the list joined by concat_padded_tensors) decodes the same; group_size gives groups."""
    from tests.adapters._areal_setup import concat_padded_tensors, expected, prepare_batch

    joined = concat_padded_tensors(prepare_batch(hf_tokenizer))
    samples = areal_adapter.to_samples(joined, tokenizer=hf_tokenizer, group_size=2)
    assert [s.messages for s in samples] == expected(hf_tokenizer)
    assert [s.metadata["group_id"] for s in samples] == [0, 0, 1, 1]
    plain = areal_adapter.to_samples(joined, tokenizer=hf_tokenizer)
    assert all("group_id" not in s.metadata for s in plain)


def test_compute_advantages_output_keeps_turns_and_gives_advantages(
    hf_tokenizer: PreTrainedTokenizerFast,
) -> None:
    """After compute_advantages (which rolls the loss mask left by one) turns stay exact, with advantages."""
    from tests.adapters._areal_setup import expected, grpo_actor, prepare_batch

    batch = prepare_batch(hf_tokenizer)
    adv_batch = grpo_actor().compute_advantages(batch)
    assert not torch.equal(adv_batch[0]["loss_mask"].int(), batch[0]["loss_mask"])
    first = areal_adapter.to_samples(adv_batch[0], tokenizer=hf_tokenizer)
    assert [s.messages for s in first] == expected(hf_tokenizer)[:2]
    samples = areal_adapter.to_samples(adv_batch, tokenizer=hf_tokenizer)
    assert [s.messages for s in samples] == expected(hf_tokenizer)
    for sample, row in zip(samples, [(0, 0), (0, 1), (1, 0), (1, 1)], strict=True):
        group, i = row
        advantages, mask = adv_batch[group]["advantages"][i], adv_batch[group]["loss_mask"][i]
        assert sample.metadata["advantage"] == pytest.approx(float(advantages[mask != 0].mean()))
    # GRPO: the right answer of each group is above its group's mean, the wrong one below.
    assert [s.metadata["advantage"] > 0 for s in samples] == [True, False, False, True]


def test_multi_turn_workflow_feedback_turns(hf_tokenizer: PreTrainedTokenizerFast) -> None:
    """MultiTurnWorkflow's retry prompt between attempts comes back as its own turn."""
    from tests.adapters._areal_setup import PROBLEMS, MultiTurnWorkflow, ScriptedServer, gconfig, reward_fn

    workflow = MultiTurnWorkflow(
        reward_fn=reward_fn, gconfig=gconfig(), tokenizer=hf_tokenizer, max_turns=3, turn_discount=0.5
    )
    data, _ = PROBLEMS[0]
    server = ScriptedServer(hf_tokenizer, ["I think 392.", "It is 391."])
    traj = asyncio.run(workflow.arun_episode(server, data))
    (sample,) = areal_adapter.to_samples([traj], tokenizer=hf_tokenizer, env_role="user")
    prompt = hf_tokenizer.apply_chat_template(data["messages"], tokenize=False, add_generation_prompt=True)
    feedback = hf_tokenizer.decode(workflow.multi_turn_prompt_ids)
    assert sample.messages == [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": "I think 392.<|im_end|>"},
        {"role": "user", "content": feedback},
        {"role": "assistant", "content": "It is 391.<|im_end|>"},
    ]
    assert sample.metadata["reward"] == 0.5 and sample.metadata["num_turns"] == 2


def test_single_controller_rtensors(hf_tokenizer: PreTrainedTokenizerFast, backend: StorageBackend) -> None:
    """RTensor groups (trimmed to their own width) decode like local ones, fetching only what is needed."""
    from tests.adapters._areal_setup import RTensor, expected, grpo_actor, prepare_batch

    local = grpo_actor().compute_advantages(prepare_batch(hf_tokenizer))
    remote = RTensor.remotize(local, node_addr="worker-0")
    assert all(v.data.is_meta for group in remote for v in group.values())
    assert remote[0]["input_ids"].shape[1] != remote[1]["input_ids"].shape[1]
    first = areal_adapter.to_samples(remote[0], tokenizer=hf_tokenizer)
    assert [s.messages for s in first] == expected(hf_tokenizer)[:2]
    samples = areal_adapter.to_samples(remote, tokenizer=hf_tokenizer)
    assert [s.messages for s in samples] == expected(hf_tokenizer)
    assert [s.metadata for s in samples] == [
        s.metadata for s in areal_adapter.to_samples(local, tokenizer=hf_tokenizer)
    ]
    # One batched fetch per call of the six tensors decoding needs (input_ids, attention_mask,
    # loss_mask, versions, rewards, advantages); logprobs, returns, ... stay remote. The second
    # call finds group 0 in AReaL's fetch buffer and fetches only group 1.
    assert backend.fetches == [6, 6]
    # The trainer's RTensors stay remote: AReaL's RPCs would otherwise serialise their data.
    assert all(v.data.is_meta for group in remote for v in group.values())


def test_log_batch_hook_never_raises(
    hf_tokenizer: PreTrainedTokenizerFast, backend: StorageBackend, warnings_seen: list[str]
) -> None:
    """The hook logs RTensor batches; a batch it cannot read is counted as invalid, with one warning."""
    from tests.adapters._areal_setup import RTensor, grpo_actor, prepare_batch

    remote = RTensor.remotize(grpo_actor().compute_advantages(prepare_batch(hf_tokenizer)), "worker-0")
    sink = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[sink]) as session:
        assert areal_adapter.log_batch(session, remote, tokenizer=hf_tokenizer, step=7) == 4
        broken = [{"attention_mask": torch.ones(2, 3)}, {"input_ids": torch.ones(3, 3)}]
        for _ in range(2):
            assert areal_adapter.log_batch(session, broken, tokenizer=hf_tokenizer, step=8) == 0
        assert areal_adapter.log_batch(session, "not a batch", tokenizer=hf_tokenizer, step=8) == 0
    stats = session.stats()
    assert stats.written == 4 and stats.dropped["invalid"] == 5 + 5 + 1 and stats.check()
    assert sum("areal_adapter.log_batch" in m for m in warnings_seen) == 1
    assert sorted(r.sample.metadata["group_id"] for r in sink.records) == [0, 0, 1, 1]


def test_a_renamed_field_is_counted_row_by_row(
    hf_tokenizer: PreTrainedTokenizerFast, warnings_seen: list[str]
) -> None:
    """Groups whose `input_ids` and `attention_mask` another AReaL version renamed are counted
    by their other per-row tensors, every row of them, not one per group."""
    from tests.adapters._areal_setup import grpo_actor, prepare_batch

    batch = grpo_actor().compute_advantages(prepare_batch(hf_tokenizer))
    renamed = [
        {f"{k}_v2" if k in ("input_ids", "attention_mask") else k: v for k, v in g.items()} for g in batch
    ]
    with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as session:
        assert areal_adapter.log_batch(session, renamed, tokenizer=hf_tokenizer, step=3) == 0
    stats = session.stats()
    assert stats.dropped["invalid"] == 4 and stats.written == 0 and stats.check()


def test_rows_pick_samples_before_decoding(hf_tokenizer: PreTrainedTokenizerFast) -> None:
    """`rows` indexes the concatenated batch and decodes only those rows, in that order."""
    from tests.adapters._areal_setup import expected, prepare_batch

    samples = areal_adapter.to_samples(prepare_batch(hf_tokenizer), tokenizer=hf_tokenizer, rows=[3, 0])
    assert [s.metadata["sample_index"] for s in samples] == [3, 0]
    assert [s.metadata["group_id"] for s in samples] == [1, 0]
    assert samples[0].messages == expected(hf_tokenizer)[3]


def test_attach_logs_each_compute_advantages_of_the_trainer(
    hf_tokenizer: PreTrainedTokenizerFast,
) -> None:
    """attach() logs what PPOTrainer.train's compute_advantages returns, once per call, and passes it on."""
    from tests.adapters._areal_setup import PPOTrainer, expected, grpo_actor, prepare_batch

    # The hook point is AReaL's own: train() calls the actor's compute_advantages once per step.
    source = inspect.getsource(PPOTrainer.train)
    assert source.count("self.actor.compute_advantages(rollout_batch)") == 1
    # PPOTrainer.__init__ launches inference servers and a scheduler, which cannot run here:
    # the instance gets the two attributes attach reads, with AReaL's real PPOActor (the object
    # FSDPPPOActor.compute_advantages delegates to; it has no get_version, so steps count from 0).
    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.actor = grpo_actor()
    trainer.tokenizer = hf_tokenizer
    sink = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[sink]) as session:
        areal_adapter.attach(trainer, session)
        for _ in range(2):
            adv_batch = trainer.actor.compute_advantages(prepare_batch(hf_tokenizer))
            assert "advantages" in adv_batch[0] and len(adv_batch) == 2
    assert sorted(r.step for r in sink.records) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [r.sample.messages for r in sink.records if r.step == 1] == expected(hf_tokenizer)
    assert session.stats().check() and session.stats().written == 8


def test_token_fields_round_trip_through_the_parquet_archive(
    hf_tokenizer: PreTrainedTokenizerFast, tmp_path: Any
) -> None:
    """log_batch(token_fields=...) after compute_advantages keeps AReaL's per-token log-probs, and the
    loss mask and advantages put back on their tokens; the Parquet archive returns them bit for bit."""
    import numpy as np
    import orjson
    import pyarrow.parquet as pq

    from tests.adapters._areal_setup import grpo_actor, prepare_batch

    batch = prepare_batch(hf_tokenizer)
    original = [{k: v.clone() for k, v in group.items() if isinstance(v, torch.Tensor)} for group in batch]
    adv_batch = grpo_actor().compute_advantages(batch)
    fields = ("token_ids", "loss_mask", "logprobs", "advantages")
    # In-process writer: the files are what is read here; tests/sinks/ test the writer process.
    with at.TraceSession("p", run="r", sinks=[at.ParquetSink(tmp_path, process=False)]) as session:
        assert (
            areal_adapter.log_batch(session, adv_batch, tokenizer=hf_tokenizer, step=0, token_fields=fields)
            == 4
        )
    expected_rows = []
    for group, adv in zip(original, adv_batch, strict=True):
        shifted = torch.cat([torch.zeros_like(adv["advantages"][:, :1]), adv["advantages"][:, :-1]], dim=1)
        for i in range(group["input_ids"].shape[0]):
            keep = group["attention_mask"][i].bool()
            expected_rows.append(
                {
                    "token_ids": group["input_ids"][i][keep].numpy().astype(np.int32),
                    "loss_mask": group["loss_mask"][i][keep].numpy().astype(np.int8),
                    # compute_advantages keeps the log-probs of generated tokens only.
                    "logprobs": (group["logprobs"][i] * group["loss_mask"][i])[keep]
                    .numpy()
                    .astype(np.float32),
                    "advantages": shifted[i][keep].float().numpy(),
                }
            )
    rows = pq.read_table(tmp_path).to_pylist()
    assert len(rows) == 4
    for row in rows:
        meta = orjson.loads(row["metadata"])
        want = expected_rows[meta["sample_index"]]
        for name, values in want.items():
            # Equal values (AReaL's masking makes -0.0 of some zeros), and the same dtype.
            assert np.array_equal(np.asarray(row[name], dtype=values.dtype), values), name
        check_text_ends(
            orjson.loads(row["messages"]),
            row["token_ids"],
            row["text_ends"],
            lambda ids: hf_tokenizer.decode(ids, clean_up_tokenization_spaces=False),
        )
        generated = np.asarray(row["loss_mask"]) == 1
        # The row's advantage in metadata is the mean over its generated tokens.
        assert float(np.asarray(row["advantages"])[generated].mean()) == pytest.approx(
            meta["advantage"], abs=1e-5
        )
    # to_samples gives the same values as plain lists of numbers.
    samples = areal_adapter.to_samples(adv_batch, tokenizer=hf_tokenizer, token_fields=fields)
    for sample in samples:
        assert sample.tokens is not None and all(isinstance(v, list) for v in sample.tokens.values())
        want = expected_rows[sample.metadata["sample_index"]]
        for name, values in want.items():
            assert np.array_equal(np.asarray(sample.tokens[name], dtype=values.dtype), values), name
    with pytest.raises(ValueError, match="token_fields"):
        areal_adapter.to_samples(batch, tokenizer=hf_tokenizer, token_fields=("advantages",))


def test_attach_opens_its_session_and_finishes_it_when_train_returns() -> None:
    """Without a session, attach opens one named after the experiment and trial, logs each step
    and finishes the session when `train` returns."""
    from tests.adapters._areal_setup import ScriptedPPOTrainer, make_hf_tokenizer, trainer_config

    sink = at.testing.MemorySink()
    trainer = ScriptedPPOTrainer(trainer_config(make_hf_tokenizer()))
    areal_adapter.attach(trainer, sinks=[sink], max_traces_per_step=None)
    session = trainer.asynctrace_session
    assert (session.project, session.run) == (trainer.config.experiment_name.replace("/", "-"), "t0")
    trainer.train()
    assert not session.is_open and sink.closed
    assert sorted(r.step for r in sink.records) == [0] * 4 + [1] * 4


def test_a_moved_hook_point_is_named_and_the_trainer_left_as_it_is(
    monkeypatch: pytest.MonkeyPatch, hook_warnings: list[str]
) -> None:
    """A PPOActor whose AReaL renamed `compute_advantages`: attach says so once, naming AReaL
    1.0.4 and what is missing, opens no session and leaves the trainer as it was; its training
    runs on, through the renamed method, and nothing raises."""
    from tests.adapters._areal_setup import (
        PPOActor,
        ScriptedPPOTrainer,
        make_hf_tokenizer,
        prepare_batch,
        trainer_config,
    )

    method = PPOActor.compute_advantages
    monkeypatch.delattr(PPOActor, "compute_advantages")
    monkeypatch.setattr(PPOActor, "compute_advantages_v2", method, raising=False)
    trainer = ScriptedPPOTrainer(trainer_config(make_hf_tokenizer()))
    sink = at.testing.MemorySink()
    areal_adapter.attach(trainer, sinks=[sink])
    moved(hook_warnings, "areal_adapter.attach", "AReaL 1.0.4", "actor.compute_advantages")
    assert not hasattr(trainer, "asynctrace_session") and "compute_advantages_v2" not in vars(trainer.actor)
    adv_batch = trainer.actor.compute_advantages_v2(prepare_batch(trainer.tokenizer))
    assert "advantages" in adv_batch[0] and not sink.opened


@contextlib.contextmanager
def doc_snippet(request: pytest.FixtureRequest) -> Iterator[tuple[dict[str, Any], Callable[..., None]]]:
    """What docs/frameworks/areal.md's lines find: the training script's PPOTrainer and its
    arguments, and inside `PPOTrainer.train` an open session, the step's batch and step."""
    from trackio.sqlite_storage import SQLiteStorage

    from tests.adapters._areal_setup import (
        PROBLEMS,
        ScriptedPPOTrainer,
        make_hf_tokenizer,
        prepare_batch,
        trainer_config,
    )

    tokenizer = make_hf_tokenizer()
    config = trainer_config(tokenizer)
    trainer = ScriptedPPOTrainer(config)
    sink = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[sink]) as session:
        names = {
            "PPOTrainer": ScriptedPPOTrainer,
            "config": config,
            "train_dataset": [p for p, _ in PROBLEMS],
            "valid_dataset": None,
            "workflow": None,
            "eval_workflow": None,
            "session": session,
            "self": trainer,
            "adv_batch": trainer.actor.compute_advantages(prepare_batch(tokenizer)),
            "global_step": 5,
        }

        def check(namespace: dict[str, Any]) -> None:
            project = config.experiment_name.replace("/", "-")
            (run,) = SQLiteStorage.get_run_records(project)
            assert run["name"] == "t0"
            traced = SQLiteStorage.get_traces(project, run_id=run["id"])
            assert sorted(t["step"] for t in traced) == [0] * 4 + [1] * 4
            assert not namespace["trainer"].asynctrace_session.is_open  # finished when train returned
            assert session.flush(timeout=30)
            assert [r.step for r in sink.records] == [5] * 4

        yield names, check
