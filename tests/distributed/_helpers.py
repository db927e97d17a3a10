"""Helpers shared by the distributed tests (importable from Ray workers and spawned ranks)."""

from __future__ import annotations

import random
from typing import Any


def make_samples(tag: str, step: int, n: int, seed: int, *, width: int = 40) -> list[dict[str, Any]]:
    """`n` samples of one step with distinct random rewards; the uid identifies each one."""
    rng = random.Random(f"{tag}:{step}:{seed}")
    return [
        {
            "prompt": f"question {i} of {tag} step {step}",
            "response": "x" * width,
            "reward": rng.random(),
            "uid": f"{tag}:{step}:{i}",
        }
        for i in range(n)
    ]


def make_groups(tag: str, step: int, groups: int, size: int, seed: int) -> list[list[dict[str, Any]]]:
    """`groups` prompt groups of `size` samples each (as an RL rollout worker makes them): every
    sample names its group in `group_uid`; rewards are distinct and random."""
    rng = random.Random(f"{tag}:{step}:{seed}:groups")
    return [
        [
            {
                "prompt": f"question {g} of {tag} step {step}",
                "response": f"answer {i}",
                "reward": rng.random(),
                "uid": f"{tag}:{step}:{g}:{i}",
                "group_uid": f"{tag}:{step}:{g}",
            }
            for i in range(size)
        ]
        for g in range(groups)
    ]


def shared_groups(rank: int, step: int, groups: int = 6, size: int = 4) -> list[dict[str, Any]]:
    """One rank's share of a step's prompt groups: even groups are split across two ranks (half
    each), odd ones are logged whole by one rank; rewards are graded and seeded."""
    out = []
    for g in range(groups):
        rng = random.Random(f"shared:{step}:{g}")
        rewards = [rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(size)]
        if g % 2 == 0:
            mine = range(rank * size // 2, (rank + 1) * size // 2)
        else:
            mine = range(size) if g % 4 == 2 * rank + 1 else range(0)
        for i in mine:
            out.append(
                {
                    "prompt": f"question {g} step {step}",
                    "response": f"answer {i}",
                    "reward": rewards[i],
                    "uid": f"{step}:{g}:{i}",
                    "group_uid": f"{step}:{g}",
                }
            )
    return out


def pair_of(metadata: Any) -> str:
    """The prompt group of a sample made by `make_samples`: samples 2i and 2i+1 of a rank's step."""
    head, _, index = str(metadata["uid"]).rpartition(":")
    return f"{head}:{int(index) // 2}"


def top_bottom_uids(samples: list[dict[str, Any]], k: int) -> set[str]:
    """The uids `top_bottom` keeps from `samples`: ceil(k/2) highest and floor(k/2) lowest rewards."""
    ranked = sorted(samples, key=lambda s: s["reward"])
    n_top = (k + 1) // 2
    n_bottom = k // 2
    chosen = ranked[len(ranked) - n_top :] + ranked[:n_bottom]
    return {s["uid"] for s in chosen}


def read_traces(project: str, run: str) -> list[dict[str, Any]]:
    """Every trace of a run, read back from Trackio's own storage."""
    from trackio.sqlite_storage import SQLiteStorage

    return list(SQLiteStorage.get_traces(project, run=run, sort="step_asc"))


def uids_by_step(project: str, run: str) -> dict[int, set[str]]:
    """The uids of a run's traces by step, read back from Trackio's own storage."""
    out: dict[int, set[str]] = {}
    for t in read_traces(project, run):
        out.setdefault(t["step"], set()).add(t["metadata"]["uid"])
    return out
