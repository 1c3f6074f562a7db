"""The import graph of qvpic's modules, read from the sources (ast), nothing imported.

Every `import` counts — lazy ones inside functions too — except those under `if TYPE_CHECKING:` (types
only, never run). A name imported from a package facade (`from pipeline.store import Store`) is resolved
through the facade's table (pipeline/facade.py) to the module that defines it, since that is what runs
when the name is first used.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import REPO

PACKAGES = ("schemas", "pipeline", "serve", "jobs", "benchmarks")


def parse(path: Path) -> ast.Module:
    """`ast.parse`, again on CPython 3.11's spurious "AST constructor recursion depth mismatch": its depth
    counter is shared by the interpreter's threads, so another thread compiling at that moment (a library's
    worker thread left by an earlier test) can trip it. The source is the same; a second parse succeeds."""
    for attempt in range(3):
        try:
            return ast.parse(path.read_text(encoding="utf-8"), str(path))
        except SystemError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def facade_table(tree: ast.Module, package: str) -> dict[str, str]:
    """name -> defining module of a facade `lazy_exports(__name__, {module: [names]})`, else empty."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports"
                and len(node.args) == 2 and isinstance(node.args[1], ast.Dict)):
            table = ast.literal_eval(node.args[1])
            return {name: f"{package}.{module}" for module, names in table.items() for name in names}
    return {}


def type_checking_nodes(tree: ast.Module) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def import_graph(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (a module importing its own package's `__init__` excluded)."""
    files = {module_name(root, p): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    trees = {m: parse(p) for m, p in files.items()}
    facades = {m: facade_table(t, m) for m, t in trees.items() if files[m].name == "__init__.py"}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, tree in trees.items():
        skip = type_checking_nodes(tree)
        is_package = files[module].name == "__init__.py"
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(facades.get(base, {}).get(alias.name) or (full if full in files else base))
            for target in targets:
                found = resolve(target)
                if found and found != module and not module.startswith(found + "."):
                    graph[module].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def write(root: Path, files: dict[str, str]) -> None:
    """A tree of source files under `root` (the negative controls' planted packages)."""
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
