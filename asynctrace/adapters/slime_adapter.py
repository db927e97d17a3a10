"""slime: its rollout `Sample`s to samples, and `log_rollout` / `log_eval_rollout`, its log-function plugins.

Tested on slime at commit 624b824a898a. slime calls the functions named by
``--custom-rollout-log-function-path`` and ``--custom-eval-rollout-log-function-path`` with every
rollout's samples, in its `RolloutManager` (docs/frameworks/slime.md): no code to add. Both never
raise into training; `to_samples` is the raising form.
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from .._records.types import Sample
from .._sync import SyncTraceSession
from ..rollouts._turns import mask_runs
from ._common import Message, SampleBuilder, chat_messages, field, jsonable, token_list
from ._hooks import count_invalid, deliver, warn_once
from ._requires import Framework, Need, gaps, refuse

__all__ = ["advantages", "log_eval_rollout", "log_rollout", "open_session", "rollout_step", "to_samples"]

# slime's estimators whose rewards `RolloutManager._post_process_rewards` normalises per group.
_GROUP_NORMALISED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
_STD_NORMALISED = ("grpo", "gspo", "cispo")
_TOKEN_FIELDS = ("token_ids", "loss_mask", "logprobs")
_FRAMEWORK = Framework("slime", "commit 624b824a898a")
# What the plugins read of slime's `Sample` (its dataclass fields, None where unset), and of
# its arguments for the advantages of a training rollout.
_SAMPLE_NEEDS = tuple(
    Need(name)
    for name in (
        "prompt",
        "tokens",
        "response_length",
        "reward",
        "loss_mask",
        "status",
        "group_index",
        "index",
    )
)
_ADVANTAGE_NEEDS = (Need("advantage_estimator"), Need("n_samples_per_prompt"), Need("rollout_batch_size"))
_lock = threading.Lock()
_sessions: dict[tuple[str, str | None], Any] = {}
_tokenizers: dict[str, Any] = {}
_FAILED = object()
"""Stored for a project whose session (or a checkpoint whose tokenizer) could not be opened."""


def _reward_value(reward: Any, key: str | None) -> Any:
    """`Sample.get_reward_value`: the reward, or its `key` entry where rewards are dicts."""
    if key and isinstance(reward, Mapping):
        return reward.get(key)
    return reward


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def advantages(samples: Sequence[Any], args: Any) -> list[float] | None:
    """The rewards slime trains on, as `RolloutManager._post_process_rewards` normalises them.

    For GRPO, GSPO, CISPO and REINFORCE++-baseline with rewards normalisation on (slime's
    default), each reward minus its group's mean (divided by the group's std for the first
    three, unless ``--disable-grpo-std-normalization``): the advantage of every token of the
    sample before ``--normalize-advantages`` whitening. None for other estimators (their
    advantages need the trainer's values and KL) and with a custom reward post-processing.
    """
    estimator = getattr(args, "advantage_estimator", None)
    if (
        estimator not in _GROUP_NORMALISED
        or not getattr(args, "rewards_normalization", True)
        or getattr(args, "custom_reward_post_process_path", None) is not None
        or not samples
    ):
        return None
    import torch

    key = getattr(args, "reward_key", None)
    rewards = torch.tensor(
        [float(_reward_value(field(s, "reward"), key)) for s in samples], dtype=torch.float
    )
    n = int(getattr(args, "n_samples_per_prompt", 1)) * int(getattr(args, "rollout_batch_size", 0))
    # As slime does: equal groups when the batch is whole, else the batch as one group.
    rewards = (
        rewards.reshape(-1, int(args.n_samples_per_prompt)) if rewards.shape[-1] == n else rewards.view(1, -1)
    )
    rewards = rewards - rewards.mean(dim=-1, keepdim=True)
    if estimator in _STD_NORMALISED and getattr(args, "grpo_std_normalization", True):
        rewards = rewards / (rewards.std(dim=-1, keepdim=True) + 1e-6)
    return [float(v) for v in rewards.flatten().tolist()]


def _versions(weight_versions: Any) -> dict[str, Any]:
    """`weight_versions` (one per engine call) as metadata: the list, and its range where numeric."""
    versions = [str(v) for v in (weight_versions or [])]
    if not versions:
        return {}
    out: dict[str, Any] = {"weight_versions": versions}
    try:
        numbers = [int(v) for v in versions]
    except ValueError:
        return out
    out["policy_version_min"] = min(numbers)
    out["policy_version_max"] = max(numbers)
    return out


def _status(status: Any) -> str | None:
    if status is None:
        return None
    return str(status.value if isinstance(status, enum.Enum) else status)


def to_samples(
    samples: Sequence[Any],
    *,
    args: Any = None,
    tokenizer: Any = None,
    env_role: str = "tool",
    token_fields: Sequence[str] = (),
    advantage: Sequence[float] | None = None,
) -> list[Sample]:
    """One sample per slime `Sample`, in order.

    Messages: the prompt (a string as the `user` turn, a message list as it is), then the
    response. With a `tokenizer`, the response tokens are cut by ``loss_mask`` into `assistant`
    turns (1) and `env_role` turns (0: tool output a multi-turn rollout appended with
    ``trainable=False``), decoded in one call; without one, ``response`` is one `assistant`
    turn. `advantage` (one per sample, e.g. from `advantages`) is kept as ``advantage``. Every
    metadata key and its field: docs/frameworks/slime.md. `token_fields`: ``token_ids``,
    ``loss_mask`` (0 on the prompt) and ``logprobs`` (``rollout_log_probs``, NaN on the prompt).
    """
    if isinstance(samples, (str, bytes, Mapping)) or not isinstance(samples, Sequence):
        raise ValueError(f"samples: expected a list of slime Samples, got {type(samples).__name__}")
    if isinstance(token_fields, str) or any(name not in _TOKEN_FIELDS for name in token_fields):
        raise ValueError(f"token_fields: expected names from {list(_TOKEN_FIELDS)}, got {token_fields!r}")
    if advantage is not None and len(advantage) != len(samples):
        raise ValueError(f"advantage: has {len(advantage)} values for {len(samples)} samples")
    key = getattr(args, "reward_key", None) if args is not None else None
    builder = SampleBuilder()
    token_rows: list[dict[str, Any] | None] = []
    for i, sample in enumerate(samples):
        tokens = token_list(field(sample, "tokens") or [])
        response_length = int(field(sample, "response_length") or 0)
        if response_length > len(tokens):
            raise ValueError(
                f"samples[{i}]: response_length {response_length} exceeds its {len(tokens)} tokens"
            )
        prompt_length = len(tokens) - response_length
        mask = field(sample, "loss_mask")
        mask = [1] * response_length if mask is None else [int(m) for m in mask]
        if len(mask) != response_length:
            raise ValueError(f"samples[{i}].loss_mask: has {len(mask)} values for {response_length} tokens")
        messages: list[Message] = list(
            chat_messages(field(sample, "prompt", ""), "user", f"samples[{i}].prompt")
        )
        if tokenizer is not None and response_length:
            response = tokens[prompt_length:]
            for start, end, generated in mask_runs(mask):
                role = "assistant" if generated else env_role
                messages.append((role, builder.texts.add(response[start:end])))
        else:
            messages.append({"role": "assistant", "content": str(field(sample, "response", "") or "")})
        builder.add(messages, _metadata(sample, i, key, advantage, mask))
        token_rows.append(_token_row(sample, i, token_fields, tokens, prompt_length, mask))
    out = builder.build(tokenizer, "slime_adapter.to_samples")
    for sample_out, row in zip(out, token_rows, strict=True):
        if row:
            sample_out.tokens = row
    return out


def _metadata(
    sample: Any, row: int, key: str | None, advantage: Sequence[float] | None, mask: list[int]
) -> dict[str, Any]:
    reward = field(sample, "reward")
    value = _reward_value(reward, key)
    meta: dict[str, Any] = {"sample_index": row, "reward": _number(value)}
    if isinstance(reward, Mapping):
        meta["reward_breakdown"] = jsonable(dict(reward))
    if advantage is not None and _number(advantage[row]) is not None:
        meta["advantage"] = float(advantage[row])
    for name, out in (("group_index", "prompt_index"), ("index", "sample_id"), ("rollout_id", "rollout_id")):
        number = field(sample, name)
        if number is not None:
            meta[out] = int(number)
    meta.update(_versions(field(sample, "weight_versions")))
    status = _status(field(sample, "status"))
    if status is not None:
        meta["stop_reason"] = status
        meta["truncated"] = status == "truncated"
    label = field(sample, "label")
    if label is not None:
        meta["label"] = jsonable(label)
    tokens = field(sample, "tokens") or []
    response_length = int(field(sample, "response_length") or 0)
    meta["prompt_len"] = len(tokens) - response_length
    meta["response_len"] = response_length
    meta["num_turns"] = sum(1 for _, _, generated in mask_runs(mask) if generated)
    extra = field(sample, "metadata")
    if extra:
        meta["slime_metadata"] = jsonable(extra)
    return meta


def _token_row(
    sample: Any, row: int, names: Sequence[str], tokens: list[int], prompt_length: int, mask: list[int]
) -> dict[str, Any] | None:
    if not names:
        return None
    out: dict[str, Any] = {}
    for name in names:
        if name == "token_ids":
            out[name] = tokens
        elif name == "loss_mask":
            out[name] = [0] * prompt_length + mask
        else:
            logprobs = field(sample, "rollout_log_probs")
            if logprobs is None:
                raise ValueError(f"token_fields: 'logprobs' needs rollout_log_probs in samples[{row}]")
            out[name] = [math.nan] * prompt_length + [float(v) for v in logprobs]
    return out


def rollout_step(args: Any, rollout_id: int) -> int:
    """The step slime logs a rollout's metrics at (`compute_rollout_step`)."""
    if getattr(args, "wandb_always_use_train_step", False):
        samples = int(rollout_id) * int(args.rollout_batch_size) * int(args.n_samples_per_prompt)
        return samples // int(args.global_batch_size)
    return int(rollout_id)


def open_session(args: Any, **kwargs: Any) -> SyncTraceSession:
    """The process's session for slime's `args`: named after ``--wandb-project`` (else ``slime``) and
    ``--wandb-group``; opened on the first call, finished at interpreter exit.

    `kwargs` go to `TraceSession` (defaults: 64 traces per step, best and worst by reward).
    """
    from .._session import TraceSession

    project = _plain(getattr(args, "wandb_project", None)) or "slime"
    run = _plain(getattr(args, "wandb_group", None))
    with _lock:
        session = _sessions.get((project, run))
        if session is not None and session is not _FAILED:
            return session  # type: ignore[no-any-return]
        kwargs.setdefault("max_traces_per_step", 64)
        kwargs.setdefault("sampler", "top_bottom")
        main = threading.current_thread() is threading.main_thread()
        kwargs.setdefault("shutdown_hooks", main)
        try:
            session = TraceSession(project, run, **kwargs).start()
        except Exception:
            _sessions[(project, run)] = _FAILED
            raise
        _sessions[(project, run)] = session
        return session


def _plain(name: Any) -> str | None:
    """A project or run name as a Trackio name: path separators and controls become "-"."""
    if name is None:
        return None
    text = "".join("-" if c in "/\\" or ord(c) < 32 or ord(c) == 127 else c for c in str(name)).strip()
    return None if text in ("", ".", "..") else text


def _session_for(args: Any) -> Any:
    project = _plain(getattr(args, "wandb_project", None)) or "slime"
    session = _sessions.get((project, _plain(getattr(args, "wandb_group", None))))
    if session is _FAILED:
        return None
    return session if session is not None else open_session(args)


def _tokenizer_for(args: Any, where: str) -> Any:
    """slime's tokenizer (``--hf-checkpoint``), loaded once; None (one warning) where it cannot load."""
    path = getattr(args, "hf_checkpoint", None)
    if not path:
        return None
    with _lock:
        tokenizer = _tokenizers.get(str(path))
        if tokenizer is None:
            try:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=True)
            except Exception as exc:
                warn_once(f"{where}:tokenizer", f"no tokenizer from {path!r}, turns are not split ({exc})")
                tokenizer = _FAILED
            _tokenizers[str(path)] = tokenizer
    return None if tokenizer is _FAILED else tokenizer


