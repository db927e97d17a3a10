"""A file's summary as its index sidecar's footer carries it (`asynctrace.sinks._parquet_summary`),
read as data: every column checked for its type and length, anything else refused (the file is
then read as if it had no sidecar)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

__all__ = ["EdgePrompts", "FileSummary", "Groups", "Partial", "PromptCounts", "StepPart", "parse_summary"]


class Partial(NamedTuple):
    """A group's rewards in one file: how many, their mean and sum of squared deviations, and
    the least and greatest (what merges exactly with the same group's in another file)."""

    n: int
    mean: float
    m2: float
    least: float
    most: float


@dataclass(frozen=True, slots=True)
class StepPart:
    """One (split, step) of one file: the overview's figures and what they are made of."""

    split: str
    step: int
    samples: int
    reward_n: int
    reward_mean: float | None
    reward_m2: float | None
    groups: int
    zero_signal: int
    mean_spread: float | None
    stopped: int
    truncated: int
    length_n: int
    length_sum: int
    lag_n: int
    lag_sum: int
    lag_max: int | None


class PromptCounts(NamedTuple):
    """Each prompt id of a file (in order), its distinct steps and its records there."""

    prompts: list[str]
    steps: list[int]
    samples: list[int]


class Groups(NamedTuple):
    """The groups of a file's edge steps, a column each (as the footer holds them): a step's are
    made `Partial` only when another file shares that step (`at`)."""

    split: list[str]
    step: list[int]
    grp: list[str]
    n: list[int]
    mean: list[float]
    m2: list[float]
    least: list[float]
    most: list[float]

    def at(self, split: str, step: int) -> dict[str, Partial]:
        """Each group of this (split, step), by id."""
        rows = [i for i, key in enumerate(zip(self.split, self.step, strict=True)) if key == (split, step)]
        return {
            self.grp[i]: Partial(self.n[i], self.mean[i], self.m2[i], self.least[i], self.most[i])
            for i in rows
        }


class EdgePrompts(NamedTuple):
    """The prompt ids at a file's edge steps: (step, prompt) pairs, a column each."""

    step: list[int]
    prompt: list[str]

    def at(self, step: int) -> set[str]:
        return {p for s, p in zip(self.step, self.prompt, strict=True) if s == step}


@dataclass(frozen=True, slots=True)
class FileSummary:
    """One file's summary: its steps, edge steps (those of its first and last records), the
    groups of its edge steps, the prompt ids at each edge step, and each prompt id's counts."""

    steps: list[StepPart]
    edges: frozenset[int]
    groups: Groups
    edge_prompts: EdgePrompts
    prompts: PromptCounts


class _Refused(Exception):
    """A value of another type or shape than the sink writes."""


class _Kind(NamedTuple):
    """What a column's values may be: their types (a bool is not an int here), and whether each
    is a count (not below 0)."""

    types: frozenset[type]
    at_least_zero: bool = False


_STR, _INT = _Kind(frozenset({str})), _Kind(frozenset({int}))
_COUNT, _FLOAT = _Kind(frozenset({int}), at_least_zero=True), _Kind(frozenset({float, int}))
_NULLABLE = frozenset({type(None)})


def _column(body: dict[str, Any], name: str, kind: _Kind, nullable: bool = False) -> list[Any]:
    """One column, its values' types checked (a pass in C over its values, not a call a value)."""
    values = body.get(name)
    if not isinstance(values, list):
        raise _Refused
    if not set(map(type, values)) <= (kind.types | _NULLABLE if nullable else kind.types):
        raise _Refused
    if (
        kind.at_least_zero
        and min((v for v in values if v is not None) if nullable else values, default=0) < 0
    ):
        raise _Refused
    return values


def _table(body: Any, spec: dict[str, tuple[_Kind, bool]]) -> list[list[Any]]:
    """The columns `spec` names (name -> (kind, whether null may be)), all of one length."""
    if not isinstance(body, dict):
        raise _Refused
    columns = [_column(body, name, kind, nullable) for name, (kind, nullable) in spec.items()]
    if len({len(c) for c in columns}) > 1:
        raise _Refused
    return columns


_STEPS: dict[str, tuple[_Kind, bool]] = {
    "split": (_STR, False),
    "step": (_INT, False),
    "samples": (_COUNT, False),
    "reward_n": (_COUNT, False),
    "reward_mean": (_FLOAT, True),
    "reward_m2": (_FLOAT, True),
    "groups": (_COUNT, False),
    "zero_signal": (_COUNT, False),
    "mean_spread": (_FLOAT, True),
    "stopped": (_COUNT, False),
    "truncated": (_COUNT, False),
    "length_n": (_COUNT, False),
    "length_sum": (_INT, False),
    "lag_n": (_COUNT, False),
    "lag_sum": (_INT, False),
    "lag_max": (_INT, True),
}
_GROUPS: dict[str, tuple[_Kind, bool]] = {
    "split": (_STR, False),
    "step": (_INT, False),
    "grp": (_STR, False),
    "n": (_COUNT, False),
    "mean": (_FLOAT, False),
    "m2": (_FLOAT, False),
    "min": (_FLOAT, False),
    "max": (_FLOAT, False),
}
_EDGE_PROMPTS: dict[str, tuple[_Kind, bool]] = {"step": (_INT, False), "prompt": (_STR, False)}
_PROMPTS: dict[str, tuple[_Kind, bool]] = {
    "prompt": (_STR, False),
    "steps": (_COUNT, False),
    "samples": (_COUNT, False),
}


def parse_summary(raw: bytes | str) -> FileSummary | None:
    """The summary in `raw` (JSON), or None where it is not one the sink writes."""
    try:
        body = orjson.loads(raw)
        if not isinstance(body, dict) or not isinstance(body.get("edges"), list):
            return None
        edges = frozenset(_column(body, "edges", _INT))
        steps = [StepPart(*row) for row in zip(*_table(body.get("steps"), _STEPS), strict=True)]
        groups = Groups(*_table(body.get("groups"), _GROUPS))
        edge_prompts = EdgePrompts(*_table(body.get("edge_prompts"), _EDGE_PROMPTS))
        if not set(groups.step) | set(edge_prompts.step) <= edges:
            return None  # what the sink writes of its edge steps only
        prompts = PromptCounts(*_table(body.get("prompts"), _PROMPTS))
        return FileSummary(steps, edges, groups, edge_prompts, prompts)
    except (orjson.JSONDecodeError, _Refused):
        return None
