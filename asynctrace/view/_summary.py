"""The overview's answers: kept beside the index for the next start of the same archive, or
merged from the summaries the sinks' sidecars carry (`merge_summaries`).

A later start reads every file's kept index before its pages can answer (most of its time on a
large archive); the overview needs only these few rows, so they are kept too, under a name
derived from every file's index name (path, size and time): a start that finds the same files
answers the overview from them at once, and any other page once the index is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import add, or_
from pathlib import Path
from typing import Any

import duckdb
import orjson

from ._browse import overview_sql
from ._model import StepRow
from ._partials import FileSummary, Partial, StepPart
from ._sidecar import Sidecars
from ._sql import listed

__all__ = ["MAX_PROMPTS", "Summary", "merge_summaries", "path_for", "read", "write"]

# Bumped whenever what is kept changes: older summaries are not read.
_VERSION = 1
# Prompt ids whose counts are kept (for the watch list); an archive with more keeps none.
MAX_PROMPTS = 100_000


@dataclass(frozen=True, slots=True)
class Summary:
    """The overview of one set of files: its steps, most frequent prompts, each prompt's (steps,
    samples) (None when there are more than `MAX_PROMPTS`), the files left out, and where each
    prompt id is (where known)."""

    overview: list[StepRow]
    frequent: list[tuple[str, int, int]]
    prompts: dict[str, tuple[int, int]] | None
    skipped: dict[str, str]
    # Each prompt id's files, a bit each in the order they were merged in (`merge_summaries`
    # only; not kept): a question by prompt reads only those files' sidecars.
    holders: dict[str, int] | None = None

    def prompt_counts(self, prompts: Sequence[str]) -> dict[str, tuple[int, int]]:
        held = self.prompts or {}
        return {p: held[p] for p in prompts if p in held}


def path_for(cache: Path, index_names: Sequence[str]) -> Path:
    """Where the summary of the files with these kept-index names goes."""
    digest = hashlib.sha256("\0".join([str(_VERSION), *index_names]).encode()).hexdigest()[:32]
    return cache / f"summary-{digest}.json"


def write(path: Path, summary: Summary) -> None:
    """Write it whole or not at all; a cache that cannot be written is skipped (it only saves time)."""
    body: dict[str, Any] = {
        "overview": [
            [getattr(row, name) for name in StepRow.__dataclass_fields__] for row in summary.overview
        ],
        "frequent": summary.frequent,
        "prompts": summary.prompts,
        "skipped": summary.skipped,
    }
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_bytes(orjson.dumps(body))
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def read(path: Path) -> Summary | None:
    """The summary kept at `path`; None when there is none, or it cannot be read."""
    try:
        body = orjson.loads(path.read_bytes())
        prompts = body["prompts"]
        return Summary(
            overview=[StepRow(*row) for row in body["overview"]],
            frequent=[(str(p), int(s), int(n)) for p, s, n in body["frequent"]],
            prompts=None if prompts is None else {str(k): (int(v[0]), int(v[1])) for k, v in prompts.items()},
            skipped={str(k): str(v) for k, v in body["skipped"].items()},
        )
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return None


def _row(split: str, step: int, parts: Sequence[StepPart], groups: list[Partial] | None) -> StepRow:
    """The overview's row of a step from its parts in each file that holds it; `groups`: every
    graded group of the step, merged across those files (None: the one file's figures stand)."""
    n, mean, m2 = 0, 0.0, 0.0
    for p in parts:
        if not p.reward_n or p.reward_mean is None or p.reward_m2 is None:
            continue
        # Chan et al.'s pairwise update: means and sums of squares merge without the rows.
        total = n + p.reward_n
        delta = p.reward_mean - mean
        mean += delta * p.reward_n / total
        m2 += p.reward_m2 + delta * delta * n * p.reward_n / total
        n = total
    if groups is None:
        (only,) = parts
        count, zero, spread = only.groups, only.zero_signal, only.mean_spread
    else:
        spreads = [0.0 if g.least == g.most else math.sqrt(g.m2 / g.n) for g in groups]
        count, zero = len(groups), sum(1 for g in groups if g.least == g.most)
        spread = sum(spreads) / count if count else None
    stopped = sum(p.stopped for p in parts)
    lengths = sum(p.length_n for p in parts)
    lags = sum(p.lag_n for p in parts)
    most = [p.lag_max for p in parts if p.lag_max is not None]
    return StepRow(
        split,
        step,
        sum(p.samples for p in parts),
        mean if n else None,
        math.sqrt(max(m2, 0.0) / n) if n else None,
        count,
        zero,
        spread,
        sum(p.truncated for p in parts) / stopped if stopped else None,
        sum(p.length_sum for p in parts) / lengths if lengths else None,
        sum(p.lag_sum for p in parts) / lags if lags else None,
        max(most) if most else None,
    )


def _merged_groups(partials: Sequence[dict[str, Partial]]) -> list[Partial]:
    """Each group of a step, its parts in several files merged into one."""
    merged: dict[str, Partial] = {}
    for held in partials:
        for grp, p in held.items():
            q = merged.get(grp)
            if q is None:
                merged[grp] = p
                continue
            total = q.n + p.n
            delta = p.mean - q.mean
            merged[grp] = Partial(
                total,
                q.mean + delta * p.n / total,
                q.m2 + p.m2 + delta * delta * q.n * p.n / total,
                min(q.least, p.least),
                max(q.most, p.most),
            )
    return list(merged.values())


def merge_summaries(con: duckdb.DuckDBPyConnection, files: Sequence[tuple[Sidecars, FileSummary]]) -> Summary:
    """The overview of the files with these sidecars and summaries (carried in each index
    sidecar's footer: `asynctrace.sinks._parquet_summary`), with no pass over the records: a
    step that one file holds is that file's row; a step that several hold at their edges (a file
    ends in the middle of it) is merged from their counts, sums and groups' parts. A step
    several hold otherwise (a record that came late) is computed again from those files' index
    rows of that step only. A prompt's steps are the sum of each file's, less each step counted
    in more than one. `con` is a cursor of the caller's own (it may get a temporary table)."""
    holders: dict[tuple[str, int], list[int]] = {}
    at_step: dict[int, set[int]] = {}  # a prompt's steps count a step once, whatever its split
    for i, (_, summary) in enumerate(files):
        for part in summary.steps:
            holders.setdefault((part.split, part.step), []).append(i)
            at_step.setdefault(part.step, set()).add(i)
    shared = {step: held for step, held in at_step.items() if len(held) > 1}
    again = {step for step, held in shared.items() if any(step not in files[i][1].edges for i in held)}
    parts_of = {(p.split, p.step): p for _, summary in files for p in summary.steps}
    rows: list[StepRow] = []
    for (split, step), held in holders.items():
        if step in again:
            continue  # every split of it is read again below
        if len(held) == 1:
            rows.append(_row(split, step, [parts_of[(split, step)]], None))
        else:
            parts = [p for i in held for p in files[i][1].steps if (p.split, p.step) == (split, step)]
            groups = _merged_groups([files[i][1].groups.at(split, step) for i in held])
            rows.append(_row(split, step, parts, groups))
    if again:
        # The index rows of those steps, read once: a list of steps lets the row groups'
        # statistics skip to them.
        holding = listed(sorted({files[i][0].by_row for step in again for i in shared[step]}))
        steps = ", ".join(str(int(step)) for step in sorted(again))
        con.execute(
            "CREATE OR REPLACE TEMP TABLE shared_rows AS SELECT filename, split, step, grp, prompt, "
            f"reward, stop_reason, rlen, policy_version FROM read_parquet({holding}, filename = true) "
            f"WHERE step IN ({steps})"
        )
        rows += [StepRow(*r) for r in con.execute(overview_sql("shared_rows")).fetchall()]
    overview = sorted(rows, key=lambda r: (r.split, r.step))
    prompts = _prompt_counts(con, [f[1] for f in files], shared, again)
    frequent = sorted(((p, s, n) for p, (s, n) in prompts.items()), key=lambda r: (-r[1], r[0]))[:50]
    small = len(prompts) <= MAX_PROMPTS
    located = _holders([f[1] for f in files]) if small else None
    return Summary(overview, frequent, prompts if small else None, {}, located)


def _holders(summaries: Sequence[FileSummary]) -> dict[str, int]:
    """Each prompt id's files: bit i set where the i-th summary counts it (C loops, as the counts)."""
    found: dict[str, int] = {}
    for i, summary in enumerate(summaries):
        names = summary.prompts.prompts
        found.update(zip(names, map(or_, map(found.get, names, repeat(0)), repeat(1 << i)), strict=False))
    return found


def _prompt_counts(
    con: duckdb.DuckDBPyConnection,
    summaries: Sequence[FileSummary],
    shared: dict[int, set[int]],
    again: set[int],
) -> dict[str, tuple[int, int]]:
    """Each prompt id's (distinct steps, records) over the files with these summaries; `shared`:
    the steps several hold (and which), `again`: those of them whose index rows are in table
    ``shared_rows``."""
    # Summed a file at a time by C loops (map, zip, dict.update): 0.5M prompt counts at 10M
    # records, where a Python loop a count took a second under load.
    steps: dict[str, int] = {}
    samples: dict[str, int] = {}
    for summary in summaries:
        names, counted, records = summary.prompts
        steps.update(zip(names, map(add, map(steps.get, names, repeat(0)), counted), strict=True))
        samples.update(zip(names, map(add, map(samples.get, names, repeat(0)), records), strict=True))
    # A step counted in each file that holds it: what is counted more than once is taken off.
    extra: Counter[str] = Counter()
    for step, held in shared.items():
        if step not in again:
            seen = Counter(p for i in held for p in summaries[i].edge_prompts.at(step))
            extra.update({p: n - 1 for p, n in seen.items() if n > 1})
    if again:
        extra.update(
            dict(
                con.execute(
                    "SELECT prompt, sum(n - 1) FROM (SELECT prompt, step, count(DISTINCT filename) AS n "
                    "FROM shared_rows WHERE prompt IS NOT NULL GROUP BY prompt, step) WHERE n > 1 "
                    "GROUP BY prompt"
                ).fetchall()
            )
        )
    for prompt, n in extra.items():
        steps[str(prompt)] -= int(n)
    return dict(zip(steps, zip(steps.values(), samples.values(), strict=True), strict=True))
