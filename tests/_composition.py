"""The composition oracle, written from docs/choosing.md and docs/concepts.md (not from the code),
shared by the one-process, torch.distributed and Ray composition tests.

Per (split, step), from the docs' definitions alone:
- watched: a sample whose prompt id is on the watch list, the first `max_per_step` (16 unless
  given) of a step; it passes the session's cap and every `Selected` sink's selection, and is
  written everywhere; later ones go on to the cap like any other sample;
- the session's cap keeps, of the other samples, `first`: the first `k` to arrive,
  `top_bottom`: the `ceil(k/2)` highest and `floor(k/2)` lowest rewards, `group:<policy>`: the
  whole prompt groups choosing.md's group sampler picks (`tests/_group_oracle.py`, groups named
  by `prompt_id`, seed `GROUP_SEED`), or any function of the step's rows and the step;
- across torch.distributed ranks "the first `max_per_step`" are in rank order, then each rank's
  arrival order; across Ray actors they are the first to reach the collector: a step's rows are
  given in that order;
- a plain sink holds the watched samples and what the session kept; a `Selected` sink holds the
  watched samples and its own sampler's pick of what the session kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

import asynctrace as at
from asynctrace import rollouts
from asynctrace.testing import MemorySink

from ._group_oracle import pick

WATCHED = "w"


@dataclass(frozen=True)
class Row:
    uid: str
    prompt_id: str
    reward: float


def first(rows: Sequence[Row], k: int) -> set[str]:
    return {r.uid for r in rows[:k]}


def top_bottom(rows: Sequence[Row], k: int) -> set[str]:
    if len(rows) <= k:
        return {r.uid for r in rows}
    order = {r.uid: i for i, r in enumerate(rows)}
    top = sorted(rows, key=lambda r: (-r.reward, order[r.uid]))[: (k + 1) // 2]
    rest = [r for r in rows if r not in top]
    bottom = sorted(rest, key=lambda r: (r.reward, order[r.uid]))[: k // 2]
    return {r.uid for r in top + bottom}


PICK = {"first": first, "top_bottom": top_bottom}
GROUP_SEED = 7


def capped(name: str, rows: Sequence[Row], k: int, step: int, split: str = "train") -> set[str]:
    """The uids the session's cap `name` keeps of one step's rows (in arrival order)."""
    if not name.startswith("group:"):
        return PICK[name](rows, k)
    rewards = [(r.prompt_id, r.reward) for r in rows]
    chosen = pick(rewards, k, name[6:], seed=GROUP_SEED, split=split, step=step)
    return {rows[i].uid for i in chosen}


def watched_rows(rows: Sequence[Row], max_per_step: int = 16) -> list[Row]:
    """The rows of one step (in arrival order) the watch list passes by: the first `max_per_step`
    whose prompt id is watched."""
    return [r for r in rows if r.prompt_id == WATCHED][:max_per_step]


Cap = tuple[str, int] | Callable[[Sequence[Row], int], set[str]] | None


def oracle(
    steps: Sequence[Sequence[Row]],
    cap: Cap,
    tier: int | None,
    watch: bool,
    max_per_step: int = 16,
    *,
    split: str = "train",
) -> tuple[dict[int, set[str]], dict[int, set[str]]]:
    """What the plain sink and the tier hold, per step (each step's rows in arrival order)."""
    plain: dict[int, set[str]] = {}
    tiered: dict[int, set[str]] = {}
    for step, rows in enumerate(steps):
        watched = watched_rows(rows, max_per_step) if watch else []
        others = [r for r in rows if r not in watched]
        if cap is None:
            kept = others
        else:
            chosen = cap(others, step) if callable(cap) else capped(cap[0], others, cap[1], step, split)
            kept = [r for r in others if r.uid in chosen]
        plain[step] = {r.uid for r in watched} | {r.uid for r in kept}
        if tier is not None:
            tiered[step] = {r.uid for r in watched} | top_bottom(kept, tier)
    return plain, tiered


def sample(r: Row) -> at.Sample:
    return at.Sample(
        messages=[{"role": "user", "content": r.prompt_id}, {"role": "assistant", "content": r.uid}],
        metadata={"uid": r.uid, "prompt_id": r.prompt_id, "reward": r.reward},
    )


def rollout_columns(rows: Sequence[Row]) -> dict[str, Any]:
    """The rows as log_rollouts takes them: token ids, rewards and metadata columns."""
    tok = rollouts.toy_tokenizer()
    seqs = [tok.encode(f"{r.prompt_id} {r.uid}").ids for r in rows]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = True
    return {
        "input_ids": ids,
        "tokenizer": tok,
        "rewards": torch.tensor([r.reward for r in rows], dtype=torch.float64),
        "attention_mask": attn,
        "prompt_lens": [1] * len(rows),
        "metadata": {"uid": [r.uid for r in rows], "prompt_id": [r.prompt_id for r in rows]},
    }


@st.composite
def runs(draw: st.DrawFn) -> list[list[Row]]:
    """A few steps of rows with distinct rewards; some rows carry the watched prompt id."""
    n_steps = draw(st.integers(1, 5))
    sizes = [draw(st.integers(1, 14)) for _ in range(n_steps)]
    rewards = draw(st.lists(st.integers(0, 10_000), min_size=sum(sizes), max_size=sum(sizes), unique=True))
    out, i = [], 0
    for step, size in enumerate(sizes):
        rows = []
        for j in range(size):
            prompt = WATCHED if draw(st.integers(0, 4)) == 0 else f"p{j % 3}"
            rows.append(Row(f"s{step}-{j}", prompt, rewards[i] / 7.0))
            i += 1
        out.append(rows)
    return out


def held(sink: MemorySink) -> dict[int, set[str]]:
    """The uids a sink holds, per step."""
    return {step: {r.sample.metadata["uid"] for r in recs} for step, recs in sink.steps().items()}
