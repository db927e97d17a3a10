"""docs/reference/: one Markdown page per public module, generated from the code's docstrings.

A page documents its module's `__all__`; a class comes with its public members (methods,
properties, attributes). Each object is documented in full once, on the page of the public
module nearest to where it is defined, and linked from the other modules that export it. The
code is read by Griffe's static analysis (`griffelib`, pinned in the `dev` extra): nothing is
imported, so the optional extras (Ray, torch, DuckDB) need not be installed, and a page names no
memory address and no path of the machine that made it. tests/test_reference.py fails when the
checked-in pages differ from what this writes, or when a public name has no docstring.

    python scripts/reference.py [--out docs/reference]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference"
COMMAND = "python scripts/reference.py"
HEADER = f"<!-- Generated from the docstrings by `{COMMAND}`: edit the code, then run it. -->\n"
# The public modules, one page each, in the index's order.
MODULES = (
    "asynctrace",
    "asynctrace.sinks",
    "asynctrace.testing",
    "asynctrace.exceptions",
    "asynctrace.rollouts",
    "asynctrace.ray",
    "asynctrace.distributed",
    "asynctrace.view",
    "asynctrace.adapters",
    "asynctrace.adapters.areal_adapter",
    "asynctrace.adapters.nemo_rl_adapter",
    "asynctrace.adapters.open_instruct_adapter",
    "asynctrace.adapters.openrlhf_adapter",
    "asynctrace.adapters.prime_rl_adapter",
    "asynctrace.adapters.skyrl_adapter",
    "asynctrace.adapters.slime_adapter",
    "asynctrace.adapters.torchforge_adapter",
    "asynctrace.adapters.trl_adapter",
    "asynctrace.adapters.verl_adapter",
)
# A docs page a docstring names becomes a link; a code span naming a documented object, too.
_DOC_PATH = re.compile(r"(?<![\w/.\[])(?<!\]\()docs/([\w/.-]+?\.md)(?!\w)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_WIDTH = 96
Kind = griffe.ParameterKind


@dataclass(frozen=True)
class Export:
    """One name of a module's `__all__`, what it names, and the module whose page documents it."""

    name: str
    target: griffe.Object
    home: str


def load() -> griffe.Module:
    """The package, read statically from this checkout."""
    package = griffe.load(
        "asynctrace", search_paths=[str(ROOT)], resolve_aliases=True, resolve_external=False
    )
    assert isinstance(package, griffe.Module)
    return package


def module(package: griffe.Module, path: str) -> griffe.Module:
    found = package if path == package.path else package[path.removeprefix(package.path + ".")]
    assert isinstance(found, griffe.Module), path
    return found


def exports(mod: griffe.Module) -> list[str]:
    names = mod.exports
    if not names or not all(isinstance(n, str) for n in names):
        raise SystemExit(f"{mod.path}: give it a literal __all__ of names")
    return [str(n) for n in names]


def wrapped_class(obj: griffe.Object) -> griffe.Class | None:
    """The class an attribute is made from by a wrapping call (`ray.remote(...)(Cls)`), if any."""
    value = getattr(obj, "value", None)
    if not isinstance(value, griffe.ExprCall) or len(value.arguments) != 1 or obj.parent is None:
        return None
    argument = value.arguments[0]
    found = obj.parent.members.get(argument.name) if isinstance(argument, griffe.ExprName) else None
    target = found.final_target if isinstance(found, griffe.Alias) else found
    return target if isinstance(target, griffe.Class) else None


def documented(e: Export) -> griffe.Object:
    """What an export's entry describes: the class a wrapped attribute is made from, else itself."""
    return wrapped_class(e.target) or e.target


def collect(package: griffe.Module) -> dict[str, list[Export]]:
    """Every public module's exports, each with its home: of the modules exporting the same
    object, the one nearest its definition (`ConsoleSink` is documented on `asynctrace.sinks`)."""
    found: dict[str, list[tuple[str, str, griffe.Object]]] = {}
    for path in MODULES:
        mod = module(package, path)
        for name in exports(mod):
            obj = mod[name]
            target = obj.final_target if obj.is_alias else obj
            assert isinstance(target, griffe.Object)
            # An attribute (a constant, a wrapped class) is one per module that assigns it.
            key = f"{path}.{name}" if target.is_attribute else target.path
            found.setdefault(key, []).append((path, name, target))
    homes: dict[tuple[str, str], Export] = {}
    for key, exporters in found.items():
        nearest = max((m for m, _, _ in exporters), key=lambda m: (key.startswith(m + "."), len(m), m))
        for path, name, target in exporters:
            home = target.path if target.is_module else nearest
            homes[(path, name)] = Export(name, target, home)
    return {path: [homes[(path, n)] for n in exports(module(package, path))] for path in MODULES}


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading whose text (formatting left out) is `heading`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def signature(
    name: str, params: griffe.Parameters | None, returns: object = None, prefix: str = "def"
) -> str:
    """A Python signature without `self`, one parameter a line when it is long."""
    parts: list[str] = []
    previous: Kind | None = None
    for i, p in enumerate(params or ()):
        if i == 0 and p.name in ("self", "cls"):
            continue
        if previous is Kind.positional_only and p.kind is not previous:
            parts.append("/")
        if p.kind is Kind.keyword_only and previous not in (Kind.keyword_only, Kind.var_positional):
            parts.append("*")
        star = {Kind.var_positional: "*", Kind.var_keyword: "**"}.get(p.kind, "")
        text = star + p.name + (f": {p.annotation}" if p.annotation is not None else "")
        if p.default is not None and not star:
            text += (" = " if p.annotation is not None else "=") + default_text(p)
        parts.append(text)
        previous = p.kind
    if previous is Kind.positional_only:
        parts.append("/")
    tail = f" -> {returns}" if returns is not None else ""
    line = f"{prefix} {name}({', '.join(parts)}){tail}"
    if len(line.split("\n")[-1]) <= _WIDTH:
        return line
    body = "".join(f"    {part},\n" for part in parts)
    return f"{prefix} {name}(\n{body}){tail}"


