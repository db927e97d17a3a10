"""Which group a sample belongs to, and the summary of a step's groups."""

from __future__ import annotations

import math

from asynctrace._records.groups import GroupSummary, group_of
from tests._groups import summarize_groups


def test_group_uid_wins_over_prompt_index() -> None:
    """`group_uid` names the group when present, else `prompt_index`, else there is none."""
    assert group_of({"group_uid": "g1", "prompt_index": 3}) == "g1"
    assert group_of({"prompt_index": 3}) == 3
    assert group_of({"reward": 1.0}) is None


def test_configured_keys_and_functions() -> None:
    """A key name, a sequence of names or a function of the metadata chooses the group."""
    meta = {"uid": ["a", 1], "problem": "p7"}
    assert group_of(meta, "problem") == "p7"
    assert group_of(meta, ("missing", "uid")) == ("a", 1)
    assert group_of(meta, lambda m: str(m["problem"]).upper()) == "P7"


def test_summary_counts_zero_spread_groups() -> None:
    """Groups whose rewards are all equal count as zero spread; the mean spread is the mean of stds."""
    summary = summarize_groups({"a": [1.0, 1.0, 1.0], "b": [0.0, 1.0], "c": [0.0, 0.0], "d": []})
    assert summary.groups == 3 and summary.zero_spread == 2
    assert math.isclose(summary.mean_spread, 0.5 / 3)
    assert summarize_groups({}) == GroupSummary(0, 0, 0.0)
