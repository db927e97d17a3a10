"""`log_rollouts`: a token batch into a session, decoding only the rows the cap would keep.

The rows are decoded, validated and encoded in the caller, then places are reserved by reward and
filled through the intake (`intake.Intake`), whose admission and waits they share.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import anyio

from .._records.types import SampleLike, TraceRecord
from .._select.base import Entry
from .._select.watch import WatchCounter
from .._stats import DropReason
from ..exceptions import RecordError
from .buffer import Buffer
from .encoder import Candidates, Encoder
from .group_metrics import GroupMetrics

__all__ = ["RolloutFront", "log_rollouts", "renumbered"]


class RolloutFront(Protocol):
    """What `log_rollouts` needs of a session's intake."""

    buffer: Buffer
    encoder: Encoder
    watch: WatchCounter | None
    groups: GroupMetrics | None

    async def log(
        self, samples: SampleLike | Iterable[SampleLike], step: int, split: str, timeout: float | None
    ) -> int: ...

    async def reserve(
        self, scores: Sequence[float | None], rows: list[int], *, step: int, split: str, invalid: int = 0
    ) -> tuple[list[int], list[Entry]]: ...

    async def fill(self, entries: Sequence[Entry], records: Sequence[TraceRecord]) -> int: ...

    def cancel(self, entries: Sequence[Entry], reason: DropReason, *, step: int, split: str) -> None: ...


async def log_rollouts(
    intake: RolloutFront,
    input_ids: Any,
    *,
    tokenizer: Any,
    step: int,
    split: str,
    rewards: Any,
    **decode_kwargs: Any,
) -> int:
    """`TraceSession.log_rollouts` through `intake`: decode only the rows the cap would keep, validate
    and encode them, then reserve places by reward and fill them; or, where log_samples would not
    ask the cap first (see `_log_every_row`), decode every row and take its path.

    Bad input follows `log_samples`' rules: a problem with the whole batch (shapes that do
    not match, an unknown token field) raises before anything is counted; a bad row raises
    a `RecordError` naming it, before anything is counted, or with ``on_invalid="skip"`` is
    counted ``"invalid"`` alone.
    """
    from ..rollouts._decode import row_scores
    from ..rollouts._rows import check_rows

    n = len(input_ids)
    # `rows` picks (and orders) the rows to log, as in decode_rollouts; the cap chooses
    # among those.
    candidates = check_rows(decode_kwargs.pop("rows", None), n)
    decode = functools.partial(_decode_rows, input_ids, tokenizer=tokenizer, rewards=rewards, **decode_kwargs)
    skip = intake.encoder.skip_invalid
    if intake.watch is not None or intake.groups is not None or not intake.encoder.precheck:
        return await _log_every_row(intake, decode, candidates, step=step, split=split)
    # Places, not rows, from here on: `rows=` may name a row twice, and each is a sample of its
    # own (as decode_rollouts returns it twice), with a record and an id of its own.
    row_of = candidates
    by_row = row_scores(rewards, n)
    scores = [by_row[i] for i in row_of]
    places = range(len(row_of))
    ranked_by = intake.encoder.score_needed_by
    bad: set[int] = set()  # places left out as invalid (on_invalid="skip")
    if ranked_by is not None:
        bad = {p for p in places if scores[p] is None}  # row_scores: None unless finite
        if bad and not skip:
            i = row_of[min(bad)]
            raise RecordError(
                f"sample {i}: rewards: the {ranked_by} ranks by score; every row needs a finite reward",
                index=i,
                path="rewards",
            )
    # Taken before anything is counted, so a flush() from now on waits until these rows are queued.
    ticket = intake.buffer.take_ticket()
    try:
        rows: Candidates[TraceRecord] = Candidates([p for p in places if p not in bad], bad)
        checked = False  # whether the batch was decoded from (a batch problem raises there)
        while True:
            # Only the rows the cap would keep now are decoded (it only gets harder to enter).
            keeps = intake.buffer.keeps([scores[p] for p in rows.live], split=split, step=step)
            todo = rows.todo(keeps)
            if not todo:
                if not checked:  # the cap keeps none: a bad batch still raises, uncounted
                    await anyio.to_thread.run_sync(decode, [])
                break
            decoded, failed = await anyio.to_thread.run_sync(
                decode, list(dict.fromkeys(row_of[p] for p in todo))
            )
            checked = True
            if failed and not skip:
                raise failed[next(row_of[p] for p in todo if row_of[p] in failed)]
            done = [p for p in todo if row_of[p] in decoded]
            skipped: list[int] = []
            try:
                records, _ = intake.encoder.encode(
                    [decoded[row_of[p]] for p in done], step, split, skipped=skipped
                )
            except RecordError as exc:
                raise renumbered(exc, None if exc.index is None else row_of[done[exc.index]]) from None
            left_out = {p for p in todo if row_of[p] in failed} | {done[j] for j in skipped}
            rows.done.update(zip([p for p in done if p not in left_out], records, strict=True))
            if not rows.leave_out(left_out):
                break
        kept, entries = await intake.reserve(
            scores, rows.live, step=step, split=split, invalid=len(rows.invalid)
        )
        encoded = rows.done
        lost = [e for p, e in zip(kept, entries, strict=True) if p not in encoded]
        if lost:  # the cap kept a row it would have refused when asked: none to fill it with
            intake.cancel(lost, "capped", split=split, step=step)
        filled = [(e, encoded[p]) for p, e in zip(kept, entries, strict=True) if p in encoded]
        if not filled:
            return 0
        return await intake.fill([e for e, _ in filled], [r for _, r in filled])
    finally:
        intake.buffer.return_ticket(ticket)


