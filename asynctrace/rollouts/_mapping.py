"""Which prompt a sample answers: by trajectory id when there is one, else the blocked layout."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from .._security import shown

__all__ = ["field", "instance_key", "prompt_index", "prompt_indices", "trajectory_key", "trajectory_label"]


def field(obj: Any, name: str, default: Any = None) -> Any:
    """`obj[name]` for mappings (TypedDicts are dicts), `obj.name` for objects; `default` if absent."""
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def instance_key(trajectory_id: Any) -> Hashable:
    """What samples of one prompt share: `instance_id` of a SkyRL-style id, else the id itself."""
    instance = field(trajectory_id, "instance_id")
    if instance is not None:
        return str(instance)
    return trajectory_id if isinstance(trajectory_id, Hashable) else repr(trajectory_id)


def trajectory_key(trajectory_id: Any) -> Hashable:
    """A hashable key naming one trajectory: `(instance_id, repetition_id)` where both exist."""
    instance = field(trajectory_id, "instance_id")
    if instance is not None:
        return (str(instance), field(trajectory_id, "repetition_id"))
    # Dataclass ids are not hashable unless frozen, so fall back to their repr.
    return trajectory_id if isinstance(trajectory_id, Hashable) else repr(trajectory_id)


def trajectory_label(trajectory_id: Any) -> str:
    """The id as trace metadata: `"instance_id:repetition_id"`, or the id as a string."""
    instance = field(trajectory_id, "instance_id")
    if instance is None:
        return str(trajectory_id)
    repetition = field(trajectory_id, "repetition_id")
    return str(instance) if repetition is None else f"{instance}:{repetition}"


def _check_counts(n_prompts: int, n_samples: int) -> None:
    for name, value in (("n_prompts", n_prompts), ("n_samples", n_samples)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {shown(value)}")
    if n_samples and not n_prompts:
        raise ValueError(f"n_prompts: {n_samples} samples need at least one prompt")


def _per_prompt(n_prompts: int, n_samples: int) -> int:
    """Samples per prompt in the blocked layout."""
    if n_samples % n_prompts:
        raise ValueError(
            f"n_samples: {n_samples} samples do not split evenly over {n_prompts} prompts; "
            "pass trajectory_ids to map samples to prompts"
        )
    return n_samples // n_prompts


def prompt_indices(
    *,
    n_prompts: int,
    n_samples: int,
    trajectory_ids: Sequence[Any] | None = None,
    prompt_trajectory_ids: Sequence[Any] | None = None,
) -> list[int]:
    """The prompt index of every sample.

    - `trajectory_ids` (one per sample) and `prompt_trajectory_ids` (one per prompt): a sample
      answers the prompt with the same trajectory id, else the first prompt of its instance.
    - `trajectory_ids` alone: samples of one instance share a prompt, prompts numbered in the
      order their instances first appear.
    - neither: the blocked layout (all samples of prompt 0, then of prompt 1, ...), which needs
      `n_samples` to be a multiple of `n_prompts`.
    """
    _check_counts(n_prompts, n_samples)
    if trajectory_ids is None:
        if prompt_trajectory_ids is not None:
            raise ValueError("prompt_trajectory_ids: only meaningful together with trajectory_ids")
        if n_samples == 0:
            return []
        per_prompt = _per_prompt(n_prompts, n_samples)
        return [i // per_prompt for i in range(n_samples)]
    if len(trajectory_ids) != n_samples:
        raise ValueError(f"trajectory_ids: has {len(trajectory_ids)} ids for {n_samples} samples")
    if prompt_trajectory_ids is not None:
        return _match(trajectory_ids, prompt_trajectory_ids, n_prompts)
    order: dict[Hashable, int] = {}
    result = [order.setdefault(instance_key(tid), len(order)) for tid in trajectory_ids]
    if len(order) != n_prompts:
        raise ValueError(
            f"trajectory_ids: name {len(order)} distinct instances but there are {n_prompts} prompts"
        )
    return result


def _match(trajectory_ids: Sequence[Any], prompt_ids: Sequence[Any], n_prompts: int) -> list[int]:
    if len(prompt_ids) != n_prompts:
        raise ValueError(f"prompt_trajectory_ids: has {len(prompt_ids)} ids for {n_prompts} prompts")
    exact: dict[Hashable, int] = {}
    by_instance: dict[Hashable, int] = {}
    for p, tid in enumerate(prompt_ids):
        exact.setdefault(trajectory_key(tid), p)
        by_instance.setdefault(instance_key(tid), p)
    result = []
    for i, tid in enumerate(trajectory_ids):
        match = exact.get(trajectory_key(tid), by_instance.get(instance_key(tid)))
        if match is None:
            raise ValueError(
                f"trajectory_ids: sample {i} ({trajectory_label(tid)}) matches no prompt's trajectory id"
            )
        result.append(match)
    return result


def prompt_index(
    sample_index: int,
    *,
    n_prompts: int,
    n_samples: int,
    trajectory_ids: Sequence[Any] | None = None,
    prompt_trajectory_ids: Sequence[Any] | None = None,
) -> int:
    """The prompt that sample `sample_index` answers (see `prompt_indices` for the rules).

    Raises IndexError for a sample index outside `[0, n_samples)` and ValueError when the
    counts or ids do not fit together.
    """
    _check_counts(n_prompts, n_samples)
    if isinstance(sample_index, bool) or not isinstance(sample_index, int):
        raise TypeError(f"sample_index: expected an int, got {type(sample_index).__name__}")
    if not 0 <= sample_index < n_samples:
        raise IndexError(f"sample_index: {sample_index} is out of range for {n_samples} samples")
    if trajectory_ids is None and prompt_trajectory_ids is None:
        return sample_index // _per_prompt(n_prompts, n_samples)
    return prompt_indices(
        n_prompts=n_prompts,
        n_samples=n_samples,
        trajectory_ids=trajectory_ids,
        prompt_trajectory_ids=prompt_trajectory_ids,
    )[sample_index]
