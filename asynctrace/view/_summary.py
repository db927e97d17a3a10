"""The overview's answers: kept beside the index for the next start of the same archive, or
merged from the sinks' per-file summaries (`merge_summaries`).

A later start reads every file's kept index before its pages can answer (most of its time on a
large archive); the overview needs only these few rows, so they are kept too, under a name
derived from every file's index name (path, size and time): a start that finds the same files
answers the overview from them at once, and any other page once the index is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import orjson

from ._browse import overview_sql
from ._model import StepRow
from ._sidecar import Sidecars

__all__ = ["MAX_PROMPTS", "Summary", "merge_summaries", "path_for", "read", "write"]

# Bumped whenever what is kept changes: older summaries are not read.
_VERSION = 1
# Prompt ids whose counts are kept (for the watch list); an archive with more keeps none.
MAX_PROMPTS = 100_000


@dataclass(frozen=True, slots=True)
class Summary:
    """The overview of one set of files: its steps, most frequent prompts, each prompt's (steps,
    samples) (None when there are more than `MAX_PROMPTS`), and the files left out."""

    overview: list[StepRow]
    frequent: list[tuple[str, int, int]]
    prompts: dict[str, tuple[int, int]] | None
    skipped: dict[str, str]

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


def _listed(paths: Sequence[str]) -> str:
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def merge_summaries(con: duckdb.DuckDBPyConnection, sidecars: Sequence[Sidecars]) -> Summary:
    """The overview of the files with these sidecars, from each file's ``steps`` and ``counts``
    (`asynctrace.sinks._parquet_summary`): a step that only one file holds is that file's row
    as it is; a step that several hold (a file ends in the middle of one) is computed again
    from those files' index rows of that step only. A prompt's steps are the sum of each
    file's, less each step counted in more than one file. `con` is a cursor of the caller's
    own (it gets a temporary table)."""
    index_of = {s.steps: s.by_row for s in sidecars}
    every = con.execute(
        f"SELECT filename, * EXCLUDE (filename) FROM read_parquet({_listed(list(index_of))}, filename = true)"
    ).fetchall()
    holders: dict[tuple[str, int], set[str]] = {}
    at_step: dict[int, set[str]] = {}  # a prompt's steps count a step once, whatever its split
    for r in every:
        holders.setdefault((r[1], r[2]), set()).add(index_of[r[0]])
        at_step.setdefault(r[2], set()).add(index_of[r[0]])
    rows = [r[1:] for r in every if len(holders[(r[1], r[2])]) == 1]
    twice = {step: files for step, files in at_step.items() if len(files) > 1}
    if twice:
        # The index rows of every step in more than one file, read once: a list of steps lets
        # the row groups' statistics skip to them.
        holding = _listed(sorted(set().union(*twice.values())))
        steps = ", ".join(str(int(step)) for step in sorted(twice))
        con.execute(
            "CREATE OR REPLACE TEMP TABLE shared_rows AS SELECT filename, split, step, grp, prompt, "
            f"reward, stop_reason, rlen, policy_version FROM read_parquet({holding}, filename = true) "
            f"WHERE step IN ({steps})"
        )
        keys = ", ".join(f"({_quoted(k[0])}, {int(k[1])})" for k, f in holders.items() if len(f) > 1)
        if keys:
            relation = f"(SELECT * FROM shared_rows WHERE (split, step) IN ({keys}))"
            rows += con.execute(overview_sql(relation)).fetchall()
    overview = sorted((StepRow(*r) for r in rows), key=lambda r: (r.split, r.step))
    prompts = _prompt_counts(con, [s.counts for s in sidecars], bool(twice))
    frequent = sorted(((p, s, n) for p, (s, n) in prompts.items()), key=lambda r: (-r[1], r[0]))[:50]
    return Summary(overview, frequent, prompts if len(prompts) <= MAX_PROMPTS else None, {})


def _prompt_counts(
    con: duckdb.DuckDBPyConnection, counts: Sequence[str], twice: bool
) -> dict[str, tuple[int, int]]:
    """Each prompt id's (distinct steps, records) over the files with these ``counts`` sidecars;
    with `twice`, table ``shared_rows`` holds the index rows of the steps in more than one file."""
    summed = con.execute(
        f"SELECT prompt, sum(steps), sum(samples) FROM read_parquet({_listed(counts)}) GROUP BY prompt"
    ).fetchall()
    found = {str(p): (int(s), int(n)) for p, s, n in summed}
    if twice:
        # Counted once in each file that holds it: what those files' index rows say is taken off.
        extra = con.execute(
            "SELECT prompt, sum(n - 1) FROM (SELECT prompt, step, count(DISTINCT filename) AS n "
            "FROM shared_rows WHERE prompt IS NOT NULL GROUP BY prompt, step) WHERE n > 1 GROUP BY prompt"
        ).fetchall()
        for prompt, n in extra:
            steps, total = found[str(prompt)]
            found[str(prompt)] = (steps - int(n), total)
    return found


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