async def _log_every_row(
    intake: RolloutFront, decode: functools.partial[Any], candidates: list[int], *, step: int, split: str
) -> int:
    """Decode every row and take log_samples' one path: where something must see every row
    before the cap (a watched row may be any row; the group metrics count every row submitted)
    or where log_samples itself encodes before it asks the cap (a `redact`, which may change a
    score; no cap at all), so both keep, count and rank the same rows. A row that cannot be
    decoded is what it is on the capped path: a RecordError naming its row, or with
    on_invalid="skip" that row alone counted "invalid"."""
    # Taken before anything is counted, so a flush() from now on waits until these rows are queued.
    ticket = intake.buffer.take_ticket()
    try:
        decoded, failed = await anyio.to_thread.run_sync(decode, candidates)
        if failed and not intake.encoder.skip_invalid:
            raise failed[next(i for i in candidates if i in failed)]
        rows = [i for i in candidates if i in decoded]
        left_out = len(candidates) - len(rows)
        if intake.buffer.closed:
            # finish() ran while these rows were decoded: counted as the capped path counts them.
            intake.buffer.count_closed(len(rows), left_out)
            return 0
        try:
            accepted = await intake.log([decoded[i] for i in rows], step, split, None)
        except RecordError as exc:
            raise renumbered(exc, None if exc.index is None else rows[exc.index]) from None
        if left_out:
            intake.buffer.count_invalid(left_out)
        return accepted
    finally:
        intake.buffer.return_ticket(ticket)


def _decode_rows(
    input_ids: Any, rows: list[int], **kwargs: Any
) -> tuple[dict[int, Any], dict[int, RecordError]]:
    """Decode `rows` of a batch: each row's sample, and a `RecordError` for each row that could
    not be decoded. A problem of the whole batch raises as it is (nothing was counted yet)."""
    from ..rollouts import decode_rollouts

    try:
        return dict(zip(rows, decode_rollouts(input_ids, rows=rows, **kwargs), strict=True)), {}
    except Exception as exc:
        first = exc
    decode_rollouts(input_ids, rows=[], **kwargs)  # a whole-batch problem raises here
    if not rows:
        raise first
    good: dict[int, Any] = {}
    bad: dict[int, RecordError] = {}
    for row in rows:  # only after a failure: find the rows that caused it
        try:
            good[row] = decode_rollouts(input_ids, rows=[row], **kwargs)[0]
        except Exception as exc:
            bad[row] = _row_error(row, exc)
    return good, bad


def _row_error(row: int, exc: Exception) -> RecordError:
    """The `RecordError` for row `row` of a batch whose decoding raised `exc`."""
    text = str(exc)
    field = text.split(":", 1)[0] if ":" in text else ""
    if field.startswith("token_fields"):
        path = "tokens"
    elif field.isidentifier() or field.startswith("metadata["):
        path = field
    else:
        path = ""
    return RecordError(f"sample {row}: {text}", index=row, path=path)


def renumbered(exc: RecordError, row: int | None) -> RecordError:
    """`exc`, raised for the `exc.index`-th decoded row, naming that row of the batch instead."""
    message = str(exc)
    if row is not None and exc.index is not None and message.startswith(f"sample {exc.index}:"):
        message = f"sample {row}:" + message[len(f"sample {exc.index}:") :]
    return RecordError(message, index=row, path=exc.path)