def default_text(p: griffe.Parameter) -> str:
    """A default as written, or the value of the module constant it names (`DEFAULT_RETRY`)."""
    default = p.default
    name = default.last if isinstance(default, griffe.ExprAttribute) else default
    if isinstance(name, griffe.ExprName) and name.name.isupper():
        try:
            value = getattr(name.resolved, "value", None)
        except (KeyError, AttributeError, ValueError, griffe.AliasResolutionError):
            value = None
        if value is not None:
            return str(value)
    return str(default)


def members(cls: griffe.Class, public: set[str]) -> Iterator[griffe.Object]:
    """A class's public members, its own first, then those of private bases (`Counts.check`),
    each in source order. A member of a documented public base (`Sink.write`) is left to that
    base's entry, also where it is overridden without a docstring of its own."""
    seen: set[str] = set()
    for owner in [cls, *cls.mro()]:
        if owner is not cls and owner.path in public:
            continue
        for member in sorted(owner.members.values(), key=lambda m: (m.lineno or 0, m.name)):
            if isinstance(member, griffe.Alias) or member.name.startswith("_") or member.name in seen:
                continue
            seen.add(member.name)
            inherited = any(b.path in public and member.name in b.members for b in cls.mro())
            if member.docstring is None and inherited:
                continue
            yield member


class Page:
    """The Markdown of one module's page."""

    def __init__(self, path: str, entries: list[Export], links: dict[str, str]) -> None:
        self.path = path
        self.entries = sorted(entries, key=_order)
        # Documented object's path, or a name as code spans write it -> "page.md#anchor".
        self.links = links
        self.lines: list[str] = []
        self.missing: list[str] = []

    def render(self, mod: griffe.Module) -> str:
        self.lines += [f"# `{self.path}`\n", HEADER]
        self._doc(mod, self.path)
        if self.entries:
            self.lines.append("| name | what |\n|---|---|")
            for e in self.entries:
                self.lines.append(f"| [`{e.name}`]({self._link(e)}) | {self.summary(documented(e), e)} |")
            self.lines.append("")
        for e in self.entries:
            if e.home == self.path and not e.target.is_module:
                self._entry(e)
        return _tidy("\n".join(self.lines))

    def summary(self, obj: griffe.Object, e: Export | None = None) -> str:
        doc = _docstring(e.target) if e is not None else ""
        text = (doc or _docstring(obj)).split("\n\n")[0].replace("\n", " ")
        return self.prose(text).replace("|", "\\|")

    def prose(self, text: str) -> str:
        """A docstring as Markdown: `<` escaped outside code, docs/ paths and names linked."""
        out, at = [], 0
        for match in _CODE_SPAN.finditer(text):
            out.append(_plain(text[at : match.start()]))
            out.append(self._code(match.group(0), match.group(2)))
            at = match.end()
        out.append(_plain(text[at:]))
        return "".join(out)

    def _code(self, span: str, name: str) -> str:
        local = {e.name: self._link(e) for e in self.entries if not e.target.is_module}
        if local.get(name, "").startswith("#"):
            return f"[{span}]({local[name]})"
        target = self.links.get(name) or self.links.get(name.removeprefix("asynctrace."))
        if target is None:
            return span
        page, _, frag = target.partition("#")
        return f"[{span}]({f'#{frag}' if page == f'{self.path}.md' else target})"

    def _link(self, e: Export) -> str:
        if e.target.is_module:
            return f"{e.target.path}.md"
        return f"#{anchor(e.name)}" if e.home == self.path else f"{e.home}.md#{anchor(e.name)}"

    def _entry(self, e: Export) -> None:
        w = self.lines.append
        w(f"## `{e.name}`\n")
        target = documented(e)
        if target is not e.target:
            self._doc(e.target, e.name)
        if isinstance(target, griffe.Class):
            w(f"```python\n{signature(e.name, target.parameters, prefix='class')}\n```\n")
            bases = [b for b in _mro(target) if b.path in self.links]
            if bases:
                w("Bases: " + ", ".join(self._code(f"`{b.name}`", b.path) for b in bases) + ".\n")
            self._doc(target, e.name)
            attributes: list[str] = []
            for member in members(target, set(self.links)):
                self._member(e.name, member, attributes)
            if attributes:
                w("Attributes:\n\n" + "\n".join(attributes) + "\n")
        elif isinstance(target, griffe.Function):
            prefix = "async def" if "async" in target.labels else "def"
            w(f"```python\n{signature(e.name, target.parameters, target.returns, prefix)}\n```\n")
            self._doc(target, e.name)
        else:
            w(f"```python\n{e.name} = {getattr(target, 'value', None)}\n```\n")
            self._doc(target, e.name)

    def _member(self, owner: str, member: griffe.Object, attributes: list[str]) -> None:
        w, name = self.lines.append, f"{owner}.{member.name}"
        if isinstance(member, griffe.Attribute) and "property" not in member.labels:
            annotation = f": {member.annotation}" if member.annotation is not None else ""
            doc = f": {self.summary(member)}" if member.docstring else ""
            attributes.append(f"- `{member.name}{annotation}`{doc}")
            return
        w(f"### `{name}`\n")
        if isinstance(member, griffe.Function):
            prefix = "async def" if "async" in member.labels else "def"
            for label in ("classmethod", "staticmethod"):
                if label in member.labels:
                    prefix = f"@{label}\n{prefix}"
            w(f"```python\n{signature(member.name, member.parameters, member.returns, prefix)}\n```\n")
        elif isinstance(member, griffe.Attribute):
            annotation = f": {member.annotation}" if member.annotation is not None else ""
            w(f"```python\n@property\n{member.name}{annotation}\n```\n")
        self._doc(member, name)

    def _doc(self, obj: griffe.Object, name: str) -> None:
        text = _docstring(obj)
        if text:
            self.lines.append(self.prose(text) + "\n")
        else:
            self.missing.append(f"{self.path}: {name}")


