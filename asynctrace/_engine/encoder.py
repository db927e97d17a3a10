"""Validate and encode samples once, in the caller, into trace records; with a cap, encode only
what the cap would keep."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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

__all__ = ["EVERY", "Candidates", "Encoder", "Submitted"]

# Which of a submission's samples (by score) the cap would keep if offered now; None: cannot tell.
Keeps = Callable[..., list[bool] | None]
# The sample types whose shape the capped path reads without the full path's help.
_PLAIN = frozenset((Sample, dict))
_FLOAT_ONLY = {float}
_DICT_ONLY = {dict}
_NONE_ONLY = {type(None)}
_GROUP_KINDS = frozenset((str, int))  # a group name as it is (bool, an int subclass, is not)


@dataclass(slots=True)
class Submitted:
    """One submission validated and encoded in the caller, on its way to `Buffer.admit`."""

    records: list[TraceRecord]
    invalid: int = 0  # samples left out as invalid (on_invalid="skip")
    refused: int = 0  # samples the cap refused before they were encoded
    # Per record, how many refused samples came right before it (a positional sampler counts them).
    gaps: list[int] | None = None
    # Per record, its prompt group as the cap read it (a group sampler then parses no payload).
    groups: list[Hashable | None] | None = None


class _Every:
    """`encode_kept`'s answer when the cap cannot tell cheaply: encode every sample."""


EVERY = _Every()
T = TypeVar("T")


