"""AReaL 1.0: the trajectory list of `prepare_batch` / `compute_advantages` to samples.

`attach` and `log_batch` (the hook in `PPOTrainer.train`) never raise into training; `to_samples`
and `rollout_kwargs` are the raising forms. Where the hook goes, the batch layout and the field
mapping: docs/frameworks/areal.md.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._records.types import Sample
from ..rollouts._decode import decode_rollouts
from ..rollouts._rows import is_tensor
from ._common import plain_tokens
from ._hooks import count_rows, deliver, every_row
from ._requires import UNCHANGED, Framework, Need, gaps, report
from ._sessions import finish_after, plain_name, start_trainer_session

if TYPE_CHECKING:
    from .._session import TraceSession
    from .._sync import SyncTraceSession

__all__ = ["attach", "log_batch", "rollout_kwargs", "to_samples"]

_PER_TOKEN = ("input_ids", "attention_mask", "loss_mask", "versions")
# What decoding needs; a group's other keys (logprobs, ref_logp, values, ...) are never fetched.
_NEEDED = (*_PER_TOKEN, "rewards", "advantages")
_RTENSOR_MODULE = "areal.infra.rpc.rtensor"
# Per-token arrays fetched only when asked for as token fields (`advantages` per token is kept
# under `token_advantages` once unrolled).
_TOKEN_KEYS = ("logprobs", "token_advantages")
# Each token field a caller may ask for, and the key of the batch it is read from.
_TOKEN_SOURCES = {
    "advantages": "token_advantages",
    "logprobs": "logprobs",
    "loss_mask": "loss_mask",
    "token_ids": "input_ids",
}


def _get(obj: Any, name: str) -> Any:
    """A key of a dict or of a TensorDict-like object (whose `get` takes a default)."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    getter = getattr(obj, "get", None)
    if callable(getter):
        return getter(name, None)
    return getattr(obj, name, None)


def _groups(batch: Any) -> tuple[list[Any], bool]:
    """The trajectory dicts of a batch, and whether it came as AReaL's list of groups."""
    if isinstance(batch, (list, tuple)):
        return [g for g in batch if g is not None], True
    if batch is None or isinstance(batch, (str, bytes)):
        raise ValueError(f"batch: expected AReaL's list of trajectory dicts or one dict, got {batch!r}")
    return [batch], False


