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
    file's, less each step counted in more than one file."""
    steps = _listed([s.steps for s in sidecars])
    index_of = {s.steps: s.by_row for s in sidecars}
    shared = con.execute(
        f"SELECT split, step, list(filename) FROM read_parquet({steps}, filename = true) "
        "GROUP BY split, step HAVING count(*) > 1"
    ).fetchall()
    rows = con.execute(
        f"SELECT * EXCLUDE (filename) FROM read_parquet({steps}, filename = true) "
        "WHERE (split, step) NOT IN (SELECT (split, step) FROM read_parquet("
        f"{steps}) GROUP BY split, step HAVING count(*) > 1)"
    ).fetchall()
    if shared:
        holding = _listed(sorted({index_of[f] for _, _, names in shared for f in names}))
        keys = ", ".join(f"({_quoted(split)}, {int(step)})" for split, step, _ in shared)
        at = ", ".join(str(int(step)) for step in sorted({step for _, step, _ in shared}))
        relation = (
            f"(SELECT * FROM read_parquet({holding}) WHERE step IN ({at}) AND (split, step) IN ({keys}))"
        )
        rows += con.execute(overview_sql(relation)).fetchall()
    overview = sorted((StepRow(*r) for r in rows), key=lambda r: (r.split, r.step))
    prompts = _prompt_counts(con, sidecars)
    frequent = sorted(((p, s, n) for p, (s, n) in prompts.items()), key=lambda r: (-r[1], r[0]))[:50]
    return Summary(overview, frequent, prompts if len(prompts) <= MAX_PROMPTS else None, {})


def _prompt_counts(
    con: duckdb.DuckDBPyConnection, sidecars: Sequence[Sidecars]
) -> dict[str, tuple[int, int]]:
    """Each prompt id's (distinct steps, records) over the files with these sidecars."""
    steps = _listed([s.steps for s in sidecars])
    counts = _listed([s.counts for s in sidecars])
    summed = con.execute(
        f"SELECT prompt, sum(steps), sum(samples) FROM read_parquet({counts}) GROUP BY prompt"
    ).fetchall()
    found = {str(p): (int(s), int(n)) for p, s, n in summed}
    # A step in two files is counted once in each: what the files' index rows of it say is taken off.
    index_of = {s.steps: s.by_row for s in sidecars}
    twice = con.execute(
        f"SELECT step, list(DISTINCT filename) FROM read_parquet({steps}, filename = true) "
        "GROUP BY step HAVING count(DISTINCT filename) > 1"
    ).fetchall()
    if twice:
        holding = _listed(sorted({index_of[f] for _, names in twice for f in names}))
        at = ", ".join(str(int(step)) for step, _ in twice)
        extra = con.execute(
            f"SELECT prompt, sum(n - 1) FROM (SELECT prompt, step, count(DISTINCT filename) AS n "
            f"FROM read_parquet({holding}, filename = true) WHERE step IN ({at}) AND prompt IS NOT NULL "
            "GROUP BY prompt, step) WHERE n > 1 GROUP BY prompt"
        ).fetchall()
        for prompt, n in extra:
            s, total = found[str(prompt)]
            found[str(prompt)] = (s - int(n), total)
    return found


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
