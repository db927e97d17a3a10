"""Validate and encode samples once, in the caller, into trace records; with a cap, encode only
what the cap would keep."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from .._checks import MAX_STEP, check_split, check_step
from .._records.encode import (
    RESERVED_KEYS,
    UNKNOWN,
    as_list,
    encode_checked,
    encode_samples,
    missing_score,
    preview_metadata,
    preview_score,
)
from .._records.groups import GroupKey, GroupKeyError, group_of, group_value
from .._records.types import Sample, SampleLike, TraceRecord, records_for
from .._security import shown
from ..exceptions import RecordError

__all__ = ["Encoder"]

# Which of a submission's samples (by score) the cap would keep if offered now; None: cannot tell.
Keeps = Callable[..., list[bool] | None]
Kept = tuple[list[tuple[bytes, float | None]], int, int, list[int], list[Hashable | None] | None]
# What `submit` returns: records, invalid, refused before encoding, gaps, groups (see there).
Submitted = tuple[list[TraceRecord], int, int, list[int] | None, list[Hashable | None] | None]
# What `encode_kept` returns for a submission the buffer counted whole as refused.
REFUSED_WHOLE: Kept = ([], 0, 0, [], None)


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
        group_key: GroupKey | None = None,
        group_keys: Sequence[GroupKey] = (),
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
        self._group_key = group_key  # a group sampler's: its `keeps` ranks by each sample's group
        # Every key a selection of the session reads groups by (its own, its tiers'): a sample
        # whose group none of them can name is invalid.
        self.group_keys = tuple(group_keys)

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

    def prepare(
        self, samples: SampleLike | Iterable[SampleLike], step: int, split: str
    ) -> tuple[Sequence[Any], str]:
        """A call's samples as a sequence, and its split's trace key; raises on a bad step or split."""
        if type(step) is not int or step < 0 or step > MAX_STEP or type(split) is not str or not split:
            check_step(step, split)  # raises, or accepts an int subclass
        items = samples if type(samples) is list else as_list(samples)
        return items, self._keys.get(split) or self.key_for(split)

    def encode(
        self,
        samples: SampleLike | Iterable[SampleLike],
        step: int,
        split: str,
        *,
        skipped: list[int] | None = None,
    ) -> tuple[list[TraceRecord], int]:
        """Validate and encode every sample, in the caller, past the cap; returns the records
        and how many were invalid (their indices go to `skipped`)."""
        items, key = self.prepare(samples, step, split)
        return self._encode_all(items, step, split, key, skipped)

    def _encode_all(
        self, items: Sequence[Any], step: int, split: str, key: str, skipped: list[int] | None
    ) -> tuple[list[TraceRecord], int]:
        encoded, invalid = encode_samples(
            items,
            redact=self.redact,
            skip_invalid=self.skip_invalid,
            max_bytes=self.max_bytes,
            score_needed_by=self.score_needed_by,
            skipped=skipped,
            group_keys=self.group_keys,
        )
        return records_for(encoded, self._ids, self._id_prefix, step, split, key, time.time()), invalid

    def submit(self, items: Sequence[Any], step: int, split: str, key: str) -> Submitted | None:
        """Validate and encode a submission (`prepare`d), in the caller, with a cap only what it
        would keep; returns records, the invalid count, how many the cap refused before they
        were encoded and, then, how many of those came right before each record (a positional
        sampler counts them) and each record's prompt group as the cap read it (a group sampler
        takes it from there). None when the cap refused the whole submission: the buffer
        counted it."""
        kept = self.encode_kept(items, step, split) if self.precheck else None
        if kept is None:
            return (*self._encode_all(items, step, split, key, None), 0, None, None)
        if kept is REFUSED_WHOLE:
            return None
        encoded, invalid, refused, gaps, groups = kept
        records = records_for(encoded, self._ids, self._id_prefix, step, split, key, time.time())
        return records, invalid, refused, gaps, groups

    def encode_kept(self, items: Sequence[Any], step: int, split: str) -> Kept | None:
        """Encode only the samples the cap would keep if offered now; None when that cannot be
        told cheaply (the caller then encodes everything). Also returns, per encoded sample, how
        many refused ones came right before it.

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
            scores: list[Any] = [
                # The common case inline: a Sample whose metadata holds a finite float reward.
                raw
                if type(obj) is Sample
                and obj.score is None
                and type(md := obj.metadata) is dict
                and type(raw := md.get("reward")) is float
                and math.isfinite(raw)
                else preview_score(obj)
                for obj in items
            ]
            # `in` compares by identity first: one C-level pass each, no per-item Python call.
            if UNKNOWN in scores:
                return None
            if None in scores:
                invalid = {i for i, sc in enumerate(scores) if sc is None}
                if not skip:
                    raise missing_score(min(invalid), ranked_by)
        elif all(type(obj) is Sample or type(obj) is dict for obj in items):
            scores = [None] * n
        else:
            return None  # an unusual item gets the full path, and its error if it is wrong
        groups: list[Hashable | None] | None = None
        if self._group_key is not None:
            groups, bad = self.groups_of(items)
            if bad:
                if not skip:  # (a missing score was raised above)
                    first = min(bad)
                    path = bad[first].path
                    raise RecordError(f"sample {first}: {path}: {bad[first]}", index=first, path=path)
                invalid |= bad.keys()
        candidates = [i for i in range(n) if i not in invalid] if invalid else range(n)
        encoded: dict[int, tuple[bytes, float | None]] = {}
        while candidates:
            keeps = self._keeps(
                scores if not invalid else [scores[i] for i in candidates],
                split=split,
                step=step,
                groups=None if groups is None else [groups[i] for i in candidates],
                # The usual capped call once a step is under way: the buffer counts it whole.
                refused_with=None if encoded else len(invalid),
            )
            if keeps is None:
                return None
            if not keeps:
                return REFUSED_WHOLE
            failed = False
            for i, keep in zip(candidates, keeps, strict=True):
                if not keep or i in encoded:
                    continue
                try:
                    pair = encode_checked(
                        items[i], i, None, self.max_bytes, "max_queue_bytes", None, self.group_keys
                    )
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
        gaps: list[int] = []
        if len(candidates) == n:  # nothing invalid: candidate positions are the indices
            last = -1
            for i in sorted(encoded):
                gaps.append(i - last - 1)
                last = i
        else:
            gap = 0
            for i in candidates:
                if i in encoded:
                    gaps.append(gap)
                    gap = 0
                else:
                    gap += 1
        order = sorted(encoded)
        return (
            [encoded[i] for i in order],
            len(invalid),
            n - len(invalid) - len(encoded),
            gaps,
            None if groups is None else [groups[i] for i in order],
        )

    def groups_of(self, items: Sequence[Any]) -> tuple[list[Hashable | None], dict[int, GroupKeyError]]:
        """Each sample's prompt group, read from its metadata as encoding will find it (a group
        sampler's `keeps` ranks by it, and the selection takes it from here rather than from
        the payload), and the samples whose group value cannot name one (they are invalid)."""
        key = self._group_key
        assert key is not None
        # Metadata key names none of which a mapping sample reserves: such a sample's own dict
        # reads the same as the metadata encoding makes of it.
        names = key if type(key) is tuple and RESERVED_KEYS.isdisjoint(key) else None
        out: list[Hashable | None] = []
        bad: dict[int, GroupKeyError] = {}
        metadata: Mapping[str, Any] | None
        for i, obj in enumerate(items):
            if type(obj) is Sample:
                metadata = obj.metadata
            elif names is not None and type(obj) is dict and "metadata" not in obj:
                metadata = obj
            else:
                metadata = preview_metadata(obj)
            try:
                if names is not None and type(metadata) is dict:
                    # The common case inline (a call per sample is a measurable part of this path).
                    for name in names:
                        value = metadata.get(name)
                        if value is not None:
                            out.append(
                                value
                                if type(value) is str or type(value) is int
                                else group_value(value, f"metadata.{name}")
                            )
                            break
                    else:
                        out.append(None)
                else:
                    out.append(group_of(metadata, key) if isinstance(metadata, Mapping) else None)
            except GroupKeyError as exc:
                bad[i] = exc
                out.append(None)
        return out, bad
