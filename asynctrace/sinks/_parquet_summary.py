"""The summary a ParquetSink file's index sidecar carries in its footer (`_parquet_sidecar`): what
the viewer's overview needs of the file's records, so that a first open merges a few values a
file where it would read every record, and opens one sidecar a file where it opened three.

A JSON object of columns (each a list, one value a row), under `SUMMARY_KEY`:

``steps``: for each (split, step) of the file, the overview's row over the file's records alone
(the viewer's `_browse.overview_sql`), with the counts and sums its means are made of, so that
the rows of a step whose records lie in several files merge exactly: records, rewards (count,
mean, population variance's sum of squares), completions with a stop reason and those truncated,
lengths (count, sum), lags (count, sum, greatest), and the groups' count, tied groups and mean
spread. ``edges``: the steps of the file's first and last records (where a file that ends in the
middle of a step shares it with the next). ``groups``: each graded group of an edge step (count,
mean, sum of squares, least and greatest reward), so that a group split between two files merges
too. ``edge_prompts``: the prompt ids at each edge step. ``prompts``: each prompt id's distinct
steps and records in the file. A step several files hold that is not an edge step of each (a
straggler record) is not merged: the viewer reads those steps' index rows again.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["SUMMARY_KEY", "TRUNCATED", "summary_note"]

# The footer key of the summary (beside the sidecar's own note, `_parquet_sidecar.SIDECAR_KEY`).
SUMMARY_KEY = b"asynctrace.summary"
# Stop reasons that mean the completion hit its token budget (vLLM and SGLang say "length"); the
# viewer's pages count the same ones (`view._model` imports this).
TRUNCATED: tuple[str, ...] = ("length", "max_tokens", "truncated")


def _floats(column: Any) -> list[float | None]:
    """A column's values as JSON can hold them: NaN (a variance of nothing) as null."""
    return [
        None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)
        for v in column.to_pylist()
    ]


def _ints(column: Any) -> list[int | None]:
    return [None if v is None else int(v) for v in column.to_pylist()]


def _steps(pa: Any, index: Any) -> dict[str, list[Any]]:
    """The ``steps`` columns (see the module)."""
    import pyarrow.compute as pc

    stop = index.column("stop_reason")
    truncated = pc.if_else(
        pc.is_valid(stop),
        pc.cast(pc.is_in(stop, value_set=pa.array(TRUNCATED, pa.string())), pa.int64()),
        pa.scalar(None, pa.int64()),
    )
    rows = pa.table(
        {
            "split": index.column("split"),
            "step": index.column("step"),
            "reward": index.column("reward"),
            "truncated": truncated,
            "rlen": index.column("rlen"),
            "lag": pc.subtract(index.column("step"), index.column("policy_version")),
        }
    )
    population = pc.VarianceOptions(ddof=0)
    valid = pc.CountOptions(mode="only_valid")
    steps = rows.group_by(["split", "step"], use_threads=False).aggregate(
        [
            ("step", "count", pc.CountOptions(mode="all")),
            ("reward", "count", valid),
            ("reward", "mean"),
            ("reward", "variance", population),
            ("truncated", "count", valid),
            ("truncated", "sum"),
            ("rlen", "count", valid),
            ("rlen", "sum"),
            ("lag", "count", valid),
            ("lag", "sum"),
            ("lag", "max"),
        ]
    )
    per_step = (
        _group_rows(pa, index)
        .group_by(["split", "step"], use_threads=False)
        .aggregate([("spread", "count", pc.CountOptions(mode="all")), ("zero", "sum"), ("spread", "mean")])
    )
    joined = steps.join(per_step, ["split", "step"], join_type="left outer", use_threads=False)
    joined = joined.sort_by([("split", "ascending"), ("step", "ascending")])
    n = joined.column("reward_count")
    m2 = pc.multiply(joined.column("reward_variance"), pc.cast(n, pa.float64()))
    return {
        "split": joined.column("split").to_pylist(),
        "step": _ints(joined.column("step")),
        "samples": _ints(joined.column("step_count")),
        "reward_n": _ints(n),
        "reward_mean": _floats(joined.column("reward_mean")),
        "reward_m2": _floats(m2),
        "groups": [v or 0 for v in _ints(joined.column("spread_count"))],
        "zero_signal": [v or 0 for v in _ints(joined.column("zero_sum"))],
        "mean_spread": _floats(joined.column("spread_mean")),
        "stopped": _ints(joined.column("truncated_count")),
        "truncated": [v or 0 for v in _ints(joined.column("truncated_sum"))],
        "length_n": _ints(joined.column("rlen_count")),
        "length_sum": [v or 0 for v in _ints(joined.column("rlen_sum"))],
        "lag_n": _ints(joined.column("lag_count")),
        "lag_sum": [v or 0 for v in _ints(joined.column("lag_sum"))],
        "lag_max": _ints(joined.column("lag_max")),
    }


