"""OpenRLHF: the `Experience` batches of `BasePPOTrainer.train_step` to samples, and the hooks.

Tested on openrlhf 0.11.2. OpenRLHF has no callback API: `log_train_batch` goes in
``train_step`` right after ``make_experience_batch``, `log_eval_samples` in ``evaluate``
(docs/frameworks/openrlhf.md). Both never raise into training; `to_samples` is the raising form.
"""

from __future__ import annotations

import functools
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

__all__ = ["log_eval_samples", "log_train_batch", "open_session", "to_samples"]

_FRAMEWORK = Framework("OpenRLHF", "0.11.2", "openrlhf")
# What the hooks read of an `Experience` (its dataclass fields, None where unset).
_EXPERIENCE_NEEDS = tuple(
    Need(name)
    for name in (
        "sequences",
        "attention_mask",
        "action_mask",
        "advantages",
        "rewards",
        "info",
        "index",
        "labels",
        "truncated",
    )
)
# Its fields with one entry per row, that size a batch (most reliable first).
_PER_ROW = ("sequences", "attention_mask", "action_mask", "advantages", "rewards")
# `Experience.info` keys OpenRLHF itself fills; any other key is an agent's `extra_logs` entry.
_OWN_INFO = ("reward", "score", "response_clip_ratio", "kl", "logprobs_diff", "group_reward_std", "return")
# Each token field a caller may ask for, and the `Experience` fields it is read from, in order
# of preference (all but the first two are over `sequences[:, 1:]`, one token short).
_TOKEN_SOURCES: dict[str, tuple[str, ...]] = {
    "token_ids": (),
    "loss_mask": (),
    "logprobs": ("rollout_log_probs", "action_log_probs"),
    "advantages": ("advantages",),
}
"""Stored on a trainer whose session could not be opened, so no step tries again."""


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - OpenRLHF itself needs torch
        raise ImportError("openrlhf_adapter needs torch (install asynctrace[torch])") from exc
    return torch


def _experiences(experiences: Any) -> list[Any]:
    if isinstance(experiences, (list, tuple)):
        return list(experiences)
    if experiences is None or isinstance(experiences, (str, bytes, Mapping)):
        raise ValueError(
            f"experiences: expected a list of OpenRLHF Experience, got {type(experiences).__name__}"
        )
    return [experiences]


def _rows(experience: Any) -> int:
    sequences = getattr(experience, "sequences", None)
    if sequences is None or getattr(sequences, "dim", lambda: 0)() != 2:
        raise ValueError("Experience.sequences: expected a 2-D tensor (samples x tokens)")
    return int(sequences.shape[0])


def _per_row(value: Any, rows: int, name: str) -> list[Any] | None:
    """A per-sample value of one Experience as a list of `rows` Python values (None if absent)."""
    if value is None:
        return None
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, list):
        return None
    if len(value) != rows:
        raise ValueError(f"{name}: has {len(value)} values for {rows} rows")
    return value


def _extra(value: Any, rows: int) -> list[Any] | None:
    """An agent's `extra_logs` entry as one value per row; None where it is not one (it is left out)."""
    try:
        return _per_row(value, rows, "info")
    except ValueError:
        return None


def _shifted(values: Any, width: int) -> Any:
    """An (B, T-1) action-aligned tensor on `sequences`' (B, T) grid: NaN at position 0 and past the end."""
    torch = _torch()
    values = values.float()
    out = torch.full((values.shape[0], width), math.nan, dtype=torch.float32, device=values.device)
    n = min(int(values.shape[1]), width - 1)
    out[:, 1 : 1 + n] = values[:, :n]
    return out


def _pad(value: Any, width: int, fill: float) -> Any:
    torch = _torch()
    if int(value.shape[1]) == width:
        return value
    return torch.nn.functional.pad(value, (0, width - int(value.shape[1])), value=fill)