def _docstring(obj: griffe.Object) -> str:
    return obj.docstring.value.strip() if obj.docstring else ""


def _mro(cls: griffe.Class) -> Sequence[griffe.Class]:
    try:
        return cls.mro()
    except ValueError:
        return []


def _plain(text: str) -> str:
    text = text.replace("<", "&lt;")
    return _DOC_PATH.sub(lambda m: f"[docs/{m.group(1)}](../{m.group(1)})", text)


def _order(e: Export) -> tuple[int, str]:
    """Classes, then functions, then constants, then modules; by name within each."""
    target = documented(e)
    kind = 0 if target.is_class else 1 if target.is_function else 3 if target.is_module else 2
    return (kind, e.name.lower())


def _tidy(text: str) -> str:
    """At most one blank line in a row; one file ending."""
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"


def render(package: griffe.Module) -> tuple[dict[str, str], list[str]]:
    """Every page (file name -> Markdown), and the public names that lack a docstring."""
    table = collect(package)
    homes = [(path, e) for path, entries in table.items() for e in entries if e.home == path]
    homes = [(path, e) for path, e in homes if not e.target.is_module]
    public = {documented(e).path for _, e in homes}
    links: dict[str, str] = {}
    named: dict[str, set[str]] = {}  # a name as code spans write it -> where it is documented
    for path, e in homes:
        target = documented(e)
        where = f"{path}.md#{anchor(e.name)}"
        links[target.path] = where
        for key in (e.name, f"{path.removeprefix('asynctrace.')}.{e.name}"):
            named.setdefault(key, set()).add(where)
        if isinstance(target, griffe.Class):
            for member in members(target, public):
                if not (isinstance(member, griffe.Attribute) and "property" not in member.labels):
                    key = f"{e.name}.{member.name}"
                    named.setdefault(key, set()).add(f"{path}.md#{anchor(key)}")
    # A name documented in two places (`attach`) links only from its own module's page.
    links |= {key: next(iter(where)) for key, where in named.items() if len(where) == 1}
    pages: dict[str, str] = {}
    missing: list[str] = []
    for path, entries in table.items():
        page = Page(path, entries, links)
        pages[f"{path}.md"] = page.render(module(package, path))
        missing += page.missing
    index = Page("index", [], links)
    lines = [
        "# Reference\n",
        HEADER,
        "Every public module, its names and their docstrings, generated from the code. The",
        "guides ([index](../index.md)) say how the pieces fit together; [api.md](../api.md) is the",
        "short overview.\n",
        "| module | what |\n|---|---|",
    ]
    lines += [f"| [`{p}`]({p}.md) | {index.summary(module(package, p))} |" for p in MODULES]
    pages["index.md"] = _tidy("\n".join(lines))
    return pages, missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="the folder to write (default: docs/reference)")
    args = parser.parse_args(argv)
    pages, missing = render(load())
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in sorted(out.glob("*.md")):
        if stale.name not in pages:
            stale.unlink()
    for name, text in sorted(pages.items()):
        (out / name).write_text(text, encoding="utf-8")
    for name in missing:
        print(f"no docstring: {name}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
