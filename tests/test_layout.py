"""The package's structure: no import cycles, no module using another's private attributes."""

from __future__ import annotations

import ast
from pathlib import Path

import asynctrace

ROOT = Path(asynctrace.__file__).parent


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = (path, ast.parse(path.read_text()))
    return out


def _module_level(tree: ast.Module, lazy: bool = False) -> list[ast.AST]:
    """The nodes outside function bodies (with `lazy`, inside them too)."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if lazy or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo.extend(ast.iter_child_nodes(node))
    return out


def _imports(name: str, path: Path, tree: ast.Module, known: set[str], lazy: bool = False) -> set[str]:
    """Every asynctrace module `name` imports when it is imported (TYPE_CHECKING blocks too)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    deps: set[str] = set()
    for node in _module_level(tree, lazy):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                deps.add(sub if sub in known else module)
        elif isinstance(node, ast.Import):
            deps.update(alias.name for alias in node.names)
    return (deps & known) - {name}


def test_no_import_cycles() -> None:
    """No asynctrace module imports, directly or through others, a module that imports it
    (imports inside functions, made lazily to break such a loop, are left out)."""
    modules = _modules()
    graph = {name: _imports(name, path, tree, set(modules)) for name, (path, tree) in modules.items()}
    assert _cycles(graph) == []


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """The modules that reach themselves again through `graph`."""
    cycles = []
    for start in graph:
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            mod = todo.pop()
            if mod == start:
                cycles.append(start)
                break
            if mod not in seen:
                seen.add(mod)
                todo.extend(graph[mod])
    return cycles


def _private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, attributes it assigns, slots."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_uses_another_modules_private_attributes() -> None:
    """`x._name` only where the module itself defines `_name` (its own classes' state)."""
    modules = _modules()
    own = {name: _private_names(tree) for name, (_, tree) in modules.items()}
    everyone = set().union(*own.values())
    offences = []
    for name, (path, tree) in modules.items():
        for node in ast.walk(tree):
            if (
                not isinstance(node, ast.Attribute)
                or not node.attr.startswith("_")
                or node.attr.startswith("__")
            ):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in everyone and node.attr not in own[name]:
                offences.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert offences == []


def _all_imports(name: str, path: Path, tree: ast.Module, known: set[str]) -> set[str]:
    """Every asynctrace module `name` imports, at module level or inside a function."""
    return _imports(name, path, tree, known, lazy=True)


def test_no_lazy_import_cycles() -> None:
    """No loop closes through an import made inside a function either: a lazy import only hides
    a cycle, it does not remove the two modules' need of each other."""
    modules = _modules()
    graph = {name: _all_imports(name, path, tree, set(modules)) for name, (path, tree) in modules.items()}
    assert _cycles(graph) == []


def test_no_module_imports_another_modules_private_names() -> None:
    """`from .x import _name` only of a module (or a module's public helpers), never of its private names."""
    modules = _modules()
    offences = []
    for name, (path, tree) in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            offences += [
                f"{path.relative_to(ROOT.parent)}: {alias.name}"
                for alias in node.names
                if alias.name.startswith("_")
                and not alias.name.startswith("__")
                and f"{base}.{alias.name}" not in modules
            ]
    assert offences == []