def _group_rows(pa: Any, index: Any) -> Any:
    """Each graded group's (split, step, grp, n, mean, m2, least, greatest, spread, zero)."""
    import pyarrow.compute as pc

    graded = index.filter(pc.and_(pc.is_valid(index.column("grp")), pc.is_valid(index.column("reward"))))
    population = pc.VarianceOptions(ddof=0)
    groups = graded.group_by(["split", "step", "grp"], use_threads=False).aggregate(
        [
            ("reward", "count"),
            ("reward", "mean"),
            ("reward", "variance", population),
            ("reward", "stddev", population),
            ("reward", "min"),
            ("reward", "max"),
        ]
    )
    # A group whose rewards are all equal has a spread of exactly 0 (DuckDB's running variance
    # gives 0 there; a two-pass one may leave a rounding error): told by its least and greatest.
    equal = pc.equal(groups.column("reward_min"), groups.column("reward_max"))
    n = groups.column("reward_count")
    return pa.table(
        {
            "split": groups.column("split"),
            "step": groups.column("step"),
            "grp": groups.column("grp"),
            "n": n,
            "mean": groups.column("reward_mean"),
            "m2": pc.if_else(
                equal, 0.0, pc.multiply(groups.column("reward_variance"), pc.cast(n, pa.float64()))
            ),
            "min": groups.column("reward_min"),
            "max": groups.column("reward_max"),
            "spread": pc.if_else(equal, 0.0, groups.column("reward_stddev")),
            "zero": pc.cast(equal, pa.int64()),
        }
    )


def _prompts(pa: Any, index: Any) -> dict[str, list[Any]]:
    """Each prompt id's distinct steps and records in the file."""
    import pyarrow.compute as pc

    prompted = index.filter(pc.is_valid(index.column("prompt")))
    counted = prompted.group_by(["prompt"], use_threads=False).aggregate(
        [
            ("step", "count_distinct", pc.CountOptions(mode="all")),
            ("step", "count", pc.CountOptions(mode="all")),
        ]
    )
    counted = counted.sort_by([("prompt", "ascending")])
    return {
        "prompt": counted.column("prompt").to_pylist(),
        "steps": _ints(counted.column("step_count_distinct")),
        "samples": _ints(counted.column("step_count")),
    }


def summary_note(pa: Any, index: Any) -> dict[str, Any]:
    """The summary (see the module) of a file whose index rows are `index`, in row order (every
    row has a split and a step)."""
    import pyarrow.compute as pc

    step = index.column("step")
    edges = sorted({int(step[0].as_py()), int(step[-1].as_py())})
    at_edges = index.filter(pc.is_in(step, value_set=pa.array(edges, pa.int64())))
    groups = _group_rows(pa, at_edges).sort_by(
        [("split", "ascending"), ("step", "ascending"), ("grp", "ascending")]
    )
    prompted = at_edges.filter(pc.is_valid(at_edges.column("prompt")))
    edge_prompts = (
        prompted.group_by(["step", "prompt"], use_threads=False)
        .aggregate([])
        .sort_by([("step", "ascending"), ("prompt", "ascending")])
    )
    return {
        "steps": _steps(pa, index),
        "edges": edges,
        "groups": {
            "split": groups.column("split").to_pylist(),
            "step": _ints(groups.column("step")),
            "grp": groups.column("grp").to_pylist(),
            "n": _ints(groups.column("n")),
            "mean": _floats(groups.column("mean")),
            "m2": _floats(groups.column("m2")),
            "min": _floats(groups.column("min")),
            "max": _floats(groups.column("max")),
        },
        "edge_prompts": {
            "step": _ints(edge_prompts.column("step")),
            "prompt": edge_prompts.column("prompt").to_pylist(),
        },
        "prompts": _prompts(pa, index),
    }
