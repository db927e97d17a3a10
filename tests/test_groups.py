"""Which group a sample belongs to, and the summary of a step's groups."""

from __future__ import annotations

import enum
import math
from typing import Any

import torch

import asynctrace as at
from asynctrace._records.encode import encode_sample
from asynctrace._records.groups import DEFAULT_GROUP_KEYS, GroupSummary, group_of, payload_group
from asynctrace.testing import MemorySink
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


class _Prompt(enum.Enum):
    A = 0
    B = 1


def test_a_group_named_by_a_tensor_or_an_enum_is_the_group_its_payload_names() -> None:
    """A 0-d tensor, a numpy scalar or an enum member names the group its encoded value names,
    before encoding as after (a tensor is hashed by identity: read as it is, each sample would
    be a group of its own)."""
    import numpy as np

    for value, expected in ((torch.tensor(3), 3), (np.int64(3), 3), (np.array(3), 3), (_Prompt.B, 1)):
        meta = {"prompt_index": value}
        assert group_of(meta) == expected
        payload = encode_sample({"prompt": "q", "response": "r", "metadata": meta}, 0)[0]
        assert payload_group(payload, DEFAULT_GROUP_KEYS) == expected
    assert group_of({"prompt_index": (torch.tensor(1), "a")}) == (1, "a")


def _written(ids: list[Any], watch: at.Watch | None = None) -> list[float]:
    sink = MemorySink()
    rows = [
        {"prompt": f"q{i}", "response": "r", "reward": r, "metadata": {"prompt_index": ids[i]}}
        for i, r in enumerate([0.0, 10.0, 4.0, 4.0])
    ]
    with at.TraceSession(
        "p",
        sinks=[sink],
        max_traces_per_step=2,
        sampler=at.GroupSampler("top", group_size=2),
        watch=watch,
        health_metrics=False,
    ) as session:
        session.log_samples(rows, step=0)
    return sorted(float(r.sample.metadata["reward"]) for r in sink.records)


def test_the_group_sampler_and_the_watch_read_tensor_and_enum_prompt_ids() -> None:
    """Prompt ids given as `batch["index"][i]` (0-d tensors) or enum members form the same groups
    as plain ints: the best group by mean (rewards 0 and 10) is written whole; a watch on the id
    finds its samples."""
    assert _written([0, 0, 1, 1]) == [0.0, 10.0]
    assert _written([torch.tensor(i) for i in (0, 0, 1, 1)]) == [0.0, 10.0]
    assert _written([_Prompt.A, 0, _Prompt.B, 1]) == [0.0, 10.0]
    # Watched: group 1 passes the cap whole, as well as the pick.
    watched = at.Watch(ids=[_Prompt.B])
    assert _written([torch.tensor(i) for i in (0, 0, 1, 1)], watched) == [0.0, 4.0, 4.0, 10.0]


def test_a_call_read_name_by_name_gives_each_sample_s_own_group() -> None:
    """The encoder reads a call's groups as `group_of` reads each sample's, whatever the call mixes."""
    from asynctrace._engine.encoder import Encoder
    from asynctrace._records.groups import GroupKeyError

    encoder = Encoder(
        trace_key="traces/{split}",
        redact=None,
        skip_invalid=True,
        max_bytes=1 << 20,
        score_needed_by=None,
        precheck=True,
        keeps=lambda *args, **kwargs: None,
        id_prefix="t",
        group_key=DEFAULT_GROUP_KEYS,
    )

    def sample(**metadata: Any) -> at.Sample:
        return at.Sample(messages=[{"role": "user", "content": "q"}], metadata=metadata)

    calls = {
        "every one by prompt_index": [sample(prompt_index=i // 2) for i in range(6)],
        "every one by group_uid": [sample(group_uid=f"g{i}", prompt_index=i) for i in range(4)],
        "some by group_uid, some by prompt_index": [sample(group_uid="g"), sample(prompt_index=1)],
        "some named, some not": [sample(prompt_index=1), sample(reward=1.0)],
        "none named": [sample(reward=1.0), sample()],
        "a bool": [sample(prompt_index=1), sample(prompt_index=True)],
        "a float": [sample(prompt_index=1), sample(prompt_index=2.0)],
        "a list": [sample(prompt_index=1), sample(prompt_index=[1, 2])],
        "a dict sample": [sample(prompt_index=1), {"prompt": "p", "response": "r", "prompt_index": 2}],
    }
    for name, items in calls.items():
        expected: list[Any] = []
        invalid: list[int] = []
        for i, item in enumerate(items):
            metadata = item.metadata if isinstance(item, at.Sample) else item
            try:
                expected.append(group_of(metadata, DEFAULT_GROUP_KEYS))
            except GroupKeyError:
                expected.append(None)
                invalid.append(i)
        groups, bad = encoder.groups_of(items)
        assert (groups, sorted(bad)) == (expected, invalid), name