def _problems(samples: Any, args: Any, with_advantage: bool) -> list[str]:
    """What slime's arguments and the rollout's first `Sample` lack of what the plugins read."""
    problems = gaps(args, _ADVANTAGE_NEEDS, "args") if with_advantage else []
    first = samples[0] if isinstance(samples, Sequence) and samples else None
    if first is not None and not isinstance(first, (Mapping, str, bytes)):
        # A dict is read by its keys (`field`), and anything else `to_samples` refuses itself.
        problems += gaps(first, _SAMPLE_NEEDS, type(first).__name__)
    return problems


def _deliver(
    samples: Any,
    args: Any,
    *,
    step: int,
    split: str,
    session: Any,
    where: str,
    with_advantage: bool,
    extra: Mapping[str, Any] | None = None,
) -> int:
    rows = len(samples) if isinstance(samples, Sequence) else None
    try:
        target = session if session is not None else _session_for(args)
        if target is None:
            return 0
        problems = _problems(samples, args, with_advantage)
        if problems:
            return refuse(_FRAMEWORK, where, problems, target, rows)
        # Tool turns are cut by the loss mask only where some sample has one.
        multi_turn = any(0 in (field(s, "loss_mask") or ()) for s in samples)
        tokenizer = _tokenizer_for(args, where) if multi_turn else None
    except Exception as exc:  # telemetry must never stop training
        warn_once(where, f"could not start logging ({type(exc).__name__}: {exc})")
        if session is not None:
            count_invalid(session, 1 if rows is None else rows)
        return 0

    def convert() -> tuple[list[Sample], int]:
        advantage = advantages(samples, args) if with_advantage else None
        out = to_samples(samples, args=args, tokenizer=tokenizer, advantage=advantage)
        for sample in out:
            sample.metadata.update(extra or {})
        return out, 0

    return deliver(target, convert, rows=rows, step=step, split=split, where=where)


