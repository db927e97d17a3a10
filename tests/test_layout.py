"""The package's structure: no import cycles, no module using another's private attributes."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import asynctrace

ROOT = Path(asynctrace.__file__).parent


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    """Every asynctrace module by name: its file and its parsed source (which no test changes)."""
    return dict(_parsed())


# Parsing the package is most of each test's time: once for the module's tests.
@functools.cache
def _parsed() -> dict[str, tuple[Path, ast.Module]]:
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


# The layers of docs/architecture.md, lowest first: a module imports only from its own layer or
# lower ones (lazily too). Within a layer, packages do not import each other except as listed.
LAYERS: list[set[str]] = [
    {"_security"},
    {"exceptions", "_checks", "_stats"},
    {"_records", "_runtime"},
    {"_select", "_durable", "rollouts"},
    {"sinks"},
    {"testing"},
    {"_engine"},
    {"_sync"},
    {"_session"},
    {"_fronts"},
    {"ray", "distributed", "adapters", "view"},
    {"_demo_config"},
    {"_demo", "_recover"},
    {""},  # the public face, asynctrace/__init__.py
    {"cli"},
    {"__main__"},
]
# Imports allowed inside one layer: (importer, imported).
SAME_LAYER: set[tuple[str, str]] = set()


def _part(module: str) -> str:
    """The top-level part of asynctrace a module belongs to ("" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(part: str) -> int:
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i
    raise AssertionError(f"asynctrace.{part} is in no layer of tests/test_layout.py: place it")


def test_imports_run_one_way_through_the_layers() -> None:
    """No module imports (at module level or lazily) from a later layer, nor a sibling of its own
    layer, so the package order of docs/architecture.md holds: records/runtime → select/durable →
    sinks → engine → session → ray/distributed/adapters → cli."""
    modules = _modules()
    offences = []
    for name, (path, tree) in modules.items():
        here = _part(name)
        for dep in _all_imports(name, path, tree, set(modules)):
            there = _part(dep)
            if there == here or (here, there) in SAME_LAYER:
                continue
            if _layer(there) >= _layer(here):
                offences.append(f"{name} imports {dep}")
    assert offences == []


def test_the_engine_imports_nothing_above_it() -> None:
    """`asynctrace._engine` imports no module of the session, the fronts or the CLI."""
    modules = _modules()
    above = {p for layer in LAYERS[_layer("_engine") + 1 :] for p in layer}
    offences = [
        f"{name} imports {dep}"
        for name, (path, tree) in modules.items()
        if _part(name) == "_engine"
        for dep in _all_imports(name, path, tree, set(modules))
        if _part(dep) in above
    ]
    assert offences == []


def test_the_step_closing_rule_is_written_once() -> None:
    """Every holder of per-step state closes steps through `_select/window.StepWindow`: no other
    module keeps its own closed prefix (`_closed_upto`) or computes `step - max_open_steps`."""
    modules = _modules()
    owners = {
        "asynctrace._select.gate",
        "asynctrace._engine.group_metrics",
        "asynctrace.ray._merge",
        "asynctrace._fronts.selection",
    }
    offences = []
    for name, (path, _) in modules.items():
        text = path.read_text()
        if name == "asynctrace._select.window":
            continue
        if "_closed_upto" in text or "- self.max_open_steps" in text or "- max_open_steps" in text:
            offences.append(name)
    assert offences == []
    for name in owners:
        assert "StepWindow" in modules[name][0].read_text(), name


def test_every_public_name_resolves_and_imports_nothing_heavy_before_use() -> None:
    """Each name in asynctrace.__all__ resolves to its defining module's object, and a fresh
    `import asynctrace` loads neither the session nor any sink until a name is used."""
    import subprocess
    import sys

    import asynctrace

    for name in asynctrace.__all__:
        assert getattr(asynctrace, name) is not None, name
    probe = (
        "import sys, asynctrace; "
        "print(sorted(m for m in sys.modules if m.startswith(('asynctrace._session', 'asynctrace.sinks'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_sizes_a_newcomer_can_read() -> None:
    """At most 14 files at the top of asynctrace/, TraceSession under 300 lines, no class over 350."""
    assert len(list(ROOT.glob("*.py"))) <= 14
    sizes = {
        f"{name}.{node.name}": node.end_lineno - node.lineno + 1  # type: ignore[operator]
        for name, (_, tree) in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }
    assert sizes["asynctrace._session.TraceSession"] < 300
    assert "asynctrace._engine.buffer.Buffer" in sizes
    assert {name: n for name, n in sizes.items() if n > 350} == {}


def test_the_submitted_count_and_the_invalid_sample_rule_are_written_once() -> None:
    """Only `Ledger.submit` adds to a submitted count, and only `_engine/encoder.py`'s
    `Candidates` leaves invalid samples out of the places the cap is asked about: every way in
    that asks the cap before encoding (log_samples' encoder, log_rollouts) goes through it."""
    modules = _modules()
    adds = {
        name: text.count("submitted +=")
        for name, (path, _) in modules.items()
        if "submitted +=" in (text := path.read_text())
    }
    assert adds == {"asynctrace._engine.ledger": 1}
    rule = "takes no place, so one"  # the rule as its comment states it
    assert [name for name, (path, _) in modules.items() if rule in path.read_text()] == [
        "asynctrace._engine.encoder"
    ]
    defined = [
        name
        for name, (_, tree) in modules.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "leave_out"
    ]
    assert defined == ["asynctrace._engine.encoder"]
    for name in ("asynctrace._engine.encoder", "asynctrace._engine.rollout_intake"):
        assert ".leave_out(" in modules[name][0].read_text(), name
