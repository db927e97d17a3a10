"""The built-in samplers by name: one place that knows them all, the group sampler too."""

from __future__ import annotations

from typing import Literal

from .._security import shown
from .groups import GroupSampler
from .samplers import FirstSampler, ReservoirSampler, Sampler, TopBottomSampler

__all__ = ["SamplerName", "resolve_sampler"]

SamplerName = Literal["first", "top_bottom", "reservoir", "group"]
_BY_NAME: dict[str, type[Sampler]] = {
    "first": FirstSampler,
    "top_bottom": TopBottomSampler,
    "reservoir": ReservoirSampler,
    "group": GroupSampler,
}


def resolve_sampler(sampler: SamplerName | Sampler) -> Sampler:
    """`sampler` itself, or a new built-in sampler of that name."""
    if isinstance(sampler, Sampler):
        return sampler
    if isinstance(sampler, str) and sampler in _BY_NAME:
        return _BY_NAME[sampler]()
    raise ValueError(
        "sampler must be 'first', 'top_bottom', 'reservoir', 'group' or a Sampler instance, "
        f"got {shown(sampler)}"
    )
