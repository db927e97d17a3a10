"""open-instruct: a `Batch` and its `GenerationResult` to samples, and `log_batch`, the hook.

The hook goes in `DataPreparationActor._data_preparation_loop` (open_instruct/data_loader.py),
with the finish reasons taken before `maybe_mask_truncated_completions`: docs/frameworks/open_instruct.md.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._records.types import Sample
from ..rollouts._align import MISSING, Shortfall
from ..rollouts._mapping import prompt_indices
from ..rollouts._turns import mask_runs, split_turns
from ._common import Message, SampleBuilder, as_sequence, field, jsonable, token_list
from ._hooks import count_rows, deliver, every_row
from ._requires import Framework, Need, gaps, refuse
from ._sessions import session_for

if TYPE_CHECKING:
    from .._session import TraceSession
    from .._sync import SyncTraceSession

__all__ = ["log_batch", "to_samples"]

_WHERE = "open_instruct_adapter.to_samples"
_FRAMEWORK = Framework("open-instruct", "commit e6c3044aa620")
# What `log_batch` reads of open-instruct's `Batch` and `GenerationResult` (dataclass fields,
# None where unset).
_BATCH_NEEDS = tuple(
    Need(name)
    for name in (
        "queries",
        "raw_queries",
        "decoded_responses",
        "scores",
        "datasets",
        "indices",
        "ground_truths",
    )
)
_RESULT_NEEDS = tuple(Need(name) for name in ("responses", "masks", "finish_reasons", "request_info"))

# Per-sample lists of `GenerationResult.request_info`, kept under their own names.
_REQUEST_INFO = ("num_calls", "timeouts", "tool_errors", "tool_outputs", "tool_runtimes", "tool_calleds")


def log_batch(
    session: TraceSession | SyncTraceSession | str,
    batch: Any,
    result: Any,
    advantages: Sequence[float] | None = None,
    *,
    step: int,
    samples_per_prompt: int | None = None,
    finish_reasons: Sequence[str] | None = None,
    tokenizer: Any = None,
    split: str = "train",
) -> int:
    """Log one prepared batch from open-instruct's data preparation loop; never raises.

    `session` is an open session, or a project name: the first call then opens the process's
    session for it (`TraceSession(project).start()`, finished at exit). Returns the samples
    accepted. A batch that cannot be converted is counted in `session.stats().dropped["invalid"]`,
    with one warning, and training goes on.
    """
    where = "open_instruct_adapter.log_batch"
    # open-instruct prepares batches on its own thread: waiting for room there holds no trainer.
    target = session_for(session, on_full="block", where=where)
    if target is None:
        return 0
    # Any per-response column sizes the batch, so that one whose `responses` field is missing
    # (renamed in another open-instruct version) is still counted in full when it fails.
    rows = count_rows(
        lambda: field(result, "responses"),
        lambda: field(result, "masks"),
        lambda: field(result, "finish_reasons"),
        lambda: field(result, "logprobs"),
        lambda: advantages,
        lambda: field(batch, "queries"),
    )
    problems = [
        problem
        for value, needs, name in ((batch, _BATCH_NEEDS, "batch"), (result, _RESULT_NEEDS, "result"))
        if not isinstance(value, Mapping)  # a dict is read by its keys (`field`)
        for problem in gaps(value, needs, name)
    ]
    if problems:
        return refuse(_FRAMEWORK, where, problems, target, rows)
    convert = every_row(
        to_samples,
        batch,
        result,
        samples_per_prompt=samples_per_prompt,
        advantages=advantages,
        finish_reasons=finish_reasons,
        tokenizer=tokenizer,
    )
    return deliver(target, convert, rows=rows, step=step, split=split, where=where)


def to_samples(
    batch: Any,
    result: Any,
    *,
    samples_per_prompt: int | None = None,
    advantages: Sequence[float] | None = None,
    finish_reasons: Sequence[str] | None = None,
    tokenizer: Any = None,
    env_role: str = "tool",
) -> list[Sample]:
    """One sample per response of `result`, with its prompt from `batch`.

    open-instruct's `Batch` holds one entry per response (each prompt repeated
    `samples_per_prompt` times, in blocks); one entry per prompt is accepted too. `prompt_index`
    is the response's position before truncation masking `// samples_per_prompt` (left out when
    `samples_per_prompt` is not given, or when rows were masked and `finish_reasons` from before
    the masking are not given). The other metadata: docs/frameworks/open_instruct.md.
    """
    queries = as_sequence(field(batch, "queries"), "batch.queries")
    responses = as_sequence(field(result, "responses"), "result.responses")
    n = len(responses)
    if n and (not queries or n % len(queries)):
        # Checked here: the generic mapping error would point at arguments this function lacks.
        raise ValueError(
            f"result.responses: {n} responses do not map onto {len(queries)} batch.queries "
            "(give one query per response, or the same number of responses for every query)"
        )
    if samples_per_prompt is not None and samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt: must be at least 1, got {samples_per_prompt}")
    per_row = len(queries) == n
    row_of = prompt_indices(n_prompts=len(queries), n_samples=n) if n else []
    request_info = field(result, "request_info")
    kept = _kept_rows(finish_reasons, n)
    origin = _OriginalRows(n, kept, request_info)

    short = Shortfall(_WHERE, n)
    raw_queries = field(batch, "raw_queries")
    decoded = field(batch, "decoded_responses")
    masks = field(result, "masks")
    scores = field(batch, "scores")
    reward_scores = field(result, "reward_scores")
    model_steps = field(batch, "model_steps")
    info_columns = [(name, field(request_info, name)) for name in _REQUEST_INFO]
    call_stats = field(request_info, "tool_call_stats")

    builder = SampleBuilder()
    for i in range(n):
        p = row_of[i]
        # Batch lists are aligned with `queries`; result lists with the responses.
        messages: list[Message] = []
        prompt = short.pick(raw_queries, p, "raw_queries")
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages.append(("user", builder.texts.add(token_list(queries[p]), shared=True)))
        messages += _response_turns(
            short.pick(decoded, i, "decoded_responses"),
            responses[i],
            short.pick(masks, i, "masks"),
            tokenizer is not None,
            env_role,
            builder,
        )

        metadata: dict[str, Any] = {"sample_index": i}
        if not per_row:
            metadata["prompt_index"] = p
        elif samples_per_prompt is not None and origin.known:
            metadata["prompt_index"] = origin.row(i) // samples_per_prompt
        reward = short.pick(scores, i, "scores")
        if reward is MISSING or reward is None:
            reward = origin.pick(reward_scores, i, "reward_scores", short)
        if reward is not MISSING and reward is not None:
            metadata["reward"] = float(reward)
        step = short.pick(model_steps, i, "model_steps")
        if step is not MISSING and step is not None:
            metadata["model_step"] = int(step)
        for key, name, column, index in (
            ("advantage", "advantages", advantages, i),
            ("stop_reason", "finish_reasons", field(result, "finish_reasons"), i),
            ("dataset", "datasets", field(batch, "datasets"), p),
            ("dataset_index", "indices", field(batch, "indices"), p),
            ("ground_truth", "ground_truths", field(batch, "ground_truths"), p),
            ("active_tools", "active_tools", field(batch, "active_tools"), p),
        ):
            value = short.pick(column, index, name)
            if value is not MISSING and value is not None:
                metadata[key] = jsonable(value)
        for name, column in info_columns:
            value = origin.pick(column, i, name, short)
            if value is not MISSING and value is not None:
                metadata[name] = jsonable(value)
        stats = origin.pick(call_stats, i, "tool_call_stats", short)
        if isinstance(stats, (list, tuple)) and stats:
            metadata["tool_call_stats"] = [_plain(s) for s in stats]
        builder.add(messages, metadata)
    short.warn()
    origin.warn()
    return builder.build(tokenizer, _WHERE)


def _kept_rows(finish_reasons: Sequence[str] | None, n: int) -> list[int] | None:
    """The rows `maybe_mask_truncated_completions` kept, from the finish reasons before it ran."""
    if finish_reasons is None:
        return None
    reasons = list(finish_reasons)
    if len(reasons) == n:
        return list(range(n))
    # open-instruct keeps exactly the rows that finished with "stop" (data_loader.py).
    kept = [j for j, reason in enumerate(reasons) if reason == "stop"]
    if len(kept) != n:
        raise ValueError(
            f"finish_reasons: {len(reasons)} rows of which {len(kept)} finished with 'stop', for {n} "
            "responses (take them from result.finish_reasons right before maybe_mask_truncated_completions)"
        )
    return kept


class _OriginalRows:
    """Reads the result's columns that truncation masking leaves unfiltered, each on its own row."""

    __slots__ = ("_kept", "_misaligned", "_n")

    def __init__(self, n: int, kept: list[int] | None, request_info: Any) -> None:
        self._n = n
        self._kept = kept
        self._misaligned: dict[str, int] = {}
        if kept is None:
            # request_info always has one entry per generated row (vllm_utils fills defaults), so
            # a longer column means rows were masked out after it was built.
            for name in _REQUEST_INFO:
                column = field(request_info, name)
                if column is not None and len(column) > n:
                    self._misaligned[name] = len(column)

    @property
    def known(self) -> bool:
        """Whether each row's position before masking is known."""
        return self._kept is not None or not self._misaligned

    def row(self, i: int) -> int:
        """Row `i`'s position in the batch before truncation masking."""
        return self._kept[i] if self._kept is not None else i

    def pick(self, column: Sequence[Any] | None, i: int, name: str, short: Shortfall) -> Any:
        """Row `i`'s value of an unfiltered column, or MISSING when it cannot be placed."""
        if column is None or not len(column):
            return MISSING
        if len(column) == self._n:
            return column[i]
        if self._kept is not None and len(column) > self._kept[-1]:
            return column[self._kept[i]]
        if len(column) > self._n:
            self._misaligned.setdefault(name, len(column))
            return MISSING
        return short.pick(column, i, name)

    def warn(self) -> None:
        if not self._misaligned:
            return
        have = max(self._misaligned.values())
        names = ", ".join(self._misaligned)
        warnings.warn(
            f"{_WHERE}: result.request_info has {have} rows for {self._n} responses ({names}) "
            "(maybe_mask_truncated_completions filters the responses but not request_info or "
            "reward_scores): their fields, and prompt_index, are left out rather than put on other "
            "rows; pass finish_reasons= taken before the masking to keep them",
            UserWarning,
            stacklevel=3,
        )


def _plain(value: Any) -> Any:
    """A `ToolCallStats` (a dataclass) as a dict; anything else as JSON data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    return jsonable(value)


def _response_turns(
    text: Any, tokens: Any, mask: Any, can_decode: bool, env_role: str, builder: SampleBuilder
) -> list[Message]:
    """The response as one assistant message, or as assistant and tool turns when masks show tools."""
    ids = token_list(tokens)
    runs = mask_runs(mask) if mask is not MISSING and mask is not None else None
    if runs is not None and len(mask) != len(ids):
        raise ValueError(f"result.masks: a row has {len(mask)} values for {len(ids)} response tokens")
    has_tools = runs is not None and any(not generated for _, _, generated in runs)
    if isinstance(text, str) and not (has_tools and can_decode):
        return [{"role": "assistant", "content": text}]
    if not ids:
        # An empty response is still the policy's answer: it gets its (empty) turn, as with text.
        return [{"role": "assistant", "content": ""}]
    turns = split_turns(ids, runs if has_tools else None, 0, env_role, builder.texts)
    return list(turns.turns)
