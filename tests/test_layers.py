"""The import contract of anonproxy (issue 18): who may import whom, read from the source with ``ast``.

The packages and top-level modules of ``anonproxy`` form layers, top to bottom (``|``: independent units, none
imports another):

    cli, __main__, views, console, trail, demo, embedded   the commands (they may import each other)
    proxy                                                  the wire-protocol server
    route                                                  the router: decide() and its decisions
    dp | suppress                                          the back-ends
    plan                                                   the mode-neutral front end
    wire | policy | catalog_check                          the protocol, the policy, a catalog check
    config | logs | login | schema | sample_data | data    modules that import nothing of anonproxy (nor does
                                                           anonproxy/__init__.py)

A module imports modules of its own unit or of a layer below its own. Besides, nothing in proxy imports suppress:
the gate sees one mode-neutral notice/explain hook, never a mode's module (the dp runtime is driven by proxy, so
proxy -> dp stays allowed). Every import counts, at module level or inside a function. Inside each package, no
import cycle between its modules.

The first tests check the checker itself on small made-up packages; the last ones check anonproxy.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent.parent / "anonproxy"


@dataclass(frozen=True)
class Layer:
    units: frozenset[str]
    independent: bool


def _layer(*units: str, independent: bool = False) -> Layer:
    return Layer(frozenset(units), independent)


# Top to bottom.
LAYERS = (
    _layer("cli", "__main__", "views", "console", "trail", "demo", "embedded"),
    _layer("proxy"),
    _layer("route"),
    _layer("dp", "suppress", independent=True),
    _layer("plan"),
    _layer("wire", "policy", "catalog_check", independent=True),
    # anonproxy: the package's own __init__, which every import of a module of it runs
    _layer("config", "logs", "login", "schema", "sample_data", "data", "anonproxy", independent=True),
)

# Arrows the layers allow that the design still forbids: (importing unit, imported unit) -> why.
FORBIDDEN: dict[tuple[str, str], str] = {
    ("proxy", "suppress"): "the gate sees one mode-neutral notice/explain hook, never a mode's module",
}

# Today's wrong-way imports that other parts of issue 18 remove: (importing module, imported module) -> who removes
# it. The list only shrinks: test_allowed_imports_still_exist fails once an import is gone, and its entry is then
# deleted here; empty, the dictionary stays.
ALLOWED: dict[tuple[str, str], str] = {
}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    imported: str  # dotted module name (a package's name for its __init__)
    where: str  # path:line


def modules(root: Path) -> dict[str, Path]:
    """The modules of the package at ``root``, by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(root: Path) -> list[Import]:
    """Every import of a module of the package at ``root`` by one of its modules, resolved to the module imported."""
    known = modules(root)
    found = []
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        where = path.relative_to(root.parent)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in dict.fromkeys(_targets(node, package, known)):
                if target == root.name or target.startswith(root.name + "."):
                    found.append(Import(name, target, f"{where}:{node.lineno}"))
    return found


def _targets(node: ast.Import | ast.ImportFrom, package: str, known: dict[str, Path]) -> Iterator[str]:
    """The modules an import statement names: ``from m import x`` imports module ``m.x`` when there is one, else m."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    else:
        base = node.module or ""
        if node.level:
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            yield sub if sub in known else base


def unit(module: str) -> str:
    """The layered unit of a module: its top-level package or module under anonproxy."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_of(name: str) -> int:
    return next(index for index, layer in enumerate(LAYERS) if name in layer.units)


def wrong_way(found: list[Import]) -> list[str]:
    """The imports the layers or FORBIDDEN forbid, as readable lines."""
    wrong = []
    for imp in found:
        source, target = unit(imp.importer), unit(imp.imported)
        if source == target:
            continue
        why = _why_not(source, target)
        if why:
            wrong.append(f"{imp.where}: {imp.importer} imports {imp.imported}: {why}")
    return wrong


def _why_not(source: str, target: str) -> str | None:
    if (source, target) in FORBIDDEN:
        return FORBIDDEN[source, target]
    above, below = layer_of(source), layer_of(target)
    if below < above:
        return f"{target} is in a layer above {source}"
    if below == above and LAYERS[above].independent:
        return f"{source} and {target} are independent"
    return None


