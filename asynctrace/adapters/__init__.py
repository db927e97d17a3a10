"""Framework adapters: each module turns one trainer's own rollout structures into `Sample`s.

The frameworks are not dependencies: structures are read by their field names (docs/adapters.md).
"""

from __future__ import annotations

from . import (
    areal_adapter,
    nemo_rl_adapter,
    open_instruct_adapter,
    openrlhf_adapter,
    prime_rl_adapter,
    skyrl_adapter,
    slime_adapter,
    torchforge_adapter,
    trl_adapter,
    verl_adapter,
)

__all__ = [
    "areal_adapter",
    "nemo_rl_adapter",
    "open_instruct_adapter",
    "openrlhf_adapter",
    "prime_rl_adapter",
    "skyrl_adapter",
    "slime_adapter",
    "torchforge_adapter",
    "trl_adapter",
    "verl_adapter",
]
