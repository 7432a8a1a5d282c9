"""No import circle in runtime/ or export/: read from the source with `ast`, nothing imported (no jax, no torch).

A circle between modules means neither can be read, tested or loaded without the other, and it is usually hidden by
an import moved into a function. So every import counts here, at module level or inside a function (or under
`if TYPE_CHECKING:`): an edge goes from the importing module to the module named, `from . import x` naming the
submodule x where there is one. The strongly connected components of that graph must each be one module.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "export")


def modules() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name: its __init__.py)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(module imported, line) for every import in the file of module `name` that names a module of `known`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names if alias.name in known]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    out.append((sub, node.lineno))
                elif target in known:
                    out.append((target, node.lineno))
    return out


def graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """The intra-package import graph, and the line of one import for each edge (for the failure message)."""
    found = modules()
    edges: dict[str, set[str]] = defaultdict(set)
    lines: dict[tuple[str, str], int] = {}
    for name, path in found.items():
        for target, line in imports(name, path, set(found)):
            if target != name:
                edges[name].add(target)
                lines.setdefault((name, target), line)
    for name in found:
        edges.setdefault(name, set())
    return edges, lines


def components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
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
                    out.append(sorted(component))
    return out


def cycle(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One circle through the component's first module (breadth first: a shortest one), back to where it started."""
    start, members = component[0], set(component)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [*reversed(path), start]
                if child not in came:
                    came[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def describe(component: list[str], edges: dict[str, set[str]], lines: dict[tuple[str, str], int]) -> str:
    path = cycle(component, edges)
    steps = [f"{a} -> {b} ({modules()[a].relative_to(ROOT)}:{lines[a, b]})" for a, b in zip(path, path[1:])]
    return f"{len(component)} modules in a circle ({', '.join(component)}); one: " + "; ".join(steps)


def test_no_import_circle() -> None:
    edges, lines = graph()
    circles = [c for c in components(edges) if len(c) > 1]
    assert not circles, "import circles:\n" + "\n".join(describe(c, edges, lines) for c in circles)


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The reading finds relative, absolute, `from . import module` and in-function imports, and a circle made of
    them (so the test above cannot pass by seeing nothing)."""
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    files = {"pkg/__init__.py": "",
             "pkg/sub/__init__.py": "",
             "pkg/a.py": "from .sub import b\n",
             "pkg/sub/b.py": "def f():\n    from .. import c\n",
             "pkg/c.py": "import pkg.a\nfrom pkg.sub.b import f\n",
             "pkg/d.py": "from .a import name\n"}
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    known = {"pkg", "pkg.sub", "pkg.a", "pkg.sub.b", "pkg.c", "pkg.d"}
    found = {name: tmp_path / (name.replace(".", "/") + ("/__init__.py" if name in ("pkg", "pkg.sub") else ".py"))
             for name in known}
    edges = {name: {t for t, _ in imports(name, path, known)} for name, path in found.items()}
    assert edges["pkg.a"] == {"pkg.sub.b"}
    assert edges["pkg.sub.b"] == {"pkg.c"}
    assert edges["pkg.c"] == {"pkg.a", "pkg.sub.b"}
    assert edges["pkg.d"] == {"pkg.a"}
    circles = [c for c in components(edges) if len(c) > 1]
    assert circles == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert cycle(circles[0], edges) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
