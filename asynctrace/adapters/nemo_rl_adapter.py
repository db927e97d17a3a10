"""NeMo RL: a GRPO step's `repeated_batch` (+ `train_data`) to samples, and `log_step`, its hook.

Tested on NVIDIA-NeMo/RL at commit 7ea279a. Where the line goes in ``grpo_train``, the batch
layout and the field mapping: docs/frameworks/nemo_rl.md.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._records.types import Sample
from ._common import as_sequence, jsonable, role_name, token_list
from ._hooks import Converted, count_invalid, deliver, warn_once
from ._requires import Framework, Need, gaps, refuse
from ._sessions import session_for

if TYPE_CHECKING:
    from .._session import TraceSession
    from .._sync import SyncTraceSession

__all__ = ["log_step", "to_samples"]

_WHERE = "nemo_rl_adapter.log_step"
# Message keys that are per-token tensors (or NeMo's own bookkeeping), never message text.
_TOKEN_KEYS = frozenset({"token_ids", "generation_logprobs", "token_loss_mask", "routed_experts"})
# Chat keys kept with a message where a message carries them (tool calls and their answers).
_CHAT_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning_content")
_TOKEN_FIELDS = ("token_ids", "loss_mask", "logprobs", "advantages")
_FRAMEWORK = Framework("NeMo RL", "commit 7ea279abfbeb")
# What `log_step` reads of `grpo_train`'s batches (BatchedDataDicts: read by key).
_BATCH_NEEDS = (Need("", keys=("message_log", "length", "total_reward")),)
_TRAIN_DATA_NEEDS = (Need("", keys=("advantages",)),)


def _column(batch: Any, name: str, n: int) -> list[Any] | None:
    """A per-sample column of the batch as a list of `n` values, or None where it has none."""
    values = batch.get(name) if isinstance(batch, Mapping) else None
    if values is None:
        return None
    values = as_sequence(values, name)
    if len(values) != n:
        raise ValueError(f"repeated_batch[{name!r}]: has {len(values)} values for {n} samples")
    return list(values)


def _floats(value: Any) -> list[float]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [float(v) for v in value]


def _scalar(value: Any) -> float | None:
    if hasattr(value, "item"):
        value = value.item()
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def prompt_group(prompt_token_ids: Sequence[int]) -> str:
    """The group id of a prompt: NeMo RL's GRPO baseline groups samples by identical prompt tokens."""
    data = ",".join(str(int(t)) for t in prompt_token_ids).encode()
    return hashlib.sha1(data, usedforsecurity=False).hexdigest()[:16]


def _prompt_count(message_log: Sequence[Any], length: int) -> int:
    """How many leading messages are the prompt: NeMo's `extract_initial_prompt_messages` rule."""
    count, total = 0, 0
    for message in message_log:
        if total >= length:
            break
        count += 1
        total += len(token_list(message["token_ids"]))
    return count


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    out = {"role": role_name(message.get("role", "user")), "content": jsonable(message.get("content", ""))}
    for key in _CHAT_KEYS:
        if message.get(key) is not None:
            out[key] = jsonable(message[key])
    return out


def _row_tokens(
    message_log: Sequence[Mapping[str, Any]],
) -> tuple[list[int], list[int], list[float]]:
    """A sample's token ids, loss mask and generation log-probs, message after message.

    The mask is NeMo's `token_loss_mask` where the message has one, else its own rule: the tokens
    of an assistant message that carries `generation_logprobs` (one the rollout generated).
    """
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for message in message_log:
        tokens = token_list(message["token_ids"])
        generated = message.get("generation_logprobs")
        own = message.get("token_loss_mask")
        if own is not None:
            row_mask = [int(bool(m)) for m in token_list(own)]
        else:
            trains = role_name(message.get("role")) == "assistant" and generated is not None
            row_mask = [int(trains)] * len(tokens)
        values = _floats(generated) if generated is not None else [0.0] * len(tokens)
        if len(row_mask) != len(tokens) or len(values) != len(tokens):
            raise ValueError(
                f"message {role_name(message.get('role'))!r}: {len(tokens)} tokens, "
                f"{len(row_mask)} mask values and {len(values)} log-probs"
            )
        ids += tokens
        mask += row_mask
        logprobs += values
    return ids, mask, logprobs