def _localize(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """RTensors made local in one batched fetch; anything else is returned as it is.

    An RTensor can only exist once AReaL's module is imported, so it is looked up there and
    AReaL is never imported here. `RTensor.localize` fetches every remote shard of the call
    concurrently and caches it in AReaL's fetch buffer, which the trainer's
    `clear_batches` empties at the end of the step; the batch's RTensors stay remote.
    """
    module = sys.modules.get(_RTENSOR_MODULE)
    rtensor = getattr(module, "RTensor", None) if module is not None else None
    if rtensor is None or not any(isinstance(v, rtensor) for part in parts for v in part.values()):
        return parts
    # `localize` stores the fetched data in each RTensor it is given. On the trainer's own
    # RTensors that would make every later RPC (ppo_update, ...) serialise the whole tensor
    # instead of its shard id, so it is given copies.
    copies = [{k: copy.copy(v) if isinstance(v, rtensor) else v for k, v in part.items()} for part in parts]
    localized: list[dict[str, Any]] = rtensor.localize(copies)
    return localized


def _unroll(part: dict[str, Any], per_token: bool = False) -> None:
    """Undo `compute_advantages`' roll of the loss mask; each row's mean advantage.

    AReaL's `PPOActor._compute_advantages` stores ``loss_mask`` rolled left by one token
    (position t then says whether token t+1 was generated), so read as it is every turn
    would start one token early. The first token is always the prompt's, so shifting right
    by one and filling with 0 gives back the mask as the workflow wrote it.
    """
    advantages = part.pop("advantages")
    rolled: Any = part.get("loss_mask")
    if not (is_tensor(advantages) and is_tensor(rolled)) or rolled.dim() != 2:
        return
    import torch

    generated = rolled != 0
    part["loss_mask"] = torch.cat([torch.zeros_like(generated[:, :1]), generated[:, :-1]], dim=1)
    if per_token and advantages.dim() == 2:
        # Rolled like the mask: the advantage at t is that of token t+1.
        shifted = advantages.float()
        part["token_advantages"] = torch.cat([torch.zeros_like(shifted[:, :1]), shifted[:, :-1]], dim=1)
    logprobs: Any = part.get("logprobs")
    if is_tensor(logprobs) and logprobs.dim() == 2:
        # compute_advantages rolls the log-probs too (and zeroes them off the rolled mask).
        part["logprobs"] = torch.cat([torch.zeros_like(logprobs[:, :1]), logprobs[:, :-1]], dim=1)
    weight = generated.to(advantages.dtype if advantages.is_floating_point() else torch.float32)
    count = weight.sum(dim=-1)
    total = (advantages * weight).sum(dim=-1)
    part["advantage"] = torch.where(count > 0, total / count.clamp(min=1), torch.nan)


def _pad(value: Any, width: int, fill: int) -> Any:
    import torch

    if value.dim() < 2 or value.shape[1] == width:
        return value
    return torch.nn.functional.pad(value, (0, width - int(value.shape[1])), value=fill)


def _concat(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One batch from the groups, as AReaL's `concat_padded_tensors` builds it: right-padded.

    Groups come trimmed to their own longest row (RTensor storage trims padding), so
    per-token tensors are padded to the widest group; padding is outside `attention_mask`.
    """
    if len(parts) == 1:
        return parts[0]
    keys = [k for k in (*_NEEDED, "advantage", *_TOKEN_KEYS) if all(k in p for p in parts)]
    if all(is_tensor(p.get("input_ids")) for p in parts) and "attention_mask" not in keys:
        import torch

        for p in parts:
            ids = p["input_ids"]
            p["attention_mask"] = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
        keys.insert(1, "attention_mask")
    out: dict[str, Any] = {}
    for key in keys:
        values = [p[key] for p in parts]
        if all(is_tensor(v) for v in values):
            import torch

            if key in _PER_TOKEN or key in _TOKEN_KEYS:
                width = max(int(v.shape[1]) for v in values)
                values = [_pad(v, width, -1 if key == "versions" else 0) for v in values]
            out[key] = torch.cat(values, dim=0)
        else:
            rows: list[Any] = []
            for v in values:
                rows.extend(v.tolist() if hasattr(v, "tolist") else v)
            out[key] = rows
    return out


def _rows(part: Mapping[str, Any]) -> int:
    ids = part.get("input_ids")
    shape = getattr(ids, "shape", None)
    return int(shape[0]) if shape is not None else len(ids) if ids is not None else 0


def rollout_kwargs(
    batch: Any, *, group_size: int | None = None, token_fields: Sequence[str] = ()
) -> dict[str, Any]:
    """The batch as keyword arguments of `decode_rollouts` / `TraceSession.log_rollouts`.

    `batch` is AReaL's list of trajectory dicts (from `prepare_batch`, `rollout_batch` or
    `compute_advantages`), or one dict; values may be tensors or `RTensor`s. Each row of
    group i gets ``group_id`` i. A single dict has no groups: give `group_size` when it is
    a concatenation of equal groups.

    `token_fields` names per-token arrays to keep with each sample: ``token_ids``,
    ``loss_mask``, ``logprobs`` (AReaL's per-token ``logprobs``, 0 where no token was
    generated) and ``advantages`` (after `compute_advantages`); what `compute_advantages` rolls
    left by one token is put back on its token.
    """
    if isinstance(token_fields, str) or any(name not in _TOKEN_SOURCES for name in token_fields):
        raise ValueError(f"token_fields: expected names from {list(_TOKEN_SOURCES)}, got {token_fields!r}")
    groups, grouped = _groups(batch)
    if not groups:
        raise ValueError("batch: has no trajectories")
    parts: list[dict[str, Any]] = []
    for i, group in enumerate(groups):
        wanted = (*_NEEDED, "logprobs") if "logprobs" in token_fields else _NEEDED
        part = {k: v for k in wanted if (v := _get(group, k)) is not None}
        if "input_ids" not in part:
            if _get(group, "interactions") is not None:
                raise ValueError(
                    f"batch[{i}]: string-only trajectories (AReaL's external-API mode) have no tokens"
                )
            raise ValueError(f"batch[{i}]: has no input_ids" if grouped else "batch: has no input_ids")
        parts.append(part)
    parts = _localize(parts)
    for part in parts:
        if "advantages" in part:
            _unroll(part, per_token="advantages" in token_fields)
    sizes = [_rows(p) for p in parts]
    columns = _concat(parts)
    kwargs: dict[str, Any] = {k: columns[k] for k in _PER_TOKEN if k in columns}
    if "rewards" in columns:
        kwargs["rewards"] = columns["rewards"]
    metadata: dict[str, Any] = {}
    if grouped:
        metadata["group_id"] = [i for i, n in enumerate(sizes) for _ in range(n)]
    elif group_size is not None:
        if group_size < 1:
            raise ValueError(f"group_size: expected a positive int, got {group_size!r}")
        metadata["group_id"] = [r // group_size for r in range(sizes[0])]
    if "advantage" in columns:
        advantage = columns["advantage"]
        values = advantage.tolist() if hasattr(advantage, "tolist") else list(advantage)
        # A row with no generated token has no advantage: a missing value, not NaN.
        metadata["advantage"] = [None if v is None or math.isnan(v) else v for v in values]
    if metadata:
        kwargs["metadata"] = metadata
    if token_fields:
        missing = [name for name in token_fields if _TOKEN_SOURCES[name] not in columns]
        if missing:
            raise ValueError(
                f"token_fields: the batch has no per-token values for {missing} "
                "(advantages exist after compute_advantages)"
            )
        kwargs["token_fields"] = {name: columns[_TOKEN_SOURCES[name]] for name in token_fields}
    return kwargs


def _samples(
    batch: Any,
    *,
    tokenizer: Any,
    rows: Sequence[int] | None = None,
    metadata: Mapping[str, Any] | None = None,
    env_role: str = "tool",
    group_size: int | None = None,
    token_fields: Sequence[str] = (),
) -> list[Sample]:
    """`to_samples`, token fields in their compact JSON form (as `log_batch` hands them on)."""
    kwargs = rollout_kwargs(batch, group_size=group_size, token_fields=token_fields)
    merged = {**kwargs.pop("metadata", {}), **(metadata or {})}
    return decode_rollouts(
        **kwargs, tokenizer=tokenizer, rows=rows, metadata=merged or None, env_role=env_role
    )


def to_samples(
    batch: Any,
    *,
    tokenizer: Any,
    rows: Sequence[int] | None = None,
    metadata: Mapping[str, Any] | None = None,
    env_role: str = "tool",
    group_size: int | None = None,
    token_fields: Sequence[str] = (),
) -> list[Sample]:
    """Decode an AReaL batch (list of group dicts or one dict): one transfer per tensor, one tokenizer call.

    Each sample's metadata is mapped as docs/frameworks/areal.md lists it (reward, group_id,
    advantage, lengths, policy versions, sample_index), plus `metadata={name: per-sample values}`.
    `token_fields`: as in `rollout_kwargs`, each a list of numbers.
    """
    return plain_tokens(
        _samples(
            batch,
            tokenizer=tokenizer,
            rows=rows,
            metadata=metadata,
            env_role=env_role,
            group_size=group_size,
            token_fields=token_fields,
        )
    )


def _row_count(batch: Any) -> int | None:
    """The rows of a batch, from any per-row tensor of each group; None when a group has none
    (a renamed field must not make a batch that then fails count as fewer rows)."""
    try:
        groups, _ = _groups(batch)
    except ValueError:
        return None
    total = 0
    for group in groups:
        # An RTensor's shape is its metadata's: counting rows never fetches.
        rows = count_rows(*(functools.partial(_shape_rows, group, name) for name in _NEEDED))
        if rows is None:
            return None
        total += rows
    return total


def _shape_rows(group: Any, name: str) -> int | None:
    shape = getattr(_get(group, name), "shape", None)
    return int(shape[0]) if shape is not None and len(shape) else None


def log_batch(
    session: TraceSession | SyncTraceSession,
    batch: Any,
    *,
    tokenizer: Any,
    step: int,
    split: str = "train",
    env_role: str = "tool",
    group_size: int | None = None,
    token_fields: Sequence[str] = (),
) -> int:
    """Log one step's AReaL batch; never raises into training. Returns the samples accepted.

    Rows that cannot be converted are counted in ``session.stats().dropped["invalid"]``
    with one warning; see `asynctrace.adapters._hooks.deliver`.
    """

    convert = every_row(
        _samples,
        batch,
        tokenizer=tokenizer,
        env_role=env_role,
        group_size=group_size,
        token_fields=token_fields,
    )
    return deliver(
        session, convert, rows=_row_count(batch), step=step, split=split, where="areal_adapter.log_batch"
    )


def _is_main_process() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is None or not dist.is_initialized() or int(dist.get_rank()) == 0
    except Exception:  # a torch without distributed support: one process
        return True


_FRAMEWORK = Framework("AReaL", "1.0.4", "areal")
# What `attach` wraps: the actor's `compute_advantages`, which `PPOTrainer.train` calls once a step.
_NEEDS = (Need("actor.compute_advantages", args=1),)
# And, when it opens the session itself, what names it and what ends it.
_OWN_SESSION_NEEDS = (Need("config.experiment_name"), Need("config.trial_name"), Need("train"))
_HOOK = "areal_adapter.attach"


def attach(
    trainer: Any,
    session: TraceSession | SyncTraceSession | None = None,
    *,
    tokenizer: Any = None,
    env_role: str = "tool",
    **session_options: Any,
) -> None:
    """Log every training step of an AReaL `PPOTrainer` from the training script.

    Wraps ``trainer.actor.compute_advantages``, which `PPOTrainer.train` calls once per step,
    so that its result is handed to `log_batch` (it never raises) before training goes on
    with it. The step is the actor's policy version, which the trainer keeps equal to the
    global step (recovery included); an actor without `get_version` is counted from 0.
    `tokenizer` defaults to ``trainer.tokenizer``.

    Without `session`, one is opened here (as `verl_adapter.open_session` opens one: 64 traces
    a step, best and worst by reward; `session_options` go to `TraceSession`), named after
    ``config.experiment_name`` and ``config.trial_name``, and finished when ``trainer.train``
    returns or raises (and at exit); a session passed in is the caller's to finish. A trainer
    without what the hook wraps (another AReaL version) gets one warning naming what is
    missing and is left as it is.

    Under torchrun (SPMD mode) only global rank 0 logs, so its share of the step's groups is
    what is logged; in single-controller mode the controller holds every group.
    """
    if session is not None and session_options:
        raise ValueError(f"session_options: {sorted(session_options)} only apply when no session is given")
    if not _is_main_process():
        return
    needs = [*_NEEDS, *(() if session is not None else _OWN_SESSION_NEEDS)]
    if tokenizer is None:
        needs.append(Need("tokenizer"))
    problems = gaps(trainer, needs, type(trainer).__name__)
    if problems:
        report(_FRAMEWORK, _HOOK, problems, UNCHANGED)
        return
    actor = trainer.actor
    compute = actor.compute_advantages
    decode_with = tokenizer if tokenizer is not None else trainer.tokenizer
    target: TraceSession | SyncTraceSession
    if session is None:
        config = trainer.config
        project = plain_name(config.experiment_name) or "areal"
        owned = start_trainer_session(trainer, project, plain_name(config.trial_name), **session_options)
        finish_after(trainer, "train", owned, _HOOK)
        target = owned
    else:
        target = session
    calls = [0]

    def compute_advantages(*args: Any, **kwargs: Any) -> Any:
        adv_batch = compute(*args, **kwargs)
        step = calls[0]
        calls[0] += 1
        version = getattr(actor, "get_version", None)
        if callable(version):
            # A version that cannot be read: the call count stands in.
            with contextlib.suppress(Exception):
                step = int(version())
        log_batch(target, adv_batch, tokenizer=decode_with, step=step, env_role=env_role)
        return adv_batch

    actor.compute_advantages = compute_advantages
