"""The modules of tfserve.models import one another one way: no cycle, imports inside functions included (the
GGUF modules once formed one: the reader's error helper lived beside `models info`, which imports the store,
which imports the GGUF weights, which read files through it)."""

import ast
from pathlib import Path

import tfserve.models

PACKAGE = "tfserve.models"


def _imports(path: Path) -> set[str]:
    """The tfserve.models modules `path` imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PACKAGE:  # from tfserve.models import store
                found.update(f"{PACKAGE}.{alias.name}" for alias in node.names)
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith(PACKAGE + "."))
    return found


def _graph() -> dict[str, set[str]]:
    folder = Path(tfserve.models.__file__).parent
    modules = {f"{PACKAGE}.{path.stem}": path for path in folder.glob("*.py") if path.stem != "__init__"}
    return {name: _imports(path) & modules.keys() - {name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_models_modules_import_one_way():
    graph = _graph()
    assert f"{PACKAGE}.gguf_native" in graph and f"{PACKAGE}.gguf_weights" in graph[f"{PACKAGE}.gguf_native"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