def _trained_segments(message_log: Sequence[Mapping[str, Any]]) -> tuple[int, list[tuple[int, int, Any]]]:
    """A sample's token count, and `(start, end, mask)` of each message that trains.

    `mask` is the message's own `token_loss_mask`, or None where NeMo's rule trains every token
    (an assistant message the rollout generated, with `generation_logprobs`). Nothing is turned
    into lists: a summary needs only the lengths.
    """
    segments: list[tuple[int, int, Any]] = []
    start = 0
    for message in message_log:
        n = len(message["token_ids"])
        generated = message.get("generation_logprobs")
        own = message.get("token_loss_mask")
        if (own is not None and len(own) != n) or (generated is not None and len(generated) != n):
            raise ValueError(
                f"message {role_name(message.get('role'))!r}: masks or log-probs do not match its tokens"
            )
        if own is not None:
            segments.append((start, start + n, own))
        elif role_name(message.get("role")) == "assistant" and generated is not None:
            segments.append((start, start + n, None))
        start += n
    return start, segments


def _mean_advantage(row: Any, total: int, segments: list[tuple[int, int, Any]]) -> float | None:
    """The mean of a row's advantages over its trained tokens; over all its tokens where none
    trains (an empty generation: NeMo RL's advantage row, and its own dump, still hold the
    sample's value, which GRPO spreads over every token); None for a row without tokens."""
    if len(row) < total:
        raise ValueError(f"advantages: {len(row)} values for {total} tokens")
    total_value, count = 0.0, 0
    for start, end, mask in segments:
        part = row[start:end]
        if _is_array(part) and (mask is None or _is_array(mask)):
            # Tensors or arrays: summed where they live, two numbers cross over.
            kept = part if mask is None else part[mask != 0]
            total_value += float(kept.sum())
            count += end - start if mask is None else int((mask != 0).sum())
            continue
        flags = [1] * (end - start) if mask is None else token_list(mask)
        values = [v for v, m in zip(_floats(part), flags, strict=True) if m]
        total_value += sum(values)
        count += len(values)
    if count:
        return total_value / count
    if not total:
        return None
    whole = row[:total]
    return (float(whole.sum()) if _is_array(whole) else sum(_floats(whole))) / total


def _is_array(value: Any) -> bool:
    """A tensor or an array (sliced, masked and summed in place), not a list."""
    return hasattr(value, "sum") and hasattr(value, "shape")


def _row(
    i: int,
    message_log: Any,
    length: int,
    advantages: Any,
    token_fields: Sequence[str],
) -> tuple[Sample, tuple[int, ...]]:
    """One sample (without its batch-wide metadata) and its prompt tokens."""
    if not isinstance(message_log, Sequence) or not all(isinstance(m, Mapping) for m in message_log):
        raise ValueError(f"message_log[{i}]: expected a list of message dicts")
    n_prompt = _prompt_count(message_log, length)
    total, segments = _trained_segments(message_log)
    prompt_tokens = tuple(t for m in message_log[:n_prompt] for t in token_list(m["token_ids"]))
    metadata: dict[str, Any] = {
        "prompt_len": len(prompt_tokens),
        "response_len": total - len(prompt_tokens),
        "num_turns": sum(
            1
            for m in message_log[n_prompt:]
            if role_name(m.get("role")) == "assistant" and m.get("generation_logprobs") is not None
        ),
    }
    if advantages is not None:
        advantage = _mean_advantage(advantages[i], total, segments)
        if advantage is not None and math.isfinite(advantage):
            metadata["advantage"] = advantage
    tokens: dict[str, Any] = {}
    if token_fields:
        ids, mask, logprobs = _row_tokens(message_log)
        columns = {"token_ids": ids, "loss_mask": mask, "logprobs": logprobs}
        if advantages is not None:
            columns["advantages"] = _floats(advantages[i][:total])
        tokens = {name: columns[name] for name in token_fields}
    sample = Sample(messages=[_message(m) for m in message_log], metadata=metadata, tokens=tokens or None)
    return sample, prompt_tokens


