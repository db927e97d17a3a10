"""AReaL: the padded tensor dict of a rollout batch to samples.

    samples = areal_adapter.to_samples(batch, tokenizer=tokenizer)
    await session.log_samples(samples, step=global_step)

or, to decode only what the session's cap keeps::

    await session.log_rollouts(**areal_adapter.rollout_kwargs(batch), tokenizer=tokenizer, step=global_step)

The batch is a dict (or TensorDict) with `input_ids`, `attention_mask`, `loss_mask`,
`versions` and `rewards`, one row per sample, right-padded. Multi-turn rollouts are one
sequence each; the loss mask splits it into turns (see `asynctrace.rollouts.decode_rollouts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._record import Sample
from ..rollouts._decode import decode_rollouts

__all__ = ["rollout_kwargs", "to_samples"]

_TENSORS = ("attention_mask", "loss_mask", "versions", "rewards")


def _get(batch: Any, name: str) -> Any:
    """A key of a dict or a TensorDict (whose `get` takes a default), else an attribute."""
    if isinstance(batch, Mapping):
        return batch.get(name)
    getter = getattr(batch, "get", None)
    if callable(getter):
        return getter(name, None)
    return getattr(batch, name, None)


def rollout_kwargs(batch: Any) -> dict[str, Any]:
    """The batch's tensors as keyword arguments of `decode_rollouts` / `TraceSession.log_rollouts`."""
    input_ids = _get(batch, "input_ids")
    if input_ids is None:
        raise ValueError("batch: has no input_ids")
    kwargs: dict[str, Any] = {"input_ids": input_ids}
    for name in _TENSORS:
        value = _get(batch, name)
        if value is not None:
            kwargs[name] = value
    return kwargs


def to_samples(
    batch: Any,
    *,
    tokenizer: Any,
    rows: Sequence[int] | None = None,
    metadata: Mapping[str, Any] | None = None,
    env_role: str = "tool",
) -> list[Sample]:
    """Decode an AReaL rollout batch: one transfer per tensor, one tokenizer call.

    Metadata per sample: reward, prompt_len, response_len, seq_len, num_turns,
    policy_version_min / policy_version_max (from `versions`, ignoring -1), sample_index,
    plus `metadata={name: per-sample values}`.
    """
    return decode_rollouts(
        **rollout_kwargs(batch), tokenizer=tokenizer, rows=rows, metadata=metadata, env_role=env_role
    )