def _samples(
    experiences: Any,
    *,
    tokenizer: Any,
    samples_per_prompt: int,
    env_role: str = "tool",
    token_fields: Sequence[str] = (),
    policy_version: int | None = None,
) -> list[Sample]:
    """`to_samples`, token fields in their compact JSON form (as the hooks hand them on)."""
    torch = _torch()
    if (
        isinstance(samples_per_prompt, bool)
        or not isinstance(samples_per_prompt, int)
        or samples_per_prompt < 1
    ):
        raise ValueError(f"samples_per_prompt: expected a positive int, got {samples_per_prompt!r}")
    if isinstance(token_fields, str) or any(name not in _TOKEN_SOURCES for name in token_fields):
        raise ValueError(f"token_fields: expected names from {list(_TOKEN_SOURCES)}, got {token_fields!r}")
    batch = _experiences(experiences)
    if not batch:
        return []
    width = max(int(e.sequences.shape[1]) for e in batch)
    ids_parts, attention_parts, mask_parts = [], [], []
    field_parts: dict[str, list[Any]] = {name: [] for name in token_fields}
    metadata: dict[str, list[Any]] = {
        "prompt_index": [],
        "rollout_index": [],
        "advantage": [],
        "label": [],
        "truncated": [],
        "score": [],
        "group_reward_std": [],
        "openrlhf_info": [],
    }
    rewards: list[float | None] = []
    position = 0
    for k, experience in enumerate(batch):
        rows = _rows(experience)
        sequences = experience.sequences
        attention = experience.attention_mask
        action = experience.action_mask
        if attention is None or action is None:
            raise ValueError(f"experiences[{k}]: needs attention_mask and action_mask")
        if tuple(attention.shape) != tuple(sequences.shape):
            raise ValueError(
                f"experiences[{k}].attention_mask: shape {tuple(attention.shape)} does not match "
                f"sequences {tuple(sequences.shape)}"
            )
        # action_mask[t] says whether token t + 1 was generated: put it back on its token.
        generated = _shifted(action, int(sequences.shape[1])).nan_to_num(0.0).bool()
        ids_parts.append(_pad(sequences, width, 0))
        attention_parts.append(_pad(attention, width, 0))
        mask_parts.append(_pad(generated, width, False))
        for name in token_fields:
            if name == "token_ids":
                field_parts[name].append(_pad(sequences, width, 0))
            elif name == "loss_mask":
                field_parts[name].append(_pad(generated, width, False))
            else:
                source = next(
                    (s for s in _TOKEN_SOURCES[name] if getattr(experience, s, None) is not None), None
                )
                if source is None:
                    raise ValueError(
                        f"token_fields: {name!r} needs one of {list(_TOKEN_SOURCES[name])} "
                        f"in experiences[{k}]"
                    )
                field_parts[name].append(
                    _pad(_shifted(getattr(experience, source), int(sequences.shape[1])), width, math.nan)
                )

        info = experience.info or {}
        index = experience.index
        if index is not None and len(index) != rows:
            raise ValueError(f"experiences[{k}].index: has {len(index)} values for {rows} rows")
        order = list(index) if index is not None else list(range(position, position + rows))
        position += rows
        raw = _per_row(info.get("reward"), rows, f"experiences[{k}].info['reward']")
        if raw is None:
            raw = _per_row(experience.rewards, rows, f"experiences[{k}].rewards")
        rewards.extend([None] * rows if raw is None else raw)
        if experience.advantages is not None:
            valid = action.bool() & attention[:, 1:].bool()
            counts = valid.sum(dim=-1)
            total = (experience.advantages.float() * valid).sum(dim=-1)
            means = torch.where(counts > 0, total / counts.clamp(min=1), torch.nan).tolist()
        else:
            means = [None] * rows
        labels = (
            list(experience.labels) if experience.labels and len(experience.labels) == rows else [None] * rows
        )
        truncated = _per_row(experience.truncated, rows, f"experiences[{k}].truncated") or [None] * rows
        scores = _per_row(info.get("score"), rows, f"experiences[{k}].info['score']") or [None] * rows
        stds = _per_row(info.get("group_reward_std"), rows, "info['group_reward_std']") or [None] * rows
        extra = {key: values for key in info if key not in _OWN_INFO and (values := _extra(info[key], rows))}
        for r in range(rows):
            i = int(order[r])
            metadata["rollout_index"].append(i)
            metadata["prompt_index"].append(i // samples_per_prompt)
            mean = means[r]
            metadata["advantage"].append(None if mean is None or not math.isfinite(mean) else mean)
            metadata["label"].append(jsonable(labels[r]))
            metadata["truncated"].append(None if truncated[r] is None else bool(truncated[r]))
            metadata["score"].append(scores[r])
            metadata["group_reward_std"].append(stds[r])
            metadata["openrlhf_info"].append(
                {key: jsonable(values[r]) for key, values in extra.items()} or None
            )
    if policy_version is not None:
        metadata["policy_version"] = [int(policy_version)] * len(rewards)
    # A missing value is no metadata at all: dropped per row below.
    samples = decode_rollouts(
        torch.cat(ids_parts),
        tokenizer=tokenizer,
        loss_mask=torch.cat(mask_parts),
        attention_mask=torch.cat(attention_parts),
        rewards=[None if r is None or not math.isfinite(float(r)) else float(r) for r in rewards],
        env_role=env_role,
        token_fields={name: torch.cat(parts) for name, parts in field_parts.items()} or None,
    )
    for row, sample in enumerate(samples):
        for key, values in metadata.items():
            value = values[row]
            if value is not None:
                sample.metadata[key] = value
    return samples


def to_samples(
    experiences: Any,
    *,
    tokenizer: Any,
    samples_per_prompt: int,
    env_role: str = "tool",
    token_fields: Sequence[str] = (),
    policy_version: int | None = None,
) -> list[Sample]:
    """One sample per row of OpenRLHF `Experience`s, in the order of the list and its rows.

    `experiences` is the list `make_experience_batch` returns (micro-batches with advantages),
    or the one-row Experiences of `generate_samples` / `generate_eval_samples`. Messages: the
    prompt tokens as the user turn, then each ``action_mask`` span (one token short, as
    OpenRLHF aligns it on ``sequences[:, 1:]``) as an `assistant` turn and the tokens between
    spans (tool or environment feedback) as `env_role` turns, decoded in one tokenizer call.

    The group is the sample's ``index // samples_per_prompt`` (``index`` is its position in the
    rollout batch, which `split_rollout_samples` sets; the position in the list where it is
    unset), as `compute_advantages_and_returns` groups rewards. Every metadata key and its
    field: docs/frameworks/openrlhf.md. `token_fields` names per-token arrays to keep
    (``token_ids``, ``loss_mask``, ``logprobs``, ``advantages``), put back on the token they
    belong to, as lists of numbers; ``logprobs`` and ``advantages`` are NaN where OpenRLHF has
    none (the first token).
    """
    return plain_tokens(
        _samples(
            experiences,
            tokenizer=tokenizer,
            samples_per_prompt=samples_per_prompt,
            env_role=env_role,
            token_fields=token_fields,
            policy_version=policy_version,
        )
    )


def open_session(trainer: Any, **kwargs: Any) -> SyncTraceSession:
    """A blocking session for `trainer`, named after its W&B project and run name (``args.logger.wandb``).

    It is finished at interpreter exit. `kwargs` go to `TraceSession` (defaults: 64 traces per
    step, best and worst by reward). Stored on the trainer, where the hooks find it.
    """
    wandb = getattr(getattr(getattr(trainer, "args", None), "logger", None), "wandb", None)
    project = plain_name(getattr(wandb, "project", None)) or "openrlhf"
    run = plain_name(getattr(wandb, "run_name", None))
    return start_trainer_session(trainer, project, run, **kwargs)


def _row_count(experiences: Any) -> int | None:
    """The rows of a batch, from any per-row tensor of each `Experience`; None when one has none
    (a renamed field must not make a batch that then fails count as fewer rows)."""
    try:
        batch = _experiences(experiences)
    except ValueError:
        return None
    total = 0
    for e in batch:
        rows = count_rows(*(functools.partial(getattr, e, name) for name in _PER_ROW))
        if rows is None:
            return None
        total += rows
    return total


def _problems(trainer: Any, experiences: Any, samples_per_prompt: int | None) -> list[str]:
    """What the trainer and the batch's first `Experience` lack of what the hooks read."""
    needs = [Need("tokenizer")]
    if samples_per_prompt is None:
        needs.append(Need("args.rollout.n_samples_per_prompt"))
    problems = gaps(trainer, needs, type(trainer).__name__)
    first = experiences[0] if isinstance(experiences, (list, tuple)) and experiences else experiences
    if first is not None and not isinstance(first, (str, bytes, Mapping, list, tuple)):
        # Anything else is refused by `to_samples` with its own message (not another version's batch).
        problems += gaps(first, _EXPERIENCE_NEEDS, type(first).__name__)
    return problems


def _log(
    trainer: Any,
    experiences: Any,
    *,
    step: int,
    version: int,
    split: str,
    samples_per_prompt: int | None,
    session: Any,
    token_fields: Sequence[str],
    where: str,
) -> int:
    rows = _row_count(experiences)
    try:
        if session is None:
            session = trainer_session(trainer, open_session)
        if session is FAILED:
            return 0
        problems = _problems(trainer, experiences, samples_per_prompt)
        if problems:
            return refuse(_FRAMEWORK, where, problems, session, rows)
        args = trainer.args
        n = int(samples_per_prompt if samples_per_prompt is not None else args.rollout.n_samples_per_prompt)
        # Synchronous PPO generates with the weights of `version` updates; the asynchronous
        # trainer records no version at all, so none is made up.
        synchronous = not bool(getattr(getattr(args, "train", None), "async_enable", False))
        tokenizer = trainer.tokenizer
    except Exception as exc:  # telemetry must never stop training
        warn_once(where, f"could not start logging ({type(exc).__name__}: {exc})")
        if session is not None and session is not FAILED:
            count_invalid(session, 1 if rows is None else rows)
        return 0
    convert = every_row(
        _samples,
        experiences,
        tokenizer=tokenizer,
        samples_per_prompt=n,
        token_fields=token_fields,
        policy_version=version if synchronous else None,
    )
    return deliver(session, convert, rows=rows, step=step, split=split, where=where)


def log_train_batch(
    trainer: Any,
    experiences: Any,
    global_step: int,
    *,
    session: Any = None,
    token_fields: Sequence[str] = (),
) -> int:
    """Log the batch of one `train_step` (after its advantages); never raises. Returns the samples accepted.

    `global_step` is `train_step`'s argument: the records go to step ``global_step + 1``, the
    step `train_step` returns and OpenRLHF logs this batch's metrics at. `trainer` gives the
    tokenizer, ``args.rollout.n_samples_per_prompt`` and the session (`session`, else
    ``trainer.asynctrace_session``, else one `open_session` opens). Rows that cannot be
    converted are counted in ``session.stats().dropped["invalid"]``, with one warning.
    """
    return _log(
        trainer,
        experiences,
        step=int(global_step) + 1,
        version=int(global_step),
        split="train",
        samples_per_prompt=None,
        session=session,
        token_fields=token_fields,
        where="openrlhf_adapter.log_train_batch",
    )


def log_eval_samples(
    trainer: Any,
    samples_list: Any,
    global_step: int,
    samples_per_prompt: int,
    *,
    session: Any = None,
) -> int:
    """Log `PPOTrainer.evaluate`'s generated samples as split "eval" at `global_step`; never raises.

    `samples_per_prompt` is the evaluation's ``n_samples_per_prompt`` (its own setting, not the
    training one). Returns the samples accepted.
    """
    return _log(
        trainer,
        samples_list,
        step=int(global_step),
        version=int(global_step),
        split="eval",
        samples_per_prompt=samples_per_prompt,
        session=session,
        token_fields=(),
        where="openrlhf_adapter.log_eval_samples",
    )
