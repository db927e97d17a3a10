"""The composition oracle, written from docs/choosing.md and docs/concepts.md (not from the code),
shared by the one-process, torch.distributed and Ray composition tests.

Per (split, step), from the docs' definitions alone:
- watched: a sample whose prompt id is on the watch list, the first `max_per_step` (16 unless
  given) of a step; it passes the session's cap and every `Selected` sink's selection, and is
  written everywhere; later ones go on to the cap like any other sample;
- the session's cap keeps, of the other samples, `first`: the first `k` to arrive,
  `top_bottom`: the `ceil(k/2)` highest and `floor(k/2)` lowest rewards, `reservoir`: a uniform
  random `k` (which ones is the seed's: the oracle knows only how many, and from which samples),
  a `GroupSampler`: whole prompt groups (`metadata["prompt_id"]` here) as choosing.md's "whole
  groups" takes them (tests/_group_oracle.py), or any function of the step's rows and the step;
- across torch.distributed ranks "the first `max_per_step`" are in rank order, then each rank's
  arrival order; across Ray actors they are the first to reach the collector: a step's rows are
  given in that order;
- a plain sink holds the watched samples and what the session kept; a `Selected` sink holds the
  watched samples and its own sampler's pick of what the session kept, in the order it was logged.

A selection is written as a tuple: ``("first", k)``, ``("top_bottom", k)``, ``("reservoir", k)``
or ``("group", k, policy, count)``; a tier given as an int `k` is ``("top_bottom", k)``.
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

from ._group_oracle import pick as group_pick

WATCHED = "w"
GROUP_KEY = "prompt_id"  # the metadata key that names a row's prompt group


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


def watched_rows(rows: Sequence[Row], max_per_step: int = 16) -> list[Row]:
    """The rows of one step (in arrival order) the watch list passes by: the first `max_per_step`
    whose prompt id is watched."""
    return [r for r in rows if r.prompt_id == WATCHED][:max_per_step]


Selection = tuple[Any, ...]
Cap = Selection | Callable[[Sequence[Row], int], set[str]] | None


def choose(selection: Selection, rows: Sequence[Row], step: int, split: str = "train") -> set[str] | None:
    """The uids a selection keeps of one step's `rows` (in the order they were logged); None for
    `reservoir`, whose pick only its seed knows. ``("group:<policy>", k)`` is the group sampler
    with that policy, counting samples, seeded with `GROUP_SEED`."""
    kind, k = selection[0], selection[1]
    if kind == "reservoir":
        return None
    if kind.startswith("group"):
        if kind == "group":
            policy, count, seed = selection[2], selection[3] if len(selection) > 3 else "samples", 0
        else:
            policy, count, seed = kind.removeprefix("group:"), "samples", GROUP_SEED
        rewards = [(r.prompt_id, r.reward) for r in rows]
        chosen = group_pick(rewards, k, policy, count=count, seed=seed, split=split, step=step)
        return {rows[i].uid for i in chosen}
    return PICK[kind](rows, k)


def oracle(
    steps: Sequence[Sequence[Row]],
    cap: Cap,
    tier: int | Selection | None,
    watch: bool,
    max_per_step: int = 16,
    *,
    plain_held: dict[int, set[str]] | None = None,
    split: str = "train",
) -> tuple[dict[int, set[str]], dict[int, set[str]]]:
    """What the plain sink and the tier hold, per step (each step's rows in arrival order). With a
    `reservoir` cap the session's pick is read from `plain_held` (what the plain sink holds),
    after checking that it is as many as the cap allows and only from the samples the cap chose
    among."""
    tiered_by = ("top_bottom", tier) if isinstance(tier, int) else tier
    plain: dict[int, set[str]] = {}
    tiered: dict[int, set[str]] = {}
    for step, rows in enumerate(steps):
        watched = watched_rows(rows, max_per_step) if watch else []
        others = [r for r in rows if r not in watched]
        shown = {r.uid for r in watched}
        if cap is None:
            kept: set[str] | None = {r.uid for r in others}
        elif callable(cap):
            kept = cap(others, step)
        else:
            kept = choose(cap, others, step, split)
        if kept is None:
            assert cap is not None and not callable(cap)
            kept = (plain_held or {}).get(step, set()) - shown
            assert kept <= {r.uid for r in others}, (step, kept)
            assert len(kept) == min(cap[1], len(others)), (step, kept)
        plain[step] = shown | kept
        if tiered_by is not None:
            tier_kept = choose(tiered_by, [r for r in others if r.uid in kept], step, split)
            assert tier_kept is not None, "a reservoir tier's pick is the seed's"
            tiered[step] = shown | tier_kept
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
    """A few steps of rows with distinct rewards in up to four prompt groups, each spread over
    the step; some rows carry the watched prompt id."""
    n_steps = draw(st.integers(1, 5))
    sizes = [draw(st.integers(1, 14)) for _ in range(n_steps)]
    rewards = draw(st.lists(st.integers(0, 10_000), min_size=sum(sizes), max_size=sum(sizes), unique=True))
    out, i = [], 0
    for step, size in enumerate(sizes):
        rows = []
        for j in range(size):
            prompt = WATCHED if draw(st.integers(0, 4)) == 0 else f"p{j % 4}"
            rows.append(Row(f"s{step}-{j}", prompt, rewards[i] / 7.0))
            i += 1
        out.append(rows)
    return out


def held(sink: MemorySink) -> dict[int, set[str]]:
    """The uids a sink holds, per step."""
    return {step: {r.sample.metadata["uid"] for r in recs} for step, recs in sink.steps().items()}
