"""A record's token-level values as the token page reads them: arrays, each token's text, the
signals a token can be coloured by, and the figures over the whole completion.

The archive is read once a record (`Recent`): a row of 131,072 tokens is a few megabytes of
arrays, which numpy answers in milliseconds, so each window of the page after the first costs
only its own HTML. Every value is data from a file: a field shorter than the others, ends that
do not fit the messages, a NaN, are shown as what they are, never trusted to index anything.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from .._records.tokens import TOKEN_FIELDS

__all__ = [
    "SIGNALS",
    "WINDOW",
    "Figure",
    "Recent",
    "Signal",
    "TokenRecord",
    "classes",
]

T = TypeVar("T")

# Tokens a window of the page shows: about a screen of text, a page of about 200 KB.
WINDOW = 1024
# Records whose values are kept for their next windows, and the tokens they may hold together
# (about 80 bytes a token): four of 131,072 tokens, or one record of any length.
_KEPT = 4
_KEPT_TOKENS = 4 * 131_072
# Thresholds of the colour buckets 1..8 (0: below the first): log-probs (negated) and entropy.
_STEPS = np.asarray([0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0])
# Of a signed difference of log-probs (its magnitude), buckets 1..4 each way.
_SIGNED = np.asarray([0.01, 0.05, 0.2, 0.5])
# Of a signed value scaled by the record's largest magnitude (advantages).
_SCALED = np.asarray([0.05, 0.25, 0.5, 0.75])


@dataclass(frozen=True, slots=True)
class Signal:
    """What the tokens can be coloured by: a float token field, the loss mask, or the difference
    of the two log-prob series. `kind`: how values map to colours (`low`: low is dark, as
    log-probs; `high`: high is dark, as entropy; `signed`: a difference of log-probs; `scaled`:
    signed, against the record's largest magnitude; `mask`)."""

    name: str
    label: str
    kind: str
    short: str  # in a token's tooltip


# The signals in the order the page offers them; a float field the table does not name is
# offered as a `scaled` signal under its own name.
SIGNALS: tuple[Signal, ...] = (
    Signal("logprobs", "logprobs", "low", "logprob"),
    Signal("ref_logprobs", "ref_logprobs", "low", "ref"),
    Signal("difference", "ref_logprobs - logprobs", "signed", "diff"),
    Signal("entropy", "entropy", "high", "entropy"),
    Signal("advantages", "advantages", "scaled", "adv"),
    Signal("loss_mask", "loss_mask", "mask", "mask"),
)


def classes(signal: Signal, values: Any, scale: float = 0.0) -> list[str]:
    """The colour class of each value under `signal` ("" for a value that is not a number)."""
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    if signal.kind == "mask":
        return ["m1" if v else "m0" for v in (values != 0).tolist()]
    if signal.kind in ("low", "high"):
        magnitude = -values if signal.kind == "low" else values
        bucket = np.searchsorted(_STEPS, np.where(finite, magnitude, 0.0), side="right")
        names = [f"q{b}" for b in bucket.tolist()]
    else:
        edges = _SIGNED if signal.kind == "signed" else _SCALED * scale
        bucket = np.searchsorted(edges, np.abs(np.where(finite, values, 0.0)), side="right")
        if signal.kind == "scaled" and scale <= 0:
            bucket = np.zeros_like(bucket)
        names = [
            ("p" if v > 0 else "n") + str(b) if b else "z"
            for v, b in zip(values, bucket.tolist(), strict=True)
        ]
    return [name if ok else "" for name, ok in zip(names, finite.tolist(), strict=True)]


@dataclass(frozen=True, slots=True)
class Figure:
    """One of a record's figures: its key (the page's `data-k`), label and value."""

    key: str
    label: str
    value: float | int | None


@dataclass(frozen=True, slots=True)
class Mark:
    """The value that stands for one window on the page's map of the completion."""

    start: int
    value: float


class TokenRecord:
    """One record's token fields as arrays of one length (a field shorter than the longest is
    NaN, or -1 for ids, past its end), and its text cut into its tokens where its `text_ends`
    fit its messages."""

    def __init__(self, fields: dict[str, Any], messages: Sequence[Any]) -> None:
        self.count = max((len(v) for v in fields.values()), default=0)
        self.have = [name for name in TOKEN_FIELDS if name in fields and name != "text_ends"]
        self.values: dict[str, Any] = {}
        for name, value in fields.items():
            ints = TOKEN_FIELDS.get(name) != "float32"
            full = np.full(self.count, -1 if ints else np.nan, dtype=np.int64 if ints else np.float64)
            full[: len(value)] = value
            self.values[name] = full
        self.in_loss = (
            self.values["loss_mask"] != 0 if "loss_mask" in self.values else np.ones(self.count, dtype=bool)
        )
        if "logprobs" in self.values and "ref_logprobs" in self.values:
            self.values["difference"] = self.values["ref_logprobs"] - self.values["logprobs"]
        self.text, self.ends, self.roles = _cut(messages, fields.get("text_ends"), self.count)
        self._kept: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def signals(self) -> list[Signal]:
        """The signals this record has values for, in the page's order."""
        known = [s for s in SIGNALS if s.name in self.values]
        named = {s.name for s in SIGNALS}
        extra = [
            Signal(name, name, "scaled", name)
            for name in self.have
            if name not in named and TOKEN_FIELDS[name] == "float32"
        ]
        return known + extra

    def token_text(self, i: int) -> str | None:
        """Token i's text (empty where it holds no character of its own); None without text."""
        if self.text is None or self.ends is None:
            return None
        return self.text[int(self.ends[i - 1]) if i else 0 : int(self.ends[i])]

    def scale(self, name: str) -> float:
        """The largest magnitude of a field's finite values (what a `scaled` signal is against)."""
        return float(self._once(("scale", name), lambda: _largest(self.values[name])))

    def figures(self) -> list[Figure]:
        """The token count, how many are in the loss, and over those: the mean and lowest log-prob,
        the mean and largest |ref_logprobs - logprobs|, the mean entropy (where it has them)."""
        return list(self._once("figures", self._figures))

    def _figures(self) -> list[Figure]:
        def over(name: str, how: Callable[[Any], Any]) -> float | None:
            values = self.values[name][self.in_loss]
            values = values[np.isfinite(values)]
            return float(how(values)) if values.size else None

        out = [Figure("tokens", "tokens", self.count)]
        out.append(
            Figure("in_loss", "in the loss", int(self.in_loss.sum()) if "loss_mask" in self.values else None)
        )
        if "logprobs" in self.values:
            out.append(Figure("mean_logprob", "mean logprob", over("logprobs", np.mean)))
            out.append(Figure("min_logprob", "lowest logprob", over("logprobs", np.min)))
        if "difference" in self.values:
            label = "|ref_logprobs - logprobs|"
            out.append(
                Figure("mean_abs_difference", f"mean {label}", over("difference", lambda v: np.abs(v).mean()))
            )
            out.append(
                Figure(
                    "max_abs_difference", f"largest {label}", over("difference", lambda v: np.abs(v).max())
                )
            )
        if "entropy" in self.values:
            out.append(Figure("mean_entropy", "mean entropy", over("entropy", np.mean)))
        return out

    def lowest(self, limit: int = 20) -> list[int]:
        """The tokens in the loss with the lowest log-probs, lowest first."""
        return list(self._once(("lowest", limit), lambda: self._extreme(self.values["logprobs"], limit)))

    def disagreeing(self, limit: int = 20) -> list[int]:
        """The tokens in the loss where the two log-prob series differ most, most first."""
        return list(
            self._once(("disagree", limit), lambda: self._extreme(-np.abs(self.values["difference"]), limit))
        )

    def marks(self, signal: Signal) -> list[Mark]:
        """A value per window for the page's map: the lowest of a `low` signal in the loss, the
        highest of a `high` one, the largest magnitude of a signed one, the share in the loss."""
        return list(self._once(("marks", signal.name), lambda: self._marks(signal)))

    def _marks(self, signal: Signal) -> list[Mark]:
        values = self.values[signal.name].astype(np.float64)
        if signal.kind == "mask":
            values = (values != 0).astype(np.float64)
        elif signal.kind != "scaled":
            values = np.where(self.in_loss, values, np.nan)
        out = []
        for start in range(0, self.count, WINDOW):
            part = values[start : start + WINDOW]
            part = part[np.isfinite(part)]
            if not part.size:
                out.append(Mark(start, float("nan")))
            elif signal.kind == "low":
                out.append(Mark(start, float(part.min())))
            elif signal.kind == "high":
                out.append(Mark(start, float(part.max())))
            elif signal.kind == "mask":
                out.append(Mark(start, float(part.mean())))
            else:
                out.append(Mark(start, float(part[np.abs(part).argmax()])))
        return out

    def _extreme(self, values: Any, limit: int) -> list[int]:
        """The indexes of the `limit` smallest finite values in the loss, smallest first (ties by
        position)."""
        keep = np.flatnonzero(self.in_loss & np.isfinite(values))
        if keep.size > limit:
            # Every value up to the `limit`-th smallest, ties at that value included (a partition
            # alone would cut them arbitrarily), then in order.
            bound = np.partition(values[keep], limit - 1)[limit - 1]
            keep = keep[values[keep] <= bound]
        order = np.lexsort((keep, values[keep]))[:limit]
        return [int(i) for i in keep[order]]

    def _once(self, key: Any, compute: Callable[[], Any]) -> Any:
        with self._lock:
            if key not in self._kept:
                self._kept[key] = compute()
            return self._kept[key]


def _largest(values: Any) -> float:
    finite = np.abs(values[np.isfinite(values)])
    return float(finite.max()) if finite.size else 0.0


def _cut(messages: Sequence[Any], ends: Any, count: int) -> tuple[str | None, Any, dict[int, str]]:
    """The messages' contents joined, the ends as int64, and the role starting at each token that
    starts a message; (None, None, {}) where the ends do not cut this text into these tokens."""
    if ends is None or len(ends) != count or not count:
        return None, None, {}
    contents = [m.get("content") if isinstance(m, dict) else None for m in messages]
    texts = [c for c in contents if isinstance(c, str)]
    if len(texts) != len(contents):
        return None, None, {}
    text = "".join(texts)
    at = np.asarray(ends, dtype=np.int64)
    if int(at[0]) < 0 or bool((np.diff(at) < 0).any()) or int(at[-1]) != len(text):
        return None, None, {}
    roles: dict[int, str] = {}
    start = 0
    for message, content in zip(messages, texts, strict=True):
        if content:
            # The first token whose text ends past where this message starts.
            first = int(np.searchsorted(at, start, side="right"))
            roles.setdefault(first, str(message.get("role", "?")))
        start += len(content)
    return text, at, roles


class Recent(Generic[T]):
    """The last few records' values, read through `load` (record id -> value, or None where the
    record has no token fields): a record's next windows are answered without reading it again.
    At most `kept` records, and past `tokens` tokens (`size` of each) only the last one."""

    def __init__(
        self,
        load: Callable[[str], T | None],
        size: Callable[[T], int],
        kept: int = _KEPT,
        tokens: int = _KEPT_TOKENS,
    ) -> None:
        self._load = load
        self._size = size
        self._kept = kept
        self._tokens = tokens
        self._records: OrderedDict[str, T] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, record_id: str) -> T | None:
        with self._lock:
            found = self._records.get(record_id)
            if found is not None:
                self._records.move_to_end(record_id)
                return found
        found = self._load(record_id)  # outside the lock: another page need not wait for this read
        if found is not None:
            with self._lock:
                self._records[record_id] = found
                while len(self._records) > 1 and (
                    len(self._records) > self._kept
                    or sum(map(self._size, self._records.values())) > self._tokens
                ):
                    self._records.popitem(last=False)
        return found
