"""A page as a small element tree, for tests that read its structure: which elements, attributes
and text it holds, and the turns of a conversation as the viewer marks them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser

_VOID = frozenset(
    ("meta", "link", "input", "br", "hr", "img", "source", "wbr", "area", "col", "embed", "base")
)


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node | str] = field(default_factory=list)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def walk(self) -> Iterator[Node]:
        yield self
        for c in self.children:
            if isinstance(c, Node):
                yield from c.walk()

    def all(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> list[Node]:
        """Every element below (and with) this one of that tag, class and attribute values
        (`data_id="x"` stands for data-id)."""
        wanted = {k.replace("_", "-"): v for k, v in attrs.items()}
        return [
            n
            for n in self.walk()
            if (tag is None or n.tag == tag)
            and (cls is None or cls in n.classes)
            and all(n.attrs.get(k) == v for k, v in wanted.items())
        ]

    def one(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> Node:
        found = self.all(tag, cls, **attrs)
        assert len(found) == 1, (tag, cls, attrs, len(found))
        return found[0]


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", {})
        self._open = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self._open[-1].children.append(node)
        if tag not in _VOID:
            self._open.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._open[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._open) - 1, 0, -1):
            if self._open[i].tag == tag:
                del self._open[i:]
                return

    def handle_data(self, data: str) -> None:
        self._open[-1].children.append(data)


def parse(html: str) -> Node:
    builder = _Builder()
    builder.feed(html)
    builder.close()
    return builder.root


@dataclass(frozen=True)
class ShownTurn:
    """One turn as a page shows it: its position in the record, role, text, calls (function,
    arguments as shown) and what the turn says about itself (a tool result's tool and call)."""

    position: int
    role: str
    text: str
    calls: tuple[tuple[str, str], ...]
    about: str


def turns(node: Node) -> list[ShownTurn]:
    """The turns shown inside `node`, in order."""
    out = []
    for li in node.all("li", "turn"):
        role = next(n for n in li.all("span", "role")).text()
        about = [n.text() for n in li.all("span", "about")]
        text = [
            n.text() for n in li.children if isinstance(n, Node) and n.tag == "pre" and "text" in n.classes
        ]
        calls = tuple(
            (c.one("code", "fn").text(), "".join(a.text() for a in c.all("pre", "args")))
            for c in li.all("div", "call")
        )
        out.append(ShownTurn(int(li.attrs["data-turn"]), role, "".join(text), calls, "".join(about)))
    return out