def cycles(found: list[Import], known: dict[str, Path]) -> list[list[str]]:
    """Import cycles between the modules of one package (Tarjan's strongly connected components)."""

    def package(module: str) -> str:
        return module if known[module].name == "__init__.py" else module.rpartition(".")[0]

    edges: dict[str, set[str]] = {name: set() for name in known}
    for imp in found:
        if imp.imported in known and package(imp.imported) == package(imp.importer):
            edges[imp.importer].add(imp.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in sorted(edges[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component: list[str] = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1 or node in edges[node]:
                components.append(sorted(component))

    for name in sorted(known):
        if name not in index:
            visit(name)
    return components


def _package(root: Path, files: dict[str, str]) -> Path:
    """A made-up package named anonproxy under ``root``: {relative path: source}."""
    top = root / "anonproxy"
    for relative, text in {"__init__.py": "", **files}.items():
        path = top / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return top


def test_the_checker_sees_every_spelling_of_a_wrong_way_import(tmp_path: Path) -> None:
    top = _package(
        tmp_path,
        {
            "plan/__init__.py": "",
            "plan/a.py": "from ..route import decide\n",
            "plan/b.py": "def f():\n    import anonproxy.dp.model\n",
            "plan/c.py": "from anonproxy.suppress.rewrite import rewrite\n",
            "route/__init__.py": "",
            "route/decide.py": "from anonproxy.plan import a\n",
            "dp/__init__.py": "",
            "dp/model.py": "from anonproxy import suppress\n",
            "suppress/__init__.py": "",
            "suppress/rewrite.py": "from ..plan.a import x\n",
            "proxy/gate.py": "from ..suppress import rewrite\nfrom ..dp import model\n",
        },
    )
    assert sorted(wrong_way(imports(top))) == [
        "anonproxy/dp/model.py:1: anonproxy.dp.model imports anonproxy.suppress: dp and suppress are independent",
        "anonproxy/plan/a.py:1: anonproxy.plan.a imports anonproxy.route.decide: route is in a layer above plan",
        "anonproxy/plan/b.py:2: anonproxy.plan.b imports anonproxy.dp.model: dp is in a layer above plan",
        "anonproxy/plan/c.py:1: anonproxy.plan.c imports anonproxy.suppress.rewrite: suppress is in a layer above plan",
        "anonproxy/proxy/gate.py:1: anonproxy.proxy.gate imports anonproxy.suppress.rewrite: "
        + FORBIDDEN["proxy", "suppress"],
    ]


def test_the_checker_finds_a_cycle_inside_a_package_only(tmp_path: Path) -> None:
    top = _package(
        tmp_path,
        {
            "plan/__init__.py": "from . import a\n",
            "plan/a.py": "from . import b\n",
            "plan/b.py": "from anonproxy.plan.c import x\n",
            "plan/c.py": "def f():\n    from .a import y\n",
            "plan/d.py": "from . import d\n",
            "plan/e.py": "from anonproxy.dp import x\n",  # across packages: the layers' business
            "dp/__init__.py": "",
            "dp/x.py": "from ..plan import e\n",
        },
    )
    assert cycles(imports(top), modules(top)) == [
        ["anonproxy.plan.a", "anonproxy.plan.b", "anonproxy.plan.c"],
        ["anonproxy.plan.d"],
    ]


def test_every_module_is_in_a_layer() -> None:
    units = {unit(name) for name in modules(SOURCE)}
    placed = set().union(*(layer.units for layer in LAYERS))
    assert units - placed == set(), "place each new package or top-level module in LAYERS"


@pytest.fixture(scope="module")
def anonproxy_imports() -> list[Import]:
    return imports(SOURCE)


def test_imports_go_down_the_layers(anonproxy_imports: list[Import]) -> None:
    found = [imp for imp in anonproxy_imports if (imp.importer, imp.imported) not in ALLOWED]
    assert wrong_way(found) == []


def test_allowed_imports_still_exist(anonproxy_imports: list[Import]) -> None:
    """An allowed wrong-way import that is gone leaves ALLOWED, so that the allowance only shrinks."""
    present = {(imp.importer, imp.imported) for imp in anonproxy_imports}
    assert [arrow for arrow in ALLOWED if arrow not in present] == [], "remove these from ALLOWED"


def test_no_import_cycle_inside_a_package(anonproxy_imports: list[Import]) -> None:
    assert cycles(anonproxy_imports, modules(SOURCE)) == []
