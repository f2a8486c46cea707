"""The package's layout holds: imports flow one way, with no circle, and no room grows too large.

Read from the source with ``ast`` (every import counts, those inside functions and under
``TYPE_CHECKING`` too: each says what a module knows). The layers, top to bottom::

    maskln_cli (the public facade)  ->  testing  ->  cli  ->  jobs  ->  verify | grading
        ->  compare | models  ->  files  ->  op  ->  errors

A module may import its own package and any layer below its own; never one above, nor a
neighbour on its own layer (verify and grading know nothing of each other).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "maskln_cli"

LAYERS = {
    "errors": 0,
    "version": 0,
    "op": 1,
    "files": 2,
    "compare": 3,
    # models (capture, swap) needs the op and files (it writes dumps); nothing below may know
    # nn.Module hooks, and verify reads its dumps as files, so it sits beside compare.
    "models": 3,
    "verify": 4,
    "grading": 4,
    "jobs": 5,
    "cli": 6,
    # testing (assert_close, the strategies, the pytest plugin) is pytest's face over verify's
    # judgement: it prints verify's report with the command line's renderer (cli.report), so
    # it sits above cli; nothing imports it (`from maskln_cli import testing` finds it).
    "testing": 7,
    "": 8,  # maskln_cli/__init__.py and __main__.py: the public facade
}
MAX_FILE_LINES = 800
MAX_CLASS_LINES = 300


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The layer a module belongs to: its first package under maskln_cli ('' for the facade)."""
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] == "__main__"):
        return ""
    return parts[1]


def sources() -> dict[str, tuple[Path, ast.Module]]:
    return {
        module_name(path): (path, ast.parse(path.read_text(), str(path)))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def imports_of(module: str, tree: ast.Module) -> list[tuple[int, str, list[str]]]:
    """``(line, imported module, names)`` for each import of a maskln_cli module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "maskln_cli":
                    found.append((node.lineno, alias.name, []))
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{module}:{node.lineno}: absolute imports only"
            target = node.module or ""
            if target.split(".")[0] != "maskln_cli":
                continue
            names = [alias.name for alias in node.names]
            # "from maskln_cli.grading import sandbox" imports a module, not a name
            modules = [f"{target}.{name}" for name in names if _is_module(f"{target}.{name}")]
            if modules:
                found += [(node.lineno, m, []) for m in modules]
                names = [n for n in names if f"{target}.{n}" not in modules]
                if not names:
                    continue
            found.append((node.lineno, target, names))
    return found


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative).is_dir()


SOURCES = sources()


def test_every_package_has_a_layer_and_a_docstring():
    for module, (path, tree) in SOURCES.items():
        assert part_of(module) in LAYERS, f"{path}: package {part_of(module)!r} has no layer"
        if path.name == "__init__.py":
            doc = ast.get_docstring(tree)
            assert doc and "import" in doc, f"{path}: say what it knows and must not import"


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_imports_flow_down_only(module):
    path, tree = SOURCES[module]
    here = part_of(module)
    for line, target, _ in imports_of(module, tree):
        there = part_of(target)
        if there == here:
            continue
        assert LAYERS[there] < LAYERS[here], (
            f"{path}:{line} imports {target}: {here or 'the facade'} (layer {LAYERS[here]})"
            f" may import only layers below it, and {there} is layer {LAYERS[there]}"
        )


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_no_private_name_crosses_modules(module):
    path, tree = SOURCES[module]
    for line, target, names in imports_of(module, tree):
        private = [n for n in names if n.startswith("_")]
        assert not private, f"{path}:{line} imports private {private} from {target}"


def test_no_import_circles():
    graph = {
        module: {target for _, target, _ in imports_of(module, tree) if target in SOURCES}
        for module, (_, tree) in SOURCES.items()
    }
    # A package's __init__ re-exporting its own modules is not a circle with them.
    for module in graph:
        graph[module] = {t for t in graph[module] if not module.startswith(t + ".")}
    circles = _strongly_connected(graph)
    assert not circles, f"import circles: {circles}"


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of two or more modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_a_circle_is_found():
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c"]
    ]
    assert _strongly_connected({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_no_room_is_too_large(module):
    path, tree = SOURCES[module]
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{path}: {lines} lines (at most {MAX_FILE_LINES})"
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            assert length <= MAX_CLASS_LINES, (
                f"{path}:{node.lineno}: class {node.name} has {length} lines"
                f" (at most {MAX_CLASS_LINES})"
            )


def test_testing_takes_only_the_report_of_cli_and_nothing_imports_it():
    """maskln_cli.testing renders with the command line's report, never its commands; and no
    module of maskln_cli imports it (pytest loads its plugin; users import it)."""
    for module, (path, tree) in SOURCES.items():
        for line, target, _ in imports_of(module, tree):
            if part_of(module) == "testing" and part_of(target) == "cli":
                assert target.startswith("maskln_cli.cli.report"), f"{path}:{line}: {target}"
            if part_of(target) == "testing":
                assert part_of(module) == "testing", f"{path}:{line} imports {target}"
