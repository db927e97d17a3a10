"""The summary sidecars of a ParquetSink file (`_parquet_sidecar`): what the viewer's overview
needs of its records, so that an open merges a few rows a file where it would read every record.

``steps``: for each (split, step) of the file, the overview's row over the file's records alone
(the viewer's `_browse.overview_sql`, column for column). A step whose records lie in two files
is in both: the viewer recomputes those steps from the index rows (they are few: a file ends in
one step), every other one it takes as it is. ``counts``: for each prompt id, the distinct steps
it occurs at in the file and its records; the viewer subtracts a step counted in two files.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TRUNCATED", "counts_table", "steps_table"]

# Stop reasons that mean the completion hit its token budget (vLLM and SGLang say "length"); the
# viewer's pages count the same ones (`view._model` imports this).
TRUNCATED: tuple[str, ...] = ("length", "max_tokens", "truncated")


def steps_table(pa: Any, index: Any) -> Any:
    """The ``steps`` sidecar of a file whose index rows are `index` (every row has a split and a step)."""
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
    steps = rows.group_by(["split", "step"], use_threads=False).aggregate(
        [
            ("step", "count", pc.CountOptions(mode="all")),
            ("reward", "mean"),
            ("reward", "stddev", population),
            ("truncated", "mean"),
            ("rlen", "mean"),
            ("lag", "mean"),
            ("lag", "max"),
        ]
    )
    graded = index.filter(pc.and_(pc.is_valid(index.column("grp")), pc.is_valid(index.column("reward"))))
    groups = graded.group_by(["split", "step", "grp"], use_threads=False).aggregate(
        [("reward", "stddev", population), ("reward", "min"), ("reward", "max")]
    )
    # A group whose rewards are all equal has a spread of exactly 0 (DuckDB's running variance
    # gives 0 there; a two-pass one may leave a rounding error): told by its least and greatest.
    equal = pc.equal(groups.column("reward_min"), groups.column("reward_max"))
    spread = pc.if_else(equal, 0.0, groups.column("reward_stddev"))
    per_step = (
        pa.table(
            {
                "split": groups.column("split"),
                "step": groups.column("step"),
                "spread": spread,
                "zero": pc.cast(equal, pa.int64()),
            }
        )
        .group_by(["split", "step"], use_threads=False)
        .aggregate([("spread", "count", pc.CountOptions(mode="all")), ("zero", "sum"), ("spread", "mean")])
    )
    joined = steps.join(per_step, ["split", "step"], join_type="left outer", use_threads=False)
    joined = joined.sort_by([("split", "ascending"), ("step", "ascending")])
    return pa.table(
        {
            "split": pc.cast(joined.column("split"), pa.string()),
            "step": pc.cast(joined.column("step"), pa.int64()),
            "samples": pc.cast(joined.column("step_count"), pa.int64()),
            "reward_mean": joined.column("reward_mean"),
            "reward_std": joined.column("reward_stddev"),
            "groups": pc.fill_null(pc.cast(joined.column("spread_count"), pa.int64()), 0),
            "zero_signal": pc.fill_null(pc.cast(joined.column("zero_sum"), pa.int64()), 0),
            "mean_spread": joined.column("spread_mean"),
            "truncated": joined.column("truncated_mean"),
            "length_mean": joined.column("rlen_mean"),
            "lag_mean": joined.column("lag_mean"),
            "lag_max": pc.cast(joined.column("lag_max"), pa.int64()),
        }
    )


def counts_table(pa: Any, index: Any) -> Any:
    """The ``counts`` sidecar of a file whose index rows are `index`: (prompt, steps, records)."""
    import pyarrow.compute as pc

    prompted = index.filter(pc.is_valid(index.column("prompt")))
    counted = prompted.group_by(["prompt"], use_threads=False).aggregate(
        [
            ("step", "count_distinct", pc.CountOptions(mode="all")),
            ("step", "count", pc.CountOptions(mode="all")),
        ]
    )
    counted = counted.sort_by([("prompt", "ascending")])
    return pa.table(
        {
            "prompt": pc.cast(counted.column("prompt"), pa.string()),
            "steps": pc.cast(counted.column("step_count_distinct"), pa.int64()),
            "samples": pc.cast(counted.column("step_count"), pa.int64()),
        }
    )