class Candidates(Generic[T]):
    """A submission's samples on their way past the cap: the places still offered (`live`),
    those found invalid, and what the ones encoded so far became (`done`). Every way in that
    asks the cap before encoding (or decoding) goes through here, the one place its rule is
    kept: an invalid sample takes no place, so one the cap refused in its favour may fit once
    it is left out (`leave_out`, then ask the cap again)."""

    __slots__ = ("done", "invalid", "live")

    def __init__(self, live: list[int], invalid: set[int]) -> None:
        self.live = live
        self.invalid = invalid
        self.done: dict[int, T] = {}

    def todo(self, keeps: Sequence[bool] | None) -> list[int]:
        """The live places the cap keeps (`keeps`, one flag per live place; None: every one)
        that were not encoded yet."""
        kept = self.live if keeps is None else list(itertools.compress(self.live, keeps))
        done = self.done
        return [p for p in kept if p not in done] if done else kept

    def leave_out(self, bad: Collection[int]) -> bool:
        """`bad` places turned out invalid; True when the cap must be asked again (see the class)."""
        if not bad:
            return False
        self.invalid.update(bad)
        invalid = self.invalid
        self.live = [p for p in self.live if p not in invalid]
        return True

    def gaps(self, order: Sequence[int]) -> list[int]:
        """For each encoded place, in `order`, how many live places the cap refused right before it."""
        if len(self.live) != (self.live[-1] + 1 if self.live else 0):
            at = {p: j for j, p in enumerate(self.live)}
            order = [at[p] for p in order]
        return [b - a - 1 for a, b in zip(itertools.chain((-1,), order), order, strict=False)]


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
        counts_skipped: bool = True,
    ) -> None:
        self.trace_key = trace_key
        # Whether the cap's selections count refused samples by position (`Sampler.counts_skipped`).
        self.counts_skipped = counts_skipped
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
        would keep (`encode_kept`). None when the cap refused the whole submission: the buffer
        counted it."""
        if self.precheck:
            kept = self.encode_kept(items, step, split, key)
            if kept is not EVERY:
                return kept  # type: ignore[return-value]
        records, invalid = self._encode_all(items, step, split, key, None)
        return Submitted(records, invalid)

    def encode_kept(self, items: Sequence[Any], step: int, split: str, key: str) -> Submitted | _Every | None:
        """Encode only the samples the cap would keep if offered now; `EVERY` when that cannot
        be told cheaply (the caller then encodes everything), None when the cap keeps none (the
        buffer counted the submission whole).

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
                # The common case inline, a Sample without its own score whose metadata is a
                # dict: its reward is read as it is and checked with the call's others below.
                md.get("reward")
                if type(obj) is Sample and obj.score is None and type(md := obj.metadata) is dict
                else preview_score(obj)
                for obj in items
            ]
            # Every score a finite float, the usual case, told in two C-level passes: their
            # types, then their sum (a NaN or an infinity makes it not finite). Otherwise each
            # is read again as encoding will find it (None: missing or not finite).
            # (`in` would compare each float with UNKNOWN and None, a slow fallback each.)
            if set(map(type, scores)) != _FLOAT_ONLY or not math.isfinite(sum(scores)):
                scores = list(map(preview_score, items))
                if UNKNOWN in scores:
                    return EVERY
                if None in scores:
                    invalid = {i for i, sc in enumerate(scores) if sc is None}
                    if not skip:
                        raise missing_score(min(invalid), ranked_by)
        elif _PLAIN.issuperset(map(type, items)):
            scores = [None] * n
        else:
            return EVERY  # an unusual item gets the full path, and its error if it is wrong
        groups: list[Hashable | None] | None = None
        if self._group_key is not None:
            groups, bad = self.groups_of(items)
            if bad:
                if not skip:  # (a missing score was raised above)
                    first = min(bad)
                    path = bad[first].path
                    raise RecordError(f"sample {first}: {path}: {bad[first]}", index=first, path=path)
                invalid |= bad.keys()
        live = [i for i in range(n) if i not in invalid] if invalid else None  # None: every one
        places: Candidates[tuple[bytes, float | None]] | None = None  # made once the cap keeps some
        while True:
            keeps = self._keeps(
                scores if live is None else [scores[i] for i in live],
                split=split,
                step=step,
                groups=groups if live is None or groups is None else [groups[i] for i in live],
                # The usual capped call once a step is under way: the buffer counts it whole.
                refused_with=len(invalid) if places is None or not places.done else None,
            )
            if keeps is None:
                return EVERY
            if not keeps:
                return None
            if places is None:
                places = Candidates(list(range(n)) if live is None else live, invalid)
            todo = places.todo(keeps)
            failed = self._encode_places(items, todo, places.done)
            if failed is None or (ranked_by is not None and not _scores_agree(places.done, todo, scores)):
                return EVERY  # the preview misread this shape; let the full path decide
            if not places.leave_out(failed):
                break
            live = places.live
        order = sorted(places.done)
        done = places.done
        return Submitted(
            records_for([done[i] for i in order], self._ids, self._id_prefix, step, split, key, time.time()),
            len(places.invalid),
            n - len(places.invalid) - len(done),
            places.gaps(order) if self.counts_skipped else None,
            None if groups is None else [groups[i] for i in order],
        )

    def _encode_places(
        self, items: Sequence[Any], todo: list[int], done: dict[int, tuple[bytes, float | None]]
    ) -> list[int] | None:
        """Validate and encode the samples at `todo`, as one batch, into `done`; returns the
        places found invalid (on_invalid="skip"; otherwise the first raises, naming its place)."""
        skipped: list[int] = []
        encoded, _ = encode_samples(
            [items[i] for i in todo],
            skip_invalid=True,
            max_bytes=self.max_bytes,
            skipped=skipped,
            group_keys=self.group_keys,
        )
        if not skipped:
            done.update(zip(todo, encoded, strict=True))
            return []
        if not self.skip_invalid:
            first = todo[skipped[0]]
            # The same checks once more, for its error numbered as the caller's sample.
            encode_checked(
                items[first], first, None, self.max_bytes, "max_queue_bytes", None, self.group_keys
            )
            return None  # it passed the second time: an odd object; the full path decides
        bad = [todo[j] for j in skipped]
        left_out = set(bad)
        done.update(zip([i for i in todo if i not in left_out], encoded, strict=True))
        return bad

    def groups_of(self, items: Sequence[Any]) -> tuple[list[Hashable | None], dict[int, GroupKeyError]]:
        """Each sample's prompt group, read from its metadata as encoding will find it (a group
        sampler's `keeps` ranks by it, and the selection takes it from here rather than from
        the payload), and the samples whose group value cannot name one (they are invalid)."""
        key = self._group_key
        assert key is not None
        # Metadata key names none of which a mapping sample reserves: such a sample's own dict
        # reads the same as the metadata encoding makes of it.
        names = key if type(key) is tuple and RESERVED_KEYS.isdisjoint(key) else None
        if names is not None:
            # The usual call, every sample a `Sample` with dict metadata, read name by name
            # over the whole call: the first name any sample has must name every sample's
            # group as it is (a str or an int); any other call is read sample by sample.
            metas: list[Any] = [obj.metadata if type(obj) is Sample else None for obj in items]
            if set(map(type, metas)) == _DICT_ONLY:
                for name in names:
                    values = [md.get(name) for md in metas]
                    kinds = set(map(type, values))
                    if kinds == _NONE_ONLY:
                        continue  # no sample names its group by this key: the next one decides
                    if kinds <= _GROUP_KINDS:
                        return values, {}
                    break
                else:
                    return [None] * len(items), {}
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


def _scores_agree(
    done: Mapping[int, tuple[bytes, float | None]], todo: Sequence[int], scores: Sequence[Any]
) -> bool:
    """Whether encoding found the scores the preview read for the samples just encoded."""
    for i in todo:  # a loop, not a generator: no call per sample
        pair = done.get(i)
        if pair is not None and pair[1] != scores[i]:
            return False
    return True