def log_rollout(
    rollout_id: int,
    args: Any,
    samples: Any,
    rollout_extra_metrics: Any = None,
    rollout_time: float | None = None,
    *,
    session: Any = None,
) -> bool:
    """``--custom-rollout-log-function-path`` plugin: log a rollout's samples; never raises.

    Logged as split "train" at slime's rollout step, with `advantages`. Returns False, so
    that slime logs its own rollout metrics as well. Rows that cannot be converted are counted
    in ``session.stats().dropped["invalid"]``, with one warning.
    """
    where = "slime_adapter.log_rollout"
    try:
        step = rollout_step(args, rollout_id)
    except Exception as exc:
        warn_once(where, f"could not start logging ({type(exc).__name__}: {exc})")
        return False
    _deliver(samples, args, step=step, split="train", session=session, where=where, with_advantage=True)
    return False


def log_eval_rollout(
    rollout_id: int, args: Any, data: Any, extra_metrics: Any = None, *, session: Any = None
) -> bool:
    """``--custom-eval-rollout-log-function-path`` plugin: log each eval dataset's samples; never raises.

    Logged as split "eval" at slime's rollout step, each sample with ``eval_dataset``. Returns
    False, so that slime logs its own eval metrics as well.
    """
    where = "slime_adapter.log_eval_rollout"
    try:
        step = rollout_step(args, rollout_id)
        datasets = {str(name): list(part.get("samples") or []) for name, part in dict(data).items()}
    except Exception as exc:
        warn_once(where, f"could not start logging ({type(exc).__name__}: {exc})")
        return False
    for name, samples in datasets.items():
        extra = {"eval_dataset": name}
        _deliver(
            samples,
            args,
            step=step,
            split="eval",
            session=session,
            where=where,
            with_advantage=False,
            extra=extra,
        )
    return False
