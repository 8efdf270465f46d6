"""The architecture page holds: the import rules it states are read from the page and checked against every
import of ``core/forge`` (function-level ones included), and so are its rules on circles, module names and size."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core"
PAGE = ROOT / "docs" / "architecture.md"
MAX_LINES = 500
#: names that may repeat: package faces, the file name Triton asks for, the plugin API of llm/ and encoder/
SHARED_NAMES = {"__init__", "model", "adapter", "plugin"}


def _module(path: Path) -> str:
    parts = list(path.relative_to(CORE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in sorted((CORE / "forge").rglob("*.py")) if "__pycache__" not in p.parts}


def _imports(module: str, path: Path) -> set[str]:
    """The forge modules ``module`` imports, anywhere in its code."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            while name not in MODULES and "." in name:
                name = name.rpartition(".")[0]
            if name in MODULES and name != module and (name == "forge" or name.startswith("forge.")):
                found.add(name)
    return found


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "forge"


def _rules() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """The page's import rules: groups (``name = rooms``) and, per room, the rooms it may import."""
    text = PAGE.read_text()
    block = re.search(r"<!-- import rules -->\s*```text\n(.*?)```", text, re.S)
    assert block, f"{PAGE.name} has no '<!-- import rules -->' block"
    groups: dict[str, set[str]] = {}
    allowed: dict[str, set[str]] = {}
    for line in block.group(1).splitlines():
        if "=" in line:
            name, rooms = line.split("=", 1)
            groups[name.strip()] = set(rooms.split())
        elif ":" in line:
            room, rooms = line.split(":", 1)
            allowed[room.strip()] = set(rooms.split())
    return groups, allowed


def _expand(names: set[str], groups: dict[str, set[str]]) -> set[str]:
    return set().union(*(groups.get(n, {n}) for n in names)) if names else set()


def test_every_room_imports_only_what_the_page_allows() -> None:
    groups, allowed = _rules()
    rooms = {_room(m) for m in MODULES} - {"forge"}
    named = _expand(set(allowed), groups)
    assert rooms == named, f"rooms in the code but not on the page: {sorted(rooms - named)}; " \
                           f"on the page but not in the code: {sorted(named - rooms)}"
    rule_of = {room: _expand(may, groups) for line, may in allowed.items() for room in _expand({line}, groups)}
    broken = sorted(f"{m} imports {t}" for m, targets in GRAPH.items() for t in targets
                    if _room(t) not in {_room(m), "forge"} | rule_of[_room(m)])
    assert not broken, "imports the architecture page does not allow:\n" + "\n".join(broken)


def test_in_triton_imports_nothing_of_forge() -> None:
    outside = sorted(f"{m} imports {t}" for m, targets in GRAPH.items() if _room(m) == "in_triton"
                     for t in targets if _room(t) != "in_triton")
    assert not outside, outside


def test_no_module_imports_itself_through_others() -> None:
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in GRAPH[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert not circles, circles


def test_module_names_are_unique_and_shadow_no_package() -> None:
    seen: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        seen.setdefault(path.stem, []).append(module)
    repeated = {name: where for name, where in seen.items() if len(where) > 1 and name not in SHARED_NAMES}
    assert not repeated, repeated
    installed = set(sys.stdlib_module_names) | set(importlib.metadata.packages_distributions())
    names = {path.stem for path in MODULES.values()} | {part for m in MODULES for part in m.split(".")[1:]}
    assert not names & installed, f"forge modules named like a package: {sorted(names & installed)}"


def test_the_page_states_the_size_rule() -> None:
    assert f"longer than {MAX_LINES} lines" in PAGE.read_text()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_longer_than_the_page_says(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module].relative_to(ROOT)}: {lines} lines (at most {MAX_LINES})"