def _convert(
    repeated_batch: Any,
    train_data: Any,
    policy_version: int | None,
    token_fields: Sequence[str],
) -> Converted:
    """The samples of one step and how many rows could not be converted."""
    if isinstance(token_fields, str) or not set(token_fields) <= set(_TOKEN_FIELDS):
        raise ValueError(f"token_fields: expected names from {list(_TOKEN_FIELDS)}, got {token_fields!r}")
    logs = as_sequence(field_of(repeated_batch, "message_log"), "repeated_batch['message_log']")
    n = len(logs)
    lengths = _column(repeated_batch, "length", n)
    if lengths is None:
        raise ValueError("repeated_batch['length']: is required (the prompt's token count per sample)")
    rewards = _column(repeated_batch, "total_reward", n)
    columns = {
        key: _column(repeated_batch, name, n)
        for name, key in (
            ("filtered_reward", "filtered_reward"),
            ("idx", "dataset_idx"),
            ("task_name", "task_name"),
            ("truncated", "truncated"),
            ("loss_multiplier", "loss_multiplier"),
        )
    }
    advantages = field_of(train_data, "advantages") if train_data is not None else None
    if advantages is not None and len(advantages) != n:
        raise ValueError(f"train_data['advantages']: has {len(advantages)} rows for {n} samples")
    if "advantages" in token_fields and advantages is None:
        raise ValueError("token_fields: 'advantages' needs train_data with its 'advantages'")

    samples: list[Sample] = []
    skipped = 0
    groups: dict[tuple[int, ...], int] = {}
    for i, message_log in enumerate(logs):
        try:
            sample, prompt_tokens = _row(i, message_log, int(lengths[i]), advantages, token_fields)
        except (ValueError, TypeError, KeyError, IndexError):
            skipped += 1  # one bad row leaves the others to be logged
            continue
        meta = sample.metadata
        meta["sample_index"] = i
        meta["prompt_index"] = groups.setdefault(prompt_tokens, len(groups))
        meta["group_uid"] = prompt_group(prompt_tokens)
        if rewards is not None:
            reward = _scalar(rewards[i])
            if reward is not None:
                meta["reward"] = reward
        for key, values in columns.items():
            if values is None or values[i] is None:
                continue
            value = values[i]
            if key in ("filtered_reward", "loss_multiplier"):
                value = _scalar(value)
            elif key == "truncated":
                value = bool(value.item() if hasattr(value, "item") else value)
            else:
                value = jsonable(value.item() if hasattr(value, "item") else value)
            if value is not None:
                meta[key] = value
        if policy_version is not None:
            meta["policy_version"] = int(policy_version)
        samples.append(sample)
    return samples, skipped


def field_of(batch: Any, name: str) -> Any:
    """`batch[name]` of a `BatchedDataDict` (a `UserDict`) or a dict; None where it is missing."""
    return batch.get(name) if isinstance(batch, Mapping) else None


def to_samples(
    repeated_batch: Any,
    train_data: Any = None,
    *,
    policy_version: int | None = None,
    token_fields: Sequence[str] = (),
) -> list[Sample]:
    """One sample per rollout of a GRPO step, in the batch's order; rows it cannot read are left out.

    `repeated_batch` is ``grpo_train``'s batch after the rollout (its `message_log`, `length`,
    `total_reward`, `idx`, `task_name`, ...); `train_data` gives the advantages. Every message
    keeps its role and content; samples with identical prompt tokens share a `group_uid`, as
    they share NeMo RL's GRPO baseline. `token_fields` keeps per-token ``token_ids``,
    ``loss_mask``, ``logprobs`` (generation log-probs) and ``advantages`` with each sample.
    The mapping: docs/frameworks/nemo_rl.md.
    """
    return list(_convert(repeated_batch, train_data, policy_version, token_fields)[0])


def log_step(
    session: TraceSession | SyncTraceSession | str,
    repeated_batch: Any,
    train_data: Any = None,
    *,
    step: int,
    policy_version: int | None = None,
    split: str = "train",
    token_fields: Sequence[str] = (),
) -> int:
    """Log one GRPO step of NeMo RL's ``grpo_train``; never raises. Returns the samples accepted.

    `session` is an open session, or a project name: the first call then opens the process's
    session for it (`TraceSession(project, on_full="block").start()`, finished at exit), as
    ``grpo_train`` runs synchronously in the driver. Rows that cannot be converted are counted
    in ``session.stats().dropped["invalid"]``, with one warning.
    """
    target = session_for(session, on_full="block", where=_WHERE)
    if target is None:
        return 0
    try:
        rows = len(repeated_batch["message_log"])
    except Exception:  # nothing to count rows by: counted as one
        rows = 1
    try:
        at_step = int(step)
    except Exception as exc:  # telemetry must never stop training
        warn_once(_WHERE, f"step {step!r} is not an integer ({exc})")
        count_invalid(target, rows)
        return 0
    if isinstance(repeated_batch, Mapping):
        # Anything else is no batch at all (refused by the conversion, with its own message).
        problems = gaps(repeated_batch, _BATCH_NEEDS, "repeated_batch")
        if isinstance(train_data, Mapping):
            problems += gaps(train_data, _TRAIN_DATA_NEEDS, "train_data")
        if problems:
            return refuse(_FRAMEWORK, _WHERE, problems, target, rows)

    def convert() -> Converted:
        return _convert(repeated_batch, train_data, policy_version, token_fields)

    return deliver(target, convert, rows=rows, step=at_step, split=split, where=_WHERE)
