"""Reading the viewer's pages back: the values it shows, by the `data-*` attributes it marks them with."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass, field
from html.parser import HTMLParser


@dataclass
class Block:
    """An element marked with data-step/-split/-group/-id/-version, and the data-k values inside it."""

    attrs: dict[str, str]
    tag: str
    values: dict[str, str] = field(default_factory=dict)
    classes: str = ""


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.blocks: list[Block] = []
        self.values: dict[str, str] = {}
        self.links: list[str] = []
        self.assets: list[str] = []
        self._open: list[tuple[str, Block | None]] = []
        self._key: tuple[str, str, int] | None = None  # (data-k, tag, depth)
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "a" and "href" in a:
            self.links.append(a["href"])
        if tag in ("link", "script", "img") and (a.get("href") or a.get("src")):
            self.assets.append(a.get("href") or a.get("src") or "")
        if tag in ("meta", "link", "input", "br", "img", "circle", "rect", "line", "path"):
            return
        marked = {
            k: v
            for k, v in a.items()
            if k in ("data-step", "data-split", "data-group", "data-id", "data-version")
        }
        block = Block(marked, tag, classes=a.get("class", "")) if marked else None
        if block is not None:
            self.blocks.append(block)
        self._open.append((tag, block))
        if "data-k" in a and self._key is None:
            self._key = (a["data-k"], tag, len(self._open))
            self._text = []

    def handle_endtag(self, tag: str) -> None:
        if not self._open or self._open[-1][0] != tag:
            return
        if self._key is not None and self._key[2] == len(self._open):
            text = "".join(self._text).strip()
            self.values.setdefault(self._key[0], text)
            for _, block in reversed(self._open):
                if block is not None:
                    block.values[self._key[0]] = text
                    break
            self._key = None
        self._open.pop()

    def handle_data(self, data: str) -> None:
        if self._key is not None:
            self._text.append(data)


@dataclass
class Page:
    status: int
    html: str
    blocks: list[Block]
    values: dict[str, str]
    links: list[str]
    assets: list[str]
    location: str | None = None

    def rows(self, attr: str) -> dict[str, dict[str, str]]:
        """The values of each block marked with `attr` (data-step, ...), keyed by that attribute."""
        return {b.attrs[attr]: b.values for b in self.blocks if attr in b.attrs}


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def get(base: str, path: str) -> Page:
    """GET `path` of the viewer at `base`, parsed."""
    try:
        with _OPENER.open(base + path, timeout=30) as r:
            status, body, location = r.status, r.read().decode(), r.headers.get("Location")
    except urllib.error.HTTPError as exc:
        status, body, location = exc.code, exc.read().decode(), exc.headers.get("Location")
    parser = _Parser()
    parser.feed(body)
    return Page(status, body, parser.blocks, parser.values, parser.links, parser.assets, location)
