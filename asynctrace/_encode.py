"""Validate and encode samples once, in the caller, into trace records; with a cap, encode only
what the cap would keep."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ._checks import MAX_STEP, check_split, check_step
from ._record import (
    UNKNOWN,
    Sample,
    SampleLike,
    TraceRecord,
    as_list,
    encode_checked,
    encode_samples,
    missing_score,
    preview_score,
    records_for,
)
from ._security import shown
from .exceptions import RecordError

__all__ = ["Encoder"]

# Which of a submission's samples (by score) the cap would keep if offered now; None: cannot tell.
Keeps = Callable[..., list[bool] | None]


class Encoder:
    """Turns samples into records for one session. `score_needed_by` is the capped sampler's
    name when it ranks by score (every sample then needs one); with `precheck`, only what the
    cap would keep is encoded (see `encode_kept`)."""

    def __init__(
        self,
        *,
        trace_key: str,
        redact: Callable[[Sample], Sample] | None,
        skip_invalid: bool,
        max_bytes: int,
        score_needed_by: str | None,
        precheck: bool,
        keeps: Keeps,
        id_prefix: str,
    ) -> None:
        self.trace_key = trace_key
        self.redact = redact
        self.skip_invalid = skip_invalid
        self.max_bytes = max_bytes
        self.score_needed_by = score_needed_by
        self.precheck = precheck
        self._keeps = keeps
        self._keys: dict[str, str] = {}
        self._ids = itertools.count()
        self._id_prefix = id_prefix

    def key_for(self, split: str) -> str:
        key = self._keys.get(split)
        if key is None:
            # Once per split, not on every call: one a sink could not store is refused here.
            check_split(split)
            try:
                key = self.trace_key.format(split=split)
            except Exception:  # "{split[3]}" with a shorter split
                raise ValueError(
                    f"trace_key {shown(self.trace_key)} cannot be formatted with split {shown(split)}"
                ) from None
            self._keys[split] = key
        return key

    def encode(
        self,
        samples: SampleLike | Iterable[SampleLike],
        step: int,
        split: str,
        *,
        precheck: bool = True,
        skipped: list[int] | None = None,
    ) -> tuple[list[TraceRecord], int, int]:
        """Validate and encode samples once, in the caller; returns records, the invalid count and
        how many the cap refused before they were encoded (only with `precheck`). Without
        `precheck`, the indices of samples left out as invalid go to `skipped`."""
        if type(step) is not int or step < 0 or step > MAX_STEP or type(split) is not str or not split:
            check_step(step, split)  # raises, or accepts an int subclass
        items = samples if type(samples) is list else as_list(samples)
        key = self._keys.get(split) or self.key_for(split)
        now = time.time()
        kept = self.encode_kept(items, step, split) if precheck and self.precheck else None
        if kept is not None:
            encoded, invalid, refused = kept
        else:
            refused = 0
            encoded, invalid = encode_samples(
                items,
                redact=self.redact,
                skip_invalid=self.skip_invalid,
                max_bytes=self.max_bytes,
                score_needed_by=self.score_needed_by,
                skipped=skipped,
            )
        return records_for(encoded, self._ids, self._id_prefix, step, split, key, now), invalid, refused

    def encode_kept(
        self, items: Sequence[Any], step: int, split: str
    ) -> tuple[list[tuple[bytes, float | None]], int, int] | None:
        """Encode only the samples the cap would keep if offered now; None when that cannot be
        told cheaply (the caller then encodes everything).

        A sample the cap refuses is counted as capped without being encoded or validated, as
        `log_rollouts` skips decoding rows it will not keep. The gate still decides at
        admission; a selection only gets harder to enter, so nothing refused here could have
        been kept there.
        """
        n = len(items)
        ranked_by = self.score_needed_by  # the sampler's name when it ranks by score
        skip = self.skip_invalid
        invalid: set[int] = set()
        if ranked_by is not None:
            scores: list[Any] = [preview_score(obj) for obj in items]
            if any(sc is UNKNOWN for sc in scores):
                return None
            for i, sc in enumerate(scores):
                if sc is None:
                    if not skip:
                        raise missing_score(i, ranked_by)
                    invalid.add(i)
        elif all(type(obj) is Sample or type(obj) is dict for obj in items):
            scores = [None] * n
        else:
            return None  # an unusual item gets the full path, and its error if it is wrong
        candidates = [i for i in range(n) if i not in invalid]
        encoded: dict[int, tuple[bytes, float | None]] = {}
        while candidates:
            keeps = self._keeps([scores[i] for i in candidates], split=split, step=step)
            if keeps is None:
                return None
            failed = False
            for i, keep in zip(candidates, keeps, strict=True):
                if not keep or i in encoded:
                    continue
                try:
                    pair = encode_checked(items[i], i, None, self.max_bytes, "max_queue_bytes", None)
                except RecordError:
                    if not skip:
                        raise
                    invalid.add(i)
                    failed = True
                    continue
                if ranked_by is not None and pair[1] != scores[i]:
                    return None  # the preview misread this shape; let the full path decide
                encoded[i] = pair
            if not failed:
                break
            # An invalid sample takes no place, so one refused in its favour may fit now.
            candidates = [i for i in candidates if i not in invalid]
        return [encoded[i] for i in sorted(encoded)], len(invalid), n - len(invalid) - len(encoded)
