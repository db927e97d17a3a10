"""open-instruct's prepared batches, built by open-instruct's own code, to samples.

open-instruct is not on a package index: its definitions are run from its source at a pinned
commit (tests/adapters/_upstream/open_instruct_*.py). Each batch goes through what open-instruct
does before its logging point: `process_group` per prompt, `make_batch_from_groups`,
`maybe_mask_truncated_completions` and the advantages (`data_preparation_step`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import asynctrace as at
from asynctrace.adapters import open_instruct_adapter
from asynctrace.adapters._sessions import session_for
from asynctrace.rollouts import toy_tokenizer
from tests._util import read_traces
from tests.adapters._upstream.open_instruct_data_loader import (
    GROUND_TRUTHS_KEY,
    INPUT_IDS_PROMPT_KEY,
    RAW_PROMPT_KEY,
    TOOLS_COLUMN_KEY,
    VERIFIER_SOURCE_KEY,
    data_preparation_step,
    make_batch_from_groups,
    maybe_mask_truncated_completions,
    process_group,
)
from tests.adapters._upstream.open_instruct_data_types import (
    GenerationResult,
    RequestInfo,
    TokenStatistics,
    ToolCallStats,
)
from tests.adapters._upstream.open_instruct_model_utils import Batch
from tests.adapters._upstream.open_instruct_rl_utils import _save_rollouts
from tests.adapters.conftest import moved
from tests.rollouts._helpers import encode

N = 2  # num_samples_per_prompt_rollout
QUESTIONS = ["What is 6 * 7?", "Spell 'cat' backwards.", "What is 2 + 2?"]
TRUTHS = ["42", "tac", "4"]


class HFTokenizer:
    """The in-process tokenizer under the two names `process_group` calls (transformers' API)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.token_to_id("<|im_end|>")

    def batch_decode(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        return list(self.tokenizer.decode_batch(sequences, skip_special_tokens=skip_special_tokens))


def dataset(tokenizer: Any) -> list[dict[str, Any]]:
    """Rows with the columns rlvr_tokenize_v2 writes (dataset and ground truth as lists)."""
    rows = []
    for question, truth in zip(QUESTIONS, TRUTHS, strict=True):
        prompt = [{"role": "system", "content": "Use python."}, {"role": "user", "content": question}]
        rows.append(
            {
                INPUT_IDS_PROMPT_KEY: encode(tokenizer, [("user", question)])[0],
                GROUND_TRUTHS_KEY: [truth],
                VERIFIER_SOURCE_KEY: ["gsm8k"],
                # dataset_transformation.py joins the prompt messages this way.
                RAW_PROMPT_KEY: "\n".join(f"{msg['role']}: {msg['content']}" for msg in prompt),
                TOOLS_COLUMN_KEY: ["python"],
            }
        )
    return rows


def turns_of(row: int) -> list[tuple[str, str]]:
    """Row `row`'s response: a python call, its output, the answer; each row's text is its own."""
    return [
        ("assistant", f"<code>print({row})</code>"),
        ("tool", f"<output>{row}</output>"),
        ("assistant", f"A{row}"),
    ]


def generation(tokenizer: Any, index: int, finish_reasons: list[str]) -> GenerationResult:
    """What vllm_utils returns for one prompt: N responses, their request info and rewards."""
    rows = [index * N + k for k in range(N)]
    encoded = [encode(tokenizer, turns_of(row)) for row in rows]
    return GenerationResult(
        responses=[ids for ids, _ in encoded],
        finish_reasons=finish_reasons,
        masks=[mask for _, mask in encoded],
        request_info=RequestInfo(
            num_calls=[row + 1 for row in rows],
            timeouts=[0] * N,
            tool_errors=[""] * N,
            tool_outputs=[f"<output>{row}</output>" for row in rows],
            tool_runtimes=[0.5 * row for row in rows],
            tool_calleds=[True] * N,
            tool_call_stats=[
                [ToolCallStats(tool_name="python", success=True, runtime=0.5 * row)] for row in rows
            ],
            rollout_states=[{"step_count": row + 1} for row in rows],
        ),
        index=index,
        prompt_id=f"0_{index}",
        token_statistics=TokenStatistics(num_prompt_tokens=5, num_response_tokens=20, generation_time=1.0),
        logprobs=[[-0.5] * len(ids) for ids, _ in encoded],
        reward_scores=[float(k == index % N) for k in range(N)],
        model_step=7,
    )


def prepared(
    tokenizer: Any, finish_reasons: list[str], *, mask_truncated: bool
) -> tuple[Batch, GenerationResult, Any, list[str]]:
    """A batch of three prompts as open-instruct has it at its logging point.

    Returns the batch, the combined result and the advantages after masking, and the finish
    reasons taken just before `maybe_mask_truncated_completions`.
    """
    result, batch = generated(tokenizer, finish_reasons)
    before = list(result.finish_reasons)
    actor = SimpleNamespace(
        config=SimpleNamespace(
            mask_truncated_completions=mask_truncated,
            num_samples_per_prompt_rollout=N,
            advantage_normalization_type="standard",
        )
    )
    batch, advantages = data_preparation_step(actor, result, batch)
    return batch, result, advantages, before


def generated(tokenizer: Any, finish_reasons: list[str]) -> tuple[GenerationResult, Batch]:
    """A step's combined result and batch of three prompts, before truncation masking."""
    hf = HFTokenizer(tokenizer)
    config = SimpleNamespace(n=N)  # vllm.SamplingParams: process_group reads only `n`
    groups = [
        process_group(
            result=generation(tokenizer, index, finish_reasons[index * N : (index + 1) * N]),
            generation_config=config,
            tokenizer=hf,
            dataset=dataset(tokenizer),
            max_possible_score=1.0,
            no_resampling_pass_rate=None,
            iter_dataloader=None,
            filter_zero_std_samples=False,
            replenish_prompts=False,
            param_prompt_Q=None,
            base_env_config=None,
        )
        for index in range(len(QUESTIONS))
    ]
    result, batch, _, _ = make_batch_from_groups(groups, config, training_step=8)
    return result, batch


TRUNCATED = ["stop", "length", "stop", "stop", "length", "stop"]
ALL_STOP = ["stop"] * 6


def test_tool_fields_stay_on_their_rows_after_truncation_masking(tokenizer: Any) -> None:
    """After maybe_mask_truncated_completions, each row keeps its own request_info and prompt index."""
    batch, result, advantages, before = prepared(tokenizer, TRUNCATED, mask_truncated=True)
    assert len(result.responses) == 4 and len(result.request_info.num_calls) == 6  # upstream's state
    samples = open_instruct_adapter.to_samples(
        batch, result, samples_per_prompt=N, advantages=advantages, finish_reasons=before, tokenizer=tokenizer
    )
    kept = [0, 2, 3, 5]
    assert [s.metadata["prompt_index"] for s in samples] == [row // N for row in kept] == [0, 1, 1, 2]
    assert [s.metadata["sample_index"] for s in samples] == [0, 1, 2, 3]
    for sample, row in zip(samples, kept, strict=True):
        meta = sample.metadata
        # The tool output in the row's own response is the one its request_info names.
        assert sample.messages[2] == {"role": "tool", "content": f"<output>{row}</output>"}
        assert meta["tool_outputs"] == f"<output>{row}</output>" and meta["num_calls"] == row + 1
        assert meta["tool_runtimes"] == 0.5 * row
        assert meta["tool_call_stats"] == [{"tool_name": "python", "success": True, "runtime": 0.5 * row}]
    assert [s.metadata["reward"] for s in samples] == batch.scores
    assert [s.metadata["advantage"] for s in samples] == pytest.approx(list(advantages))


def test_misaligned_tool_fields_are_left_out_with_a_warning(tokenizer: Any) -> None:
    """Without the finish reasons from before masking, tool fields are not put on other rows."""
    batch, result, advantages, _ = prepared(tokenizer, TRUNCATED, mask_truncated=True)
    with pytest.warns(UserWarning, match="request_info has 6 rows for 4 responses"):
        samples = open_instruct_adapter.to_samples(batch, result, samples_per_prompt=N, advantages=advantages)
    assert len(samples) == 4
    for sample in samples:
        assert not {"num_calls", "tool_outputs", "tool_call_stats", "prompt_index"} & set(sample.metadata)
    # What still lines up (the batch, finish reasons, advantages) is kept.
    assert [s.metadata["dataset_index"] for s in samples] == [0, 1, 1, 2]
    assert [s.metadata["advantage"] for s in samples] == pytest.approx(list(advantages))


def test_rows_match_open_instructs_own_rollout_records(tokenizer: Any, tmp_path: Path) -> None:
    """Unmasked, the samples agree with open-instruct's save_rollouts records; prompt_index is i // n."""
    batch, result, advantages, _ = prepared(tokenizer, ALL_STOP, mask_truncated=False)
    samples = open_instruct_adapter.to_samples(batch, result, samples_per_prompt=N, advantages=advantages)
    _save_rollouts(str(tmp_path), "run", 8, batch, result, advantages, N, 0)
    records = [json.loads(line) for line in (tmp_path / "run_rollouts_000000.jsonl").read_text().splitlines()]
    assert len(records) == len(samples) == 6
    for sample, record in zip(samples, records, strict=True):
        meta = sample.metadata
        assert meta["prompt_index"] == record["prompt_idx"] and meta["sample_index"] == record["sample_idx"]
        assert meta["reward"] == record["reward"] and meta["advantage"] == pytest.approx(record["advantage"])
        assert meta["stop_reason"] == record["finish_reason"]
        assert meta["dataset"] == record["dataset"] == ["gsm8k"]
        assert meta["ground_truth"] == record["ground_truth"]
        for name in ("num_calls", "timeouts", "tool_errors", "tool_outputs", "tool_runtimes", "tool_calleds"):
            assert meta[name] == record["request_info"][name]
        assert meta["tool_call_stats"] == record["request_info"]["tool_call_stats"]
        assert meta["model_step"] == 7 and meta["active_tools"] == ["python"]
    assert [s.metadata["prompt_index"] for s in samples] == [0, 0, 1, 1, 2, 2]


def test_prompt_and_response_text(tokenizer: Any) -> None:
    """The prompt is open-instruct's raw query; with a tokenizer, masks split out the tool turn."""
    batch, result, _, _ = prepared(tokenizer, ALL_STOP, mask_truncated=False)
    plain = open_instruct_adapter.to_samples(batch, result, samples_per_prompt=N)
    assert plain[3].messages == [
        {"role": "user", "content": f"system: Use python.\nuser: {QUESTIONS[1]}"},
        {"role": "assistant", "content": "".join(text for _, text in turns_of(3))},
    ]
    split = open_instruct_adapter.to_samples(batch, result, samples_per_prompt=N, tokenizer=tokenizer)
    assert split[3].messages[1:] == [{"role": r, "content": t} for r, t in turns_of(3)]


def test_finish_reasons_that_do_not_match_are_refused(tokenizer: Any) -> None:
    """Finish reasons whose "stop" rows are not the responses are an error naming the argument."""
    batch, result, _, _ = prepared(tokenizer, TRUNCATED, mask_truncated=True)
    with pytest.raises(ValueError, match=r"finish_reasons: 6 rows of which 6 finished with 'stop'"):
        open_instruct_adapter.to_samples(batch, result, finish_reasons=ALL_STOP)


def test_tokens_are_decoded_when_there_is_no_text(tokenizer: Any) -> None:
    """A Batch without raw text has its queries and responses decoded in one tokenizer call."""
    batch, result, _, _ = prepared(tokenizer, ALL_STOP, mask_truncated=False)
    batch.raw_queries = None
    batch.decoded_responses = None
    samples = open_instruct_adapter.to_samples(batch, result, tokenizer=tokenizer)
    assert samples[2].messages[0] == {"role": "user", "content": QUESTIONS[1]}
    assert samples[2].messages[-1] == {"role": "assistant", "content": "A2"}
    assert "prompt_index" not in samples[2].metadata  # samples_per_prompt not given
    with pytest.raises(ValueError, match="tokenizer"):
        open_instruct_adapter.to_samples(batch, result)


def test_responses_that_do_not_map_onto_queries_name_the_fields(tokenizer: Any) -> None:
    """Responses that are not whole blocks per query are refused naming responses and queries."""
    batch, result, _, _ = prepared(tokenizer, ALL_STOP, mask_truncated=False)
    result.responses = result.responses[:5]
    with pytest.raises(ValueError, match=r"result\.responses: 5 responses do not map onto 6 batch\.queries"):
        open_instruct_adapter.to_samples(batch, result)


def test_log_batch_never_raises_into_training(tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The hook logs a prepared batch at the training step; a batch it cannot convert is counted."""
    batch, result, advantages, before = prepared(tokenizer, TRUNCATED, mask_truncated=True)
    caplog.set_level(logging.WARNING, logger="asynctrace")
    sink = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[sink]) as session:
        accepted = open_instruct_adapter.log_batch(
            session, batch, result, advantages, step=8, samples_per_prompt=N, finish_reasons=before
        )
        assert accepted == 4
        bad = open_instruct_adapter.log_batch(session, batch, result, step=9, finish_reasons=ALL_STOP)
        assert bad == 0
    stats = session.stats()
    assert stats.written == 4 and stats.dropped["invalid"] == 4 and stats.check()
    assert {record.step for record in sink.records} == {8}
    assert any("open_instruct_adapter.log_batch" in r.getMessage() for r in caplog.records)


def test_a_moved_hook_point_is_named_and_its_rows_counted(tokenizer: Any, hook_warnings: list[str]) -> None:
    """A result whose `responses` another open-instruct version renamed (`response_ids`): the hook
    says so once, naming the commit tested and the field, and counts each row (sized by the
    columns that remain) as invalid; nothing raises into the data preparation loop."""
    batch, result, advantages, _ = prepared(tokenizer, ALL_STOP, mask_truncated=False)
    columns = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    columns["response_ids"] = columns.pop("responses")
    renamed = SimpleNamespace(**columns)
    with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as session:
        assert open_instruct_adapter.log_batch(session, batch, renamed, advantages, step=8) == 0
    stats = session.stats()
    assert stats.dropped["invalid"] == 6 and stats.written == 0 and stats.check()
    moved(hook_warnings, "open_instruct_adapter.log_batch", "commit e6c3044aa620", "result.responses")


def test_end_to_end_into_trackio(tokenizer: Any, project: str) -> None:
    """Given a project name, the hook opens a session; masked train rows keep their own tool output."""
    batch, result, advantages, before = prepared(tokenizer, TRUNCATED, mask_truncated=True)
    eval_batch, eval_result, _, _ = prepared(tokenizer, ALL_STOP, mask_truncated=False)
    open_instruct_adapter.log_batch(
        project, batch, result, advantages, step=8, samples_per_prompt=N, finish_reasons=before
    )
    open_instruct_adapter.log_batch(project, eval_batch, eval_result, step=8, split="eval")
    session = session_for(project, on_full="block", where="test")
    assert isinstance(session, at.SyncTraceSession)
    assert session.finish().written == 10
    traces = read_traces(project, session.run)
    train = [t for t in traces if t["key"] == "train/traces"]
    assert len(train) == 4 and sum(t["key"] == "eval/traces" for t in traces) == 6
    outputs = [f"<output>{row}</output>" for row in (0, 2, 3, 5)]
    assert sorted(t["metadata"]["tool_outputs"] for t in train) == outputs
    for trace in train:
        assert trace["metadata"]["tool_outputs"] in trace["messages"][-1]["content"]


@contextlib.contextmanager
def doc_snippet(request: pytest.FixtureRequest) -> Iterator[tuple[dict[str, Any], Callable[..., None]]]:
    """What docs/frameworks/open_instruct.md's lines find in `_data_preparation_loop` (a step's
    result and batch before masking, the actor as `self`, the advantages the elided lines
    compute) and in `maybe_evaluate`."""
    tokenizer = toy_tokenizer()
    result, batch = generated(tokenizer, TRUNCATED)
    advantages = prepared(tokenizer, TRUNCATED, mask_truncated=True)[2]
    eval_batch, eval_result, _, _ = prepared(tokenizer, ALL_STOP, mask_truncated=False)
    config = SimpleNamespace(mask_truncated_completions=True, num_samples_per_prompt_rollout=N)
    actor = SimpleNamespace(config=config, training_step=8, tokenizer=HFTokenizer(tokenizer))
    names = {
        "self": actor,
        "result": result,
        "batch": batch,
        "advantages": advantages,
        "maybe_mask_truncated_completions": maybe_mask_truncated_completions,
        "eval_batch": eval_batch,
        "eval_result": eval_result,
        "training_step": 8,
        "eval_generation_config": SimpleNamespace(n=N),
    }

    def check(namespace: dict[str, Any]) -> None:
        session = session_for("my-project", on_full="block", where="test")
        assert isinstance(session, at.SyncTraceSession) and session.flush(timeout=60)
        traces = [t for t in read_traces("my-project", session.run) if t["step"] == 8]
        train = [t for t in traces if t["key"] == "train/traces"]
        assert len(train) == 4 and sum(t["key"] == "eval/traces" for t in traces) == 6
        outputs = [f"<output>{row}</output>" for row in (0, 2, 3, 5)]
        assert sorted(t["metadata"]["tool_outputs"] for t in train) == outputs

    yield names, check
