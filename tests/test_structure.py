"""The package's shape holds: no import cycle among tfserve's modules (imports inside functions included), no
module over MAX_LINES lines, and imports flow the one way docs/architecture.md draws. Read from the source with
`ast`, nothing imported, so it runs in a fraction of a second.

A cycle once hid in tfserve.models: the GGUF reader's error helper lived beside `models info`, which imports the
store, which imports the GGUF weights, which read files through it. Such a loop works until someone moves an
import to the top of a module; this test finds it the day it is written."""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

import tfserve

ROOT = Path(tfserve.__file__).parent
MAX_LINES = 400

# Owed, each to be cut and then taken off its list. A listed one already gone fails the tests, so the lists can only
# shrink. A cycle is listed as the set of modules that import one another round (a strongly connected set), a
# module as its path, e.g. {"tfserve.a", "tfserve.b"} and "tfserve/engine/engine.py".
KNOWN_CYCLES: list[set[str]] = []
KNOWN_OVERSIZED: set[str] = set()

# cli -> server | chat | bench -> serving -> engine -> protocol | models (docs/architecture.md): never upward
LAYERS = {"tfserve.cli": 4, "tfserve.server": 3, "tfserve.chat": 3, "tfserve.bench": 3, "tfserve.serving": 2,
          "tfserve.engine": 1, "tfserve.protocol": 0, "tfserve.models": 0}
NO_TORCH = ("tfserve.engine.request", "tfserve.engine.kv_cache", "tfserve.engine.scheduler")  # and what they import
NOT_IN_ENGINE = ("aiohttp", "rich", "typer")  # the engine is a library: no web server, no terminal
MAX_SERVER_TOP_MODULES = 12  # server/ stays grouped: api/, tools/, runtime/, requests/ hold the rest
# what the running server holds sits below its handlers: runtime/ (state.py aside, which assembles them) imports none
HANDLER_PACKAGES = ("tfserve.server.api", "tfserve.server.tools", "tfserve.server.requests", "tfserve.server.app",
                    "tfserve.server.run", "tfserve.server.generation", "tfserve.server.chat_prompt")
READ_STATE_BY_PROTOCOL = ("tfserve.server.runtime.metrics", "tfserve.server.runtime.residency",
                          "tfserve.server.runtime.telemetry")
