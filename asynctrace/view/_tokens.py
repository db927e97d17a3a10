"""The token page (`/tokens?id=`): a completion's text, each token coloured by a chosen signal,
a window of `WINDOW` tokens at a time.

Each token is a span of the record's text (cut by its `text_ends`; by id where it has none),
coloured by a class of the token page's stylesheet (`static/tokens.css`), with its values in its
title. Above the text: the signals to colour by and a map of every window (each coloured by its
worst value and a link to it); beside it, the record's figures, then the tokens where `logprobs`
and `ref_logprobs` disagree most and those with the lowest log-probs, each a link to its window.
Every value from the archive is escaped; addresses are built by `url`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from html import escape
from importlib import resources
from typing import Any, NamedTuple

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ._archive import Archive
from ._html import layout, num, url
from ._model import Completion
from ._token_data import WINDOW, Recent, Signal, TokenRecord, classes

__all__ = ["token_page", "token_routes"]

_LISTED = 20
_MAP_WIDTH = 960


class Shown(NamedTuple):
    """What the page shows of a record: its completion (ids, step, messages) and its tokens."""

    completion: Completion
    tokens: TokenRecord


def _titles(record: TokenRecord, start: int, stop: int) -> list[str]:
    """The tooltips of tokens `start` to `stop`: position, id and every value, built a column at
    a time (each field's values of the window read as Python numbers once)."""
    columns = [[f"token {i}" for i in range(start, stop)]]
    if "token_ids" in record.values:
        columns.append([f"id {v}" if v >= 0 else "" for v in record.values["token_ids"][start:stop].tolist()])
    for signal in record.signals():
        values = record.values[signal.name][start:stop].tolist()
        if signal.kind == "mask":
            columns.append(["in the loss" if v else "not in the loss" for v in values])
            continue
        short = signal.short
        columns.append([f"{short} {v:.4f}" if math.isfinite(v) else "" for v in values])
        if signal.name == "difference":
            columns.append([f"ratio {_ratio(v)}" if math.isfinite(v) else "" for v in values])
    return [" · ".join(part for part in parts if part) for parts in zip(*columns, strict=True)]


def _ratio(difference: float) -> str:
    """exp(difference), the importance ratio of the second series over the first."""
    try:
        return f"{math.exp(difference):.4f}"
    except OverflowError:
        return "inf"


def _shown(text: str | None, token_id: int) -> str:
    """A token's text for the lists: its whitespace made visible; its id where it has no text."""
    if text is None:
        return f"id {token_id}" if token_id >= 0 else "—"
    return repr(text)[1:-1] if text else "·"


def _spans(record: TokenRecord, signal: Signal, start: int, stop: int) -> str:
    """The tokens of the window: one span each, coloured, titled, with its text (or its id)."""
    values = record.values[signal.name][start:stop]
    colour = classes(signal, values, record.scale(signal.name) if signal.kind == "scaled" else 0.0)
    ids = record.values["token_ids"][start:stop].tolist() if "token_ids" in record.values else None
    in_loss = record.in_loss[start:stop].tolist()
    titles = _titles(record, start, stop)
    out = []
    for k, i in enumerate(range(start, stop)):
        role = record.roles.get(i)
        if role is not None:
            out.append(f'<span class="role">{escape(role)}</span>')
        text = record.token_text(i)
        names = ["t", colour[k]]
        if not in_loss[k]:
            names.append("out")
        title = titles[k]
        if text is None:
            names.append("id")
            body = str(ids[k]) if ids is not None and ids[k] >= 0 else "?"
        elif not text:
            names.append("nil")
            body = ""
            title += " · no text of its own: a part of a character a later token ends"
        else:
            body = escape(text, quote=False)
        out.append(
            f'<span class="{" ".join(n for n in names if n)}" id="t{i}" title="{escape(title)}">{body}</span>'
        )
        if text is None:
            out.append(" ")
    return "".join(out)


def _map(record: TokenRecord, signal: Signal, window: Callable[[int], str], start: int) -> str:
    """Every window as a cell coloured by its worst value, each a link to that window."""
    marks = record.marks(signal)
    width = max(4.0, min(24.0, _MAP_WIDTH / max(1, len(marks))))
    scale = record.scale(signal.name) if signal.kind == "scaled" else 0.0
    if signal.kind == "mask":
        colour = ["m1" if m.value >= 0.5 else "m0" for m in marks]
    else:
        colour = classes(signal, [m.value for m in marks], scale)
    cells = []
    for k, (mark, name) in enumerate(zip(marks, colour, strict=True)):
        last = min(record.count, mark.start + WINDOW) - 1
        on = " on" if mark.start == start else ""
        cells.append(
            f'<a href="{escape(window(mark.start))}"><rect x="{k * width:.1f}" y="0" '
            f'width="{max(1.0, width - 1):.1f}" height="18" class="{name or "q0"}{on}">'
            f"<title>tokens {mark.start} to {last}: {escape(signal.label)} {num(mark.value)}</title>"
            "</rect></a>"
        )
    total = len(marks) * width
    return (
        f'<svg class="windows" viewBox="0 0 {total:.0f} 18" width="{total:.0f}" height="18" '
        f'role="img" aria-label="windows">{"".join(cells)}</svg>'
    )


def _listing(record: TokenRecord, indexes: list[int], cls: str, jump: Callable[[int], str]) -> str:
    """Tokens as a list, each a link to its window: its text, and its log-probs (with their
    difference and ratio where there are two series)."""
    ids = record.values.get("token_ids")
    items = []
    for i in indexes:
        text = _shown(record.token_text(i), int(ids[i]) if ids is not None else -1)
        values = [f"logprob {num(float(record.values['logprobs'][i]))}"]
        if "difference" in record.values:
            difference = float(record.values["difference"][i])
            values.append(f"ref {num(float(record.values['ref_logprobs'][i]))}")
            values.append(f"diff {num(difference)}")
            values.append(f"ratio {_ratio(difference) if math.isfinite(difference) else '—'}")
        items.append(
            f'<li data-i="{i}"><a href="{escape(jump(i))}">token {i}</a> <code>{escape(text)}</code> '
            f"{escape(' · '.join(values))}</li>"
        )
    return f'<ol class="{cls}">{"".join(items)}</ol>'


def _facts(record: TokenRecord) -> str:
    return "".join(
        f'<dt>{escape(f.label)}</dt><dd data-k="{f.key}">{escape(_figure(f.value))}</dd>'
        for f in record.figures()
    )


def _figure(value: float | int | None) -> str:
    return str(value) if isinstance(value, int) else num(value)


_LEGENDS = {
    "low": "dark: low (each shade: below -0.05, -0.1, -0.25, -0.5, -1, -2, -3, -5)",
    "high": "dark: high (each shade: above 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5)",
    "signed": "blue: ref_logprobs lower, red: higher (each shade: by more than 0.01, 0.05, 0.2, 0.5)",
    "scaled": "blue: negative, red: positive, darker: nearer the record's largest magnitude",
    "mask": "blue: in the loss",
}


def _legend(signal: Signal) -> str:
    if signal.kind in ("low", "high"):
        swatches = "".join(f'<span class="sw q{b}"></span>' for b in range(1, 9))
    elif signal.kind == "mask":
        swatches = '<span class="sw m1"></span>'
    else:
        swatches = "".join(f'<span class="sw n{b}"></span>' for b in range(4, 0, -1))
        swatches += "".join(f'<span class="sw p{b}"></span>' for b in range(1, 5))
    return (
        f'<p class="legend">{swatches} {escape(_LEGENDS[signal.kind])}; grey text: not in the loss; '
        '<span class="t nil"></span>: a token with no text of its own. Hover a token for its values.</p>'
    )


def token_page(c: Completion, record: TokenRecord, signal: Signal, start: int, *, archive: str) -> str:
    """The window of `record`'s tokens from `start`, coloured by `signal`."""

    def here(**change: Any) -> str:
        params: dict[str, Any] = {"id": c.id, "signal": signal.name, "start": start}
        params.update(change)
        return url("/tokens", **params)

    # The map's many links differ by their start alone (an int): the rest is encoded once.
    base = url("/tokens", id=c.id, signal=signal.name)

    def window(at: int) -> str:
        return f"{base}&start={int(at)}"

    def jump(i: int) -> str:
        return url("/tokens", id=c.id, signal=signal.name, at=i) + f"#t{i}"

    stop = min(record.count, start + WINDOW)
    choices = " · ".join(
        f'<a href="{escape(here(signal=s.name))}"{" class=on" if s.name == signal.name else ""}>'
        f"{escape(s.label)}</a>"
        for s in record.signals()
    )
    steps = []
    if start > 0:
        steps.append(f'<a class="prev" href="{escape(here(start=max(0, start - WINDOW)))}">← previous</a>')
    if stop < record.count:
        steps.append(f'<a class="next" href="{escape(here(start=stop))}">next →</a>')
    note = ""
    if record.text is None:
        note = (
            '<p class="note">This record has no <code>text_ends</code> that fit its messages '
            "(decode_rollouts and log_rollouts write them with a byte-level BPE tokenizer): its "
            "tokens are shown by id.</p>"
        )
    side = (
        '<h2>Figures</h2><p class="muted">over the tokens in the loss</p>'
        f'<dl class="facts">{_facts(record)}</dl>'
    )
    if "difference" in record.values:
        side += (
            "<h2>Where logprobs and ref_logprobs disagree most</h2>"
            '<p class="muted">in the loss; diff: ref_logprobs - logprobs; ratio: exp(diff), the '
            "importance ratio</p>"
            f"{_listing(record, record.disagreeing(_LISTED), 'disagree', jump)}"
        )
    if "logprobs" in record.values:
        side += (
            f"<h2>Lowest logprobs in the loss</h2>{_listing(record, record.lowest(_LISTED), 'lowest', jump)}"
        )
    record_link = f'<a href="{escape(url("/record", id=c.id))}">record</a>'
    body = (
        '<link rel="stylesheet" href="/static/tokens.css">'
        f'<p class="muted">step {c.step} · split {escape(c.split)} · reward {num(c.reward)} · '
        f"stop reason {escape(c.stop_reason or '—')} · {record_link}</p>"
        '<div class="tok-page"><section class="tok-main">'
        f'<p class="signals">colour by: {choices}</p>{_legend(signal)}'
        f'<div class="map">{_map(record, signal, window, start)}</div>'
        f'<p class="window" data-start="{start}" data-stop="{stop}" data-count="{record.count}">'
        f"tokens {start} to {stop - 1} of {record.count} {' · '.join(steps)}</p>{note}"
        f'<div class="tk">{_spans(record, signal, start, stop)}</div>'
        f'<p class="window">{" · ".join(steps)}</p></section>'
        f'<aside class="tok-side">{side}</aside></div>'
    )
    crumbs = [
        (f"step {c.step}", url("/step", split=c.split, step=c.step)),
        (f"group {c.group}", url("/group", split=c.split, step=c.step, group=c.group or "")),
        (f"tokens {c.id}", url("/tokens", id=c.id)),
    ]
    return layout(f"Tokens of {c.id}", body, archive=archive, crumbs=crumbs)


def _position(request: Request, name: str, invalid: type[Exception]) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise invalid(f"{name}: expected a token position, got {raw!r}") from None
    if value < 0:
        raise invalid(f"{name}: expected a token position from 0, got {raw!r}")
    return value


def token_routes(
    archive: Archive,
    page: Callable[[Callable[[Request], str]], Callable[[Request], Response]],
    invalid: type[Exception],
) -> list[Route]:
    """The token page's routes: the page (through the app's `page`, which answers `invalid` with
    400 and a `LookupError` with 404) and its stylesheet."""
    label = str(archive.path)
    css = resources.files("asynctrace.view").joinpath("static/tokens.css").read_bytes()

    def load(record_id: str) -> Shown | None:
        fields = archive.tokens(record_id)
        found = archive.record(record_id) if fields else None
        if not fields or found is None:
            return None
        return Shown(found, TokenRecord(fields, found.messages))

    recent = Recent(load, size=lambda shown: shown.tokens.count)

    def tokens(request: Request) -> str:
        record_id = request.query_params.get("id")
        if not record_id:
            raise invalid("missing parameter 'id'")
        shown = recent.get(record_id)
        if shown is None:
            raise LookupError(f"no token fields archived for record {record_id!r}")
        found, record = shown
        offered = record.signals()
        wanted = request.query_params.get("signal") or offered[0].name
        signal = next((s for s in offered if s.name == wanted), None)
        if signal is None:
            names = ", ".join(s.name for s in offered)
            raise invalid(f"signal: this record can be coloured by {names}, not {wanted!r}")
        at = _position(request, "at", invalid)
        start = at if at is not None else (_position(request, "start", invalid) or 0)
        if start >= record.count:
            raise LookupError(f"no token {start}: record {record_id!r} has {record.count}")
        return token_page(found, record, signal, start - start % WINDOW, archive=label)

    def stylesheet(request: Request) -> Response:
        return Response(css, media_type="text/css", headers={"Cache-Control": "max-age=3600"})

    return [Route("/tokens", page(tokens)), Route("/static/tokens.css", stylesheet)]
