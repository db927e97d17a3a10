"""The pieces every page is built of: the page around a view, links, numbers and table cells.

Every value from the archive is hostile text: it reaches HTML only through `escape` (text and
quoted attributes) and URLs only through `url` (a fixed path, its query encoded). Markup has no
script, no event handler and no style attribute: the Content-Security-Policy (`_guard`) forbids them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import Any
from urllib.parse import urlencode

__all__ = ["cell", "clip", "escape", "layout", "num", "share", "url"]


def url(path: str, **params: Any) -> str:
    """A view's shareable address: its path and its query, without empty parameters."""
    kept = {k: v for k, v in params.items() if v is not None and v != ""}
    return path + ("?" + urlencode(kept) if kept else "")


def num(value: float | None, digits: int = 4) -> str:
    """A number as every page shows it: fixed decimals, "—" for none."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    text = f"{value:.{digits}f}"
    # A rounding error's worth below zero is shown as zero, not "-0.0000".
    return text[1:] if text.startswith("-") and not text.strip("-0.") else text


def share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def cell(key: str, text: str, cls: str = "") -> str:
    """A table cell marked with its key (`data-k`, which the tests read values by)."""
    extra = f' class="{cls}"' if cls else ""
    return f'<td data-k="{key}"{extra}>{escape(text)}</td>'


def clip(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def layout(
    title: str,
    body: str,
    *,
    archive: str,
    crumbs: Sequence[tuple[str, str]] = (),
    refresh: bool = False,
) -> str:
    """The page around a view: header (archive, find box), breadcrumbs, title; `refresh` reloads
    it each second (a meta refresh: no script)."""
    trail = " / ".join(
        ['<a href="/">overview</a>'] + [f'<a href="{escape(h)}">{escape(t)}</a>' for t, h in crumbs]
    )
    reload = '<meta http-equiv="refresh" content="1">' if refresh else ""
    return f"""<!doctype html>
<html lang="en"><head>{reload}<meta charset="utf-8"><meta name="viewport" content="width=device-width">
<title>{escape(title)} · asynctrace view</title><link rel="stylesheet" href="/static/view.css">
<link rel="icon" href="/static/favicon.svg" type="image/svg+xml"></head>
<body><header><a class="brand" href="/">asynctrace view</a><span class="archive">{escape(archive)}</span>
<form class="find" action="/find" method="get"><input name="id" placeholder="record, group or prompt id">
<input name="q" placeholder="text"><button>find</button></form></header>
<nav class="crumbs">{trail}</nav><main><h1>{escape(title)}</h1>
{body}
</main></body></html>"""