BODY_READS = ("json", "text", "read", "post")  # aiohttp's ways to read a request's body: body.py's alone


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its __init__)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(tree: ast.AST, name: str, is_package: bool) -> set[str]:
    """Every dotted name imported anywhere in `tree` (function bodies and TYPE_CHECKING blocks included), relative
    imports resolved against module `name`; `from a import b` yields `a.b`, which `resolve` reads."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x: this package; from .. import x: its parent
                parts = package.split(".")
                base = ".".join([*parts[:len(parts) - node.level + 1], *([node.module] if node.module else [])])
            found.update(base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names)
    return found


def resolve(imported: str, modules: dict[str, Path]) -> str | None:
    """The package's module an imported name means: the longest dotted prefix that is a module, or None when it is
    not the package's. So `from tfserve.x import y` is module tfserve.x.y when y is one, else tfserve.x."""
    parts = imported.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (itself left out)."""
    graph = {}
    for name, path in modules.items():
        names = imported_names(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py")
        graph[name] = {module for n in names if (module := resolve(n, modules)) is not None} - {name}
    return graph


def external_imports(modules: dict[str, Path], names: set[str]) -> dict[str, set[str]]:
    """Module -> the top-level names of what it imports from outside the package, for each of `names`."""
    found = {}
    for name in names:
        path = modules[name]
        imported = imported_names(ast.parse(path.read_text()), name, path.name == "__init__.py")
        found[name] = {n.split(".")[0] for n in imported if resolve(n, modules) is None}
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The sets of two or more modules that import one another round (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

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
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def one_cycle(graph: dict[str, set[str]], within: set[str]) -> list[str]:
    """A shortest import cycle through the first module of `within` (a strongly connected set), as the modules
    along it."""
    start = min(within)
    came_from: dict[str, str | None] = {start: None}
    todo = deque([start])
    while todo:  # breadth first, so the cycle shown is a short one
        node = todo.popleft()
        for nxt in sorted(graph[node] & within):
            if nxt == start:  # back where it began: the way to `node`, then home
                path = [node]
                while (previous := came_from[path[-1]]) is not None:
                    path.append(previous)
                return [*reversed(path), start]
            if nxt not in came_from:
                came_from[nxt] = node
                todo.append(nxt)
    raise ValueError(f"{sorted(within)} holds no cycle through {start}")


def package_of(module: str) -> str:
    """tfserve.engine.backends.lean -> tfserve.engine; a top-level module is its own package."""
    return ".".join(module.split(".")[:2])


@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    return module_files()


@pytest.fixture(scope="module")
def graph(modules) -> dict[str, set[str]]:
    return import_graph(modules)


def test_the_graph_sees_every_kind_of_import(graph):
    assert "tfserve.models.gguf_weights" in graph["tfserve.models.gguf_native"]  # a top-level `from x.y import z`
    assert "tfserve.cli.root" in graph["tfserve.cli"]  # inside a function
    assert len(graph) > 100


def test_no_module_imports_another_round(graph):
    cycles = strongly_connected(graph)
    new = [" -> ".join(one_cycle(graph, c)) for c in cycles if c not in KNOWN_CYCLES]
    assert not new, "import cycles (move the shared piece down into a module both import):\n" + "\n".join(new)
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"no longer cycles (or changed): update KNOWN_CYCLES: {gone}"


def test_packages_import_one_way(graph):
    packages: dict[str, set[str]] = {}
    for module, imported in graph.items():
        packages.setdefault(package_of(module), set()).update(
            package_of(m) for m in imported if package_of(m) != package_of(module))
    cycles = [" -> ".join(one_cycle(packages, c)) for c in strongly_connected(packages)]
    assert not cycles, "packages importing one another round:\n" + "\n".join(cycles)


def test_imports_never_flow_up_the_layers(graph):
    upward = sorted(f"{module} -> {m}" for module, imported in graph.items() for m in imported
                    if LAYERS.get(package_of(m), -1) > LAYERS.get(package_of(module), 99))
    rule = "cli -> server | chat | bench -> serving -> engine -> protocol | models"
    assert not upward, f"imports against {rule}:\n" + "\n".join(upward)


def test_no_module_is_over_the_size_limit(modules):
    sizes = {str(path.relative_to(ROOT.parent)): len(path.read_text().splitlines()) for path in modules.values()}
    over = sorted(f"{name}: {num_lines} lines" for name, num_lines in sizes.items()
                  if num_lines > MAX_LINES and name not in KNOWN_OVERSIZED)
    assert not over, f"modules over {MAX_LINES} lines (split by responsibility):\n" + "\n".join(over)
    fixed = sorted(name for name in KNOWN_OVERSIZED if sizes.get(name, 0) <= MAX_LINES)
    assert not fixed, f"within the limit now (or gone): remove from KNOWN_OVERSIZED: {fixed}"


def test_the_server_stays_grouped_by_concern():
    top = sorted(path.name for path in (ROOT / "server").glob("*.py"))
    groups = {path.name for path in (ROOT / "server").iterdir() if (path / "__init__.py").is_file()}
    assert {"api", "tools", "runtime", "requests"} <= groups
    assert len(top) <= MAX_SERVER_TOP_MODULES, (
        f"{len(top)} modules directly in server/ (at most {MAX_SERVER_TOP_MODULES}): put a handler in api/, tool "
        f"calls and output constraints in tools/, what the running server holds in runtime/: {top}")


def test_runtime_imports_no_handler_and_reads_the_state_by_protocol(graph):
    runtime = [name for name in graph if name.startswith("tfserve.server.runtime.")]
    upward = sorted(f"{name} -> {m}" for name in runtime if name != "tfserve.server.runtime.state"
                    for m in graph[name] if any(m == p or m.startswith(f"{p}.") for p in HANDLER_PACKAGES))
    assert not upward, "runtime/ imports a handler's module (read it through a Protocol):\n" + "\n".join(upward)
    found = sorted(name for name in READ_STATE_BY_PROTOCOL if "tfserve.server.runtime.state" in graph[name])
    assert not found, f"{found} import state.py: read the state through a Protocol of what they use"


def test_only_body_py_reads_a_request_body(modules):
    """A handler's body is read once, by server/body.py (`read_json`: encodings, strict JSON, 4xx for anything
    odd), then parsed into a typed request: no `await request.json()` of its own."""
    server = {name: path for name, path in modules.items() if name.startswith("tfserve.server.")}
    found = sorted(f"{name}:{node.lineno}: request.{node.func.attr}()" for name, path in server.items()
                   if name != "tfserve.server.body" for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and node.func.attr in BODY_READS and isinstance(node.func.value, ast.Name)
                   and node.func.value.id == "request")
    assert not found, "read the body with server/body.py's read_json, then a typed request:\n" + "\n".join(found)


def test_the_engine_imports_no_web_server_or_terminal_library(modules):
    engine = {name for name in modules if name == "tfserve.engine" or name.startswith("tfserve.engine.")}
    found = sorted(f"{name}: {sorted(used & set(NOT_IN_ENGINE))}"
                   for name, used in external_imports(modules, engine).items() if used & set(NOT_IN_ENGINE))
    assert not found, "\n".join(found)


def test_request_block_pool_and_scheduler_never_import_torch(modules, graph):
    reached, todo = set(), list(NO_TORCH)
    while todo:  # what they import, anywhere in a body, runs with them
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(graph[name] - {"tfserve"})  # the package's __init__ imports the engine only when asked
    found = sorted(name for name, used in external_imports(modules, reached).items() if "torch" in used)
    assert reached > set(NO_TORCH)  # their own imports were followed
    assert not found, f"torch imported by {found}, which {NO_TORCH} import"


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert strongly_connected(graph) == [{"a", "b", "c"}]
    assert one_cycle(graph, {"a", "b", "c"}) == ["a", "b", "c", "a"]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_imports_are_resolved_as_python_resolves_them(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__", "a", "b", "sub/__init__", "sub/c", "sub/d"):
        (package / f"{name}.py").write_text("")
    (package / "a.py").write_text("from pkg import b\nfrom pkg.sub import helper\n")
    (package / "sub" / "c.py").write_text("def f():\n    from . import d\n    from ..a import x\n")
    (package / "sub" / "__init__.py").write_text("from .c import f\nimport os.path\n")
    graph = import_graph(module_files(package))
    assert graph["pkg.a"] == {"pkg.b", "pkg.sub"}  # helper is no module: the package it is read from
    assert graph["pkg.sub.c"] == {"pkg.sub.d", "pkg.a"}  # inside a function, relative
    assert graph["pkg.sub"] == {"pkg.sub.c"}


def test_test_modules_have_names_of_their_own():
    """The test folders are not packages (pytest imports each test module by its file name), so two test files of
    one name in different folders stop the whole run at collection: `tests/engine/test_client.py` once did."""
    names = [path.name for path in Path(__file__).parent.rglob("test_*.py")]
    assert sorted({name for name in names if names.count(name) > 1}) == []
