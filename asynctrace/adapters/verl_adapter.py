"""verl: a `DataProto` rollout batch to samples, and `log_batch`, the hook for `RayPPOTrainer`.

Tested on verl 0.9.1. Where the hook goes in ``fit()`` and ``_validate()``, the batch layout and
the field mapping: docs/frameworks/verl.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .._records.types import Sample
from .._sync import SyncTraceSession
from ..rollouts._decode import decode_rollouts
from ._common import jsonable, plain_tokens
from ._hooks import count_invalid, count_rows, deliver, every_row, warn_once
from ._requires import Framework, Need, gaps, refuse
from ._sessions import FAILED, plain_name, start_trainer_session, trainer_session

__all__ = ["log_batch", "open_session", "to_samples"]


_WHERE = "verl_adapter.log_batch"
_FRAMEWORK = Framework("verl", "0.9.1", "verl")
# What `log_batch` reads: the trainer's tokenizer (and step), the DataProto's tensors.
_TRAINER_NEEDS = (Need("tokenizer"),)
_BATCH_NEEDS = (Need("batch", keys=("prompts", "responses", "attention_mask")), Need("non_tensor_batch"))
# Non-tensor columns copied as they are: verl's name -> the metadata key.
_COPIED = (
    ("data_source", "data_source"),
    ("__num_turns__", "verl_num_turns"),
    ("request_id", "request_id"),
    ("stop_reason", "stop_reason"),
)
"""Stored on a trainer whose session could not be opened, so no step tries again."""


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - verl itself needs torch
        raise ImportError(
            "verl_adapter needs torch (install asynctrace[torch], or verl with its dependencies)"
        ) from exc
    return torch


def _column(non_tensor: Mapping[str, Any], name: str, n: int) -> list[Any] | None:
    """A non-tensor column as a list of `n` values, or None where the batch has none."""
    values = non_tensor.get(name)
    if values is None:
        return None
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    if len(values) != n:
        raise ValueError(f"non_tensor_batch[{name!r}]: has {len(values)} values for {n} rows")
    return list(values)


def _version(value: Any) -> int | None:
    """A weight version from `min/max_global_steps` (None where the server reported none)."""
    if hasattr(value, "item"):
        value = value.item()
    return None if value is None else int(value)


def _samples(
    data: Any,
    *,
    tokenizer: Any,
    token_level_scores: Any = None,
    env_role: str = "tool",
    token_fields: Sequence[str] = (),
) -> list[Sample]:
    """`to_samples`, token fields in their compact JSON form (as `log_batch` hands them on)."""
    torch = _torch()
    batch = data.batch
    non_tensor: Mapping[str, Any] = data.non_tensor_batch or {}
    prompts = batch["prompts"]
    responses = batch["responses"]
    attention_mask = batch["attention_mask"]
    n, prompt_width = int(prompts.shape[0]), int(prompts.shape[1])
    response_width = int(responses.shape[1])
    if tuple(attention_mask.shape) != (n, prompt_width + response_width):
        raise ValueError(
            f"attention_mask: shape {tuple(attention_mask.shape)} does not cover prompts "
            f"{tuple(prompts.shape)} and responses {tuple(responses.shape)}"
        )
    keys = set(batch.keys())
    # As verl's compute_response_mask does for trainers that never set it.
    response_mask = batch["response_mask"] if "response_mask" in keys else attention_mask[:, -response_width:]
    response_mask = response_mask.to(attention_mask.device)
    input_ids = torch.cat([prompts, responses], dim=1)
    loss_mask = torch.cat([torch.zeros_like(prompts, dtype=torch.bool), response_mask.bool()], dim=1)
    prompt_lens = attention_mask[:, :prompt_width].sum(dim=1)
    # Response tokens the attention mask leaves out are padding: nothing in them counts.
    valid = response_mask.bool() & attention_mask[:, prompt_width:].bool()

    if token_level_scores is None:
        token_level_scores = next(
            (batch[key] for key in ("token_level_scores", "rm_scores") if key in keys), None
        )
    small: dict[str, Any] = {}
    if token_level_scores is not None:
        small["reward"] = token_level_scores.float().sum(dim=-1)
    if "token_level_rewards" in keys:
        small["sequence_reward"] = batch["token_level_rewards"].float().sum(dim=-1)
    if "advantages" in keys:
        counts = valid.sum(dim=-1)
        total = (batch["advantages"].float() * valid).sum(dim=-1)
        small["advantage"] = torch.where(counts > 0, total / counts.clamp(min=1), torch.nan)
    # Every per-row number crosses to the CPU in one transfer.
    stacked = torch.stack(list(small.values())).cpu().tolist() if small else []
    numbers = dict(zip(small, stacked, strict=True))
    rewards = numbers.pop("reward", None)
    if rewards is not None:
        # A score verl could not compute (NaN) is no reward at all, never a number to rank by.
        rewards = [r if math.isfinite(r) else None for r in rewards]

    samples = decode_rollouts(
        input_ids,
        tokenizer=tokenizer,
        loss_mask=loss_mask,
        attention_mask=attention_mask,
        prompt_lens=prompt_lens,
        rewards=rewards,
        env_role=env_role,
        token_fields=_token_fields(token_fields, batch, keys, input_ids, loss_mask, prompt_width) or None,
    )

    uids = _column(non_tensor, "uid", n)
    group_of: dict[str, int] = {}
    vmin = _column(non_tensor, "min_global_steps", n)
    vmax = _column(non_tensor, "max_global_steps", n)
    copied = [(key, _column(non_tensor, name, n)) for name, key in _COPIED]
    for row, sample in enumerate(samples):
        meta = sample.metadata
        for key, values in numbers.items():
            value = float(values[row])
            if math.isfinite(value):  # a row with no response token has no advantage
                meta[key] = value
        if uids is not None:
            # balance_batch reorders the rows: a prompt's rows are found by uid, never by position.
            uid = str(uids[row])
            meta["group_uid"] = uid
            meta["prompt_index"] = group_of.setdefault(uid, len(group_of))
        low = _version(vmin[row]) if vmin is not None else None
        high = _version(vmax[row]) if vmax is not None else None
        if low is not None or high is not None:
            meta["policy_version_min"] = low if low is not None else high
            meta["policy_version_max"] = high if high is not None else low
        for key, values in copied:
            if values is not None and values[row] is not None:
                meta[key] = jsonable(values[row])
    return samples


def to_samples(
    data: Any,
    *,
    tokenizer: Any,
    token_level_scores: Any = None,
    env_role: str = "tool",
    token_fields: Sequence[str] = (),
) -> list[Sample]:
    """One sample per row of a verl `DataProto`, in the batch's row order.

    Messages: the prompt (its real tokens, decoded) as the user turn, then the response cut
    into `assistant` turns (``response_mask`` 1) and `env_role` turns (0: tool output a
    multi-turn agent loop appended). All text is decoded in one tokenizer call.

    `reward` sums ``token_level_scores`` over the response: pass `token_level_scores=` where
    the batch does not hold them yet, as in ``_validate`` (else ``rm_scores`` is used). Every
    metadata field and the batch key it comes from: docs/frameworks/verl.md.

    `token_fields` names per-token arrays to keep with each sample (`Sample.tokens`, over its
    real tokens, prompt first): ``token_ids``, ``loss_mask`` (the response mask, 0 on the
    prompt), ``logprobs`` (``old_log_probs``, else ``rollout_log_probs``) and ``advantages``;
    the last two are NaN over the prompt, where verl has none. Each is a list of numbers.
    """
    return plain_tokens(
        _samples(
            data,
            tokenizer=tokenizer,
            token_level_scores=token_level_scores,
            env_role=env_role,
            token_fields=token_fields,
        )
    )


# verl's per-token keys for each token field over the response, in order of preference.
_RESPONSE_KEYS = {"logprobs": ("old_log_probs", "rollout_log_probs"), "advantages": ("advantages",)}


def _token_fields(
    names: Sequence[str], batch: Any, keys: set[str], input_ids: Any, loss_mask: Any, prompt_width: int
) -> dict[str, Any]:
    """The per-token arrays named in `names`, each shaped like `input_ids` (prompt, then response)."""
    torch = _torch()
    if isinstance(names, str):
        raise ValueError(f"token_fields: expected a list of names, got the string {names!r}")
    fields: dict[str, Any] = {}
    for name in names:
        if name == "token_ids":
            fields[name] = input_ids
        elif name == "loss_mask":
            fields[name] = loss_mask
        elif name in _RESPONSE_KEYS:
            key = next((k for k in _RESPONSE_KEYS[name] if k in keys), None)
            if key is None:
                raise ValueError(
                    f"token_fields: {name!r} needs one of {list(_RESPONSE_KEYS[name])} in the batch"
                )
            values = batch[key].float()
            prompt = torch.full((values.shape[0], prompt_width), math.nan, device=values.device)
            fields[name] = torch.cat([prompt, values], dim=1)
        else:
            raise ValueError(
                f"token_fields: {name!r} is not one of ['advantages', 'logprobs', 'loss_mask', 'token_ids']"
            )
    return fields


def open_session(trainer: Any, **kwargs: Any) -> SyncTraceSession:
    """A blocking session for `trainer`, named after its ``trainer.project_name`` and ``experiment_name``.

    It is finished at interpreter exit (and drained on SIGTERM/SIGINT when opened on the main
    thread). `kwargs` go to `TraceSession` (defaults: 64 traces per step, best and worst by
    reward). Stored on the trainer, where `log_batch` finds it.
    """
    config = getattr(getattr(trainer, "config", None), "trainer", None)
    project = plain_name(getattr(config, "project_name", None)) or "verl"
    run = plain_name(getattr(config, "experiment_name", None))
    return start_trainer_session(trainer, project, run, **kwargs)


def log_batch(
    trainer: Any,
    batch: Any,
    *,
    split: str = "train",
    token_level_scores: Any = None,
    step: int | None = None,
    session: Any = None,
    token_fields: Sequence[str] = (),
) -> int:
    """Log one verl batch from inside `RayPPOTrainer`; never raises. Returns the samples accepted.

    `trainer` gives the tokenizer (``trainer.tokenizer``), the step (``trainer.global_steps``,
    unless `step` is given) and the session: `session`, else ``trainer.asynctrace_session``,
    else one `open_session` opens on the first call. Rows that cannot be converted are
    counted in ``session.stats().dropped["invalid"]``, with one warning. `token_fields`: as in
    `to_samples`.
    """
    rows: int | None = None
    try:
        if session is None:
            session = trainer_session(trainer, open_session)
        if session is FAILED:
            return 0
        rows = count_rows(
            lambda: len(batch), lambda: batch.batch["responses"], lambda: batch.batch["input_ids"]
        )
        needs = _TRAINER_NEEDS if step is not None else (*_TRAINER_NEEDS, Need("global_steps"))
        problems = gaps(trainer, needs, type(trainer).__name__) + gaps(batch, _BATCH_NEEDS, "batch")
        if problems:
            return refuse(_FRAMEWORK, _WHERE, problems, session, rows)
        at_step = int(trainer.global_steps if step is None else step)
        tokenizer = trainer.tokenizer
    except Exception as exc:  # telemetry must never stop training
        warn_once(_WHERE, f"could not start logging ({type(exc).__name__}: {exc})")
        if session is not None and session is not FAILED:
            # Rows that cannot be counted are at least one.
            count_invalid(session, 1 if rows is None else rows)
        return 0
    convert = every_row(
        _samples,
        batch,
        tokenizer=tokenizer,
        token_level_scores=token_level_scores,
        token_fields=token_fields,
    )
    return deliver(session, convert, rows=rows, step=at_step, split=split, where=_WHERE)
