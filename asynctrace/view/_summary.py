"""The overview's answers, kept beside the index for the next start of the same archive.

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

import orjson

from ._model import StepRow

__all__ = ["MAX_PROMPTS", "Summary", "path_for", "read", "write"]

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
