"""No import cycle between the packages of `matrix`, and no stage reaching what it may not import (read from
the source with `ast`, nothing imported).

A unit is a subpackage (`matrix.schedule`) or a top-level module (`matrix.results`); every import counts,
also those inside functions or under TYPE_CHECKING, since a lazy import is still a dependency. No two
modules anywhere in `matrix` form a cycle either (`module_cycles`: a package's `__init__`, which Python runs
before any of its submodules, is set aside as that implicit step and counts only where it is imported by
name), and inside `matrix.cli` the `app` module imports no command module. The stage rules hold for what a
stage reaches through other modules too (the transitive closure of the module graph, with the `__init__`
of every package an import runs), and they are the table of `docs/architecture.md`, which a test reads.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import deque
from collections.abc import Callable
from pathlib import Path

import matrix

ROOT = Path(matrix.__file__).parent


def _unit(dotted: str, package: str) -> str:
    parts = dotted.split(".")
    if len(parts) == 1:
        return package
    return parts[1]


@functools.cache  # parsed once per session: three tests walk the same package
def import_graph(root: Path, unit: Callable[[str, str], str] = _unit) -> dict[str, dict[str, set[str]]]:
    """unit -> {unit it imports: the modules that import it} (the caller must not change it)."""
    package = root.name
    graph: dict[str, dict[str, set[str]]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        source = unit(module, package)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            else:
                continue
            for target in targets:
                if target.startswith(package + "."):
                    imported = unit(target, package)
                    if imported != source:
                        graph.setdefault(source, {}).setdefault(imported, set()).add(module)
    return graph


def find_cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Strongly connected components of more than one unit (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _describe(graph: dict[str, dict[str, set[str]]], cycle: list[str]) -> str:
    edges = [
        f"  {a} -> {b} (from {', '.join(sorted(graph[a][b]))})" for a in cycle for b in cycle if b in graph.get(a, {})
    ]
    return " <-> ".join(cycle) + "\n" + "\n".join(edges)


def test_no_cycle_between_packages_of_matrix() -> None:
    graph = import_graph(ROOT)
    # The walk saw the packages and the direction the interfaces fix: users own them, implementers import.
    assert "check" in graph["launch"] and "schedule" in graph["executors"]
    assert "launch" not in graph.get("check", {}) and "executors" not in graph["schedule"]
    cycles = find_cycles(graph)
    assert not cycles, "import cycles between packages:\n" + "\n".join(_describe(graph, c) for c in cycles)


def _module(dotted: str, package: str) -> str:
    return dotted


def test_no_cycle_between_the_modules_of_the_cli() -> None:
    """`app` (the group and shared options) imports no command module; command modules may use one another's
    helpers without a cycle; only the package `__init__` assembles them."""
    modules = import_graph(ROOT, _module)  # module by module
    cli = {m for m in modules if m.startswith("matrix.cli")}
    graph = {m: {t: s for t, s in modules.get(m, {}).items() if t in cli} for m in cli}
    assert {"matrix.cli.app", "matrix.cli.run", "matrix.cli.runtime"} <= set(graph)  # the walk saw the package
    assert not graph["matrix.cli.app"], f"matrix.cli.app imports command modules: {graph['matrix.cli.app']}"
    users_of_init = sorted(m for m, targets in graph.items() if "matrix.cli" in targets)
    assert not users_of_init, f"command modules import the package that registers them: {users_of_init}"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles inside matrix.cli:\n" + "\n".join(_describe(graph, c) for c in cycles)


def test_the_walk_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    for sub in ("a", "b", "c"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from pkg.b.y import f\n")
    (pkg / "b" / "y.py").write_text("def f():\n    import pkg.a.x\n")
    (pkg / "c" / "z.py").write_text("from pkg.a import x\n")  # depends on the cycle, is not in it
    graph = import_graph(pkg)
    assert find_cycles(graph) == [["a", "b"]]
    assert graph["b"]["a"] == {"pkg.b.y"}


# What each stage may not import (docs/architecture.md, "Stages"): unit -> units it must never import.
DOC = ROOT.parent / "docs" / "architecture.md"


def _names(cell: str) -> set[str]:
    return set(re.findall(r"`([\w.]+)`", cell))


@functools.cache
def doc_rules() -> tuple[dict[str, set[str]], dict[str, set[str]], frozenset[str], frozenset[str], dict[str, str]]:
    """(may not reach, may not import directly, leaves, shared modules, unit -> its modules) from the
    "Import rules" section of docs/architecture.md: the doc is the rule, so the two cannot drift apart."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Import rules (checked)") :]
    section = section[: section.index("\n## ", 1)]
    forbidden, modules = {}, {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 4:
            (unit,) = _names(cells[0])
            forbidden[unit], modules[unit] = _names(cells[3]), cells[2].strip("`")
    direct = re.search(r"\*\*Direct only\*\*: `(\w+)` may not import (.+?) itself", section, re.S)
    leaves = re.search(r"\*\*Leaves\*\*: (.+?)\.", section, re.S)
    shared = re.search(r"\*\*Shared\*\*: (.+?)\. ", section, re.S)
    assert forbidden and direct and leaves and shared, "docs/architecture.md lost its import rules"
    return (
        forbidden,
        {direct.group(1): _names(direct.group(2))},
        frozenset(_names(leaves.group(1))),
        frozenset(_names(shared.group(1))),
        modules,
    )


# What each stage may not reach (docs/architecture.md, "Import rules"): unit -> units it must never import,
# directly or through another module.
FORBIDDEN, FORBIDDEN_DIRECT, LEAVES, SHARED, MODULES = doc_rules()


def doc_top() -> frozenset[str]:
    """The units above the stages (the "**Top**" list): the commands and what only they use."""
    text = DOC.read_text(encoding="utf-8")
    top = re.search(r"\*\*Top\*\*: (.+?)\. ", text[text.index("## Import rules (checked)") :], re.S)
    assert top, "docs/architecture.md lost its list of top units"
    return frozenset(_names(top.group(1)))


TOP = doc_top()
# What each unit of the table may not reach: its row, and every top unit (nothing below a command imports it).
REACH_RULES = {unit: banned | TOP for unit, banned in FORBIDDEN.items()}


@functools.cache  # parsed once per session: several tests walk the same package
def named_modules(root: Path) -> dict[str, dict[str, set[str]]]:
    return read_named_modules(root)


def read_named_modules(root: Path) -> dict[str, dict[str, set[str]]]:
    """module -> {module it names in an import (`from a.b import c` is `a.b.c` when `c` is a module, else
    `a.b`): the lines naming it}, every import of the file (inside functions and under TYPE_CHECKING too)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, dict[str, set[str]]] = {}
    for module, path in modules.items():
        graph[module] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                ]
            else:
                continue
            for name in names:
                while name not in modules and "." in name:  # `import a.b.C`-like spellings: the module holding it
                    name = name.rsplit(".", 1)[0]
                if name in modules and name != module:
                    graph[module].setdefault(name, set()).add(f"{module}:{node.lineno}")
    return graph


@functools.cache  # parsed once per session: several tests walk the same package
def module_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules importing it runs: each named module (`from a.b import c` is `a.b.c` when `c`
    is a module, and `a.b` too), and the `__init__` of every package above it."""
    named = named_modules(root)

    def with_parents(name: str) -> set[str]:
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(named)

    graph: dict[str, set[str]] = {}
    for module, targets in named.items():
        reached: set[str] = set()
        for target in targets:
            reached |= with_parents(target)
        graph[module] = reached - {module}
    return graph


def module_cycles(root: Path) -> list[list[str]]:
    """Import cycles between modules. An edge is an import a module writes; the `__init__` of a package
    above the imported module, which Python runs first, is no edge of its own: that is the package's face
    (`venv/__init__.py` re-exporting `venv.build`), and counting it would put every submodule of a package
    that re-exports its submodules into a cycle with it. A face still counts where it is imported by name:
    a module outside `venv` importing `matrix...venv` depends on everything that `__init__` imports."""
    return find_cycles(read_named_modules(root))


def unit_of(module: str) -> str:
    return _unit(module, module.split(".")[0])


def reach_violations(
    graph: dict[str, set[str]],
    forbidden: dict[str, set[str]],
    unit: Callable[[str], str] = unit_of,
    shared: frozenset[str] = frozenset(),
) -> list[str]:
    """For each stage and each unit it may not import: the shortest chain of imports by which a module of
    the stage reaches a module of that unit (breadth-first from all the stage's modules at once)."""
    broken = []
    for stage, banned in sorted(forbidden.items()):
        starts = sorted(m for m in graph if unit(m) == stage)
        parent: dict[str, str | None] = dict.fromkeys(starts)
        queue = deque(starts)
        found: dict[str, str] = {}
        while queue:
            module = queue.popleft()
            for target in sorted(graph[module]):
                if target in parent or target in shared:
                    continue
                parent[target] = module
                if unit(target) in banned:
                    found.setdefault(unit(target), target)
                    continue  # the chain ends at the first forbidden module
                queue.append(target)
        for banned_unit, target in sorted(found.items()):
            chain = [target]
            while (up := parent[chain[-1]]) is not None:
                chain.append(up)
            broken.append(f"{stage} -> {banned_unit}: {' -> '.join(reversed(chain))}")
    return broken


def test_no_stage_imports_what_the_architecture_forbids() -> None:
    graph = import_graph(ROOT)
    assert set(FORBIDDEN) <= {unit_of(m) for m in module_graph(ROOT)}  # every named stage exists
    rules = {unit: REACH_RULES[unit] | FORBIDDEN_DIRECT.get(unit, set()) for unit in FORBIDDEN}
    broken = [
        f"{unit} -> {target} (from {', '.join(sorted(graph[unit][target]))})"
        for unit, targets in rules.items()
        for target in sorted(targets & set(graph.get(unit, {})))
    ]
    assert not broken, "imports docs/architecture.md forbids:\n" + "\n".join(broken)


def test_no_stage_reaches_what_it_may_not_import_through_another_module() -> None:
    graph = module_graph(ROOT)
    # The walk saw the parents an import runs: the arm registry runs with any arm's module.
    assert "matrix.launch.arms" in graph["matrix.runner.attempt"] and "matrix.launch" in graph["matrix.catalog.load"]
    broken = reach_violations(graph, REACH_RULES, shared=SHARED)
    assert not broken, "stages reaching what docs/architecture.md forbids:\n" + "\n".join(broken)


def test_no_cycle_between_the_modules_of_matrix() -> None:
    """Any stage, any depth: a module never imports (even lazily) a module that imports it back."""
    named = named_modules(ROOT)
    # The walk saw the venv package's face and the variant build inside it, which its provisioning calls.
    assert "matrix.launch.providers.venv.provisioning" in named["matrix.launch.providers.venv"]
    assert "matrix.launch.providers.venv.variant" in named["matrix.launch.providers.venv.provisioning"]
    cycles = module_cycles(ROOT)
    assert not cycles, "import cycles between modules:\n" + "\n".join(_describe(named, c) for c in cycles)


def test_the_module_walk_finds_a_planted_cycle_through_a_package_face(tmp_path: Path) -> None:
    """The shape of the circle `variant.py` once made: a module importing a package's face, whose
    `__init__` re-exports a submodule that imports the module back inside a function."""
    pkg = tmp_path / "pkg"
    (pkg / "venv").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "venv" / "__init__.py").write_text("from pkg.venv.build import Builder\nfrom pkg.venv.prov import go\n")
    (pkg / "venv" / "build.py").write_text("from pkg import errors\nclass Builder: ...\n")
    (pkg / "errors.py").write_text("")
    (pkg / "venv" / "prov.py").write_text("from pkg.venv.build import Builder\ndef go():\n    pass\n")
    (pkg / "variant.py").write_text("from pkg.venv import Builder\n")
    # A package re-exporting its submodules, which run its `__init__` first, is no cycle (the face aside).
    assert module_cycles(pkg) == []
    (pkg / "venv" / "prov.py").write_text("def go():\n    from pkg.variant import x\n")
    assert module_cycles(pkg) == [["pkg.variant", "pkg.venv", "pkg.venv.prov"]]
    # Under TYPE_CHECKING counts too, and so does a submodule importing its own package's face by name.
    (pkg / "venv" / "prov.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.venv\n")
    assert module_cycles(pkg) == [["pkg.venv", "pkg.venv.prov"]]


def test_the_closure_finds_a_forbidden_unit_two_modules_away(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    for sub in ("a", "b", "c"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from pkg.b import y\n")  # a may import b ...
    (pkg / "b" / "y.py").write_text("def f():\n    from pkg.c.z import g\n")  # ... but b reaches c
    (pkg / "c" / "z.py").write_text("def g():\n    pass\n")
    graph = module_graph(pkg)
    assert reach_violations(graph, {"a": {"c"}}) == ["a -> c: pkg.a.x -> pkg.b.y -> pkg.c"]
    assert reach_violations(graph, {"a": {"b"}}) == ["a -> b: pkg.a.x -> pkg.b"]
    assert reach_violations(graph, {"b": {"a"}}) == []


def test_leaves_and_shared_modules_import_only_leaves() -> None:
    graph = module_graph(ROOT)
    allowed = {"matrix"} | {f"matrix.{leaf}" for leaf in LEAVES}
    reached = {m: graph[m] - allowed for m in sorted(allowed - {"matrix"})}
    reached |= {m: graph[m] - {"matrix", "matrix.check"} for m in SHARED}
    assert not {m: t for m, t in reached.items() if t}, f"a leaf or shared module imports more: {reached}"


def test_every_unit_of_matrix_has_its_rules() -> None:
    """0 upward imports needs a rule for every unit: each is a row of the table, a leaf or top, and one only
    (a module added without a place in the table fails here until the doc gives it one)."""
    units = {unit_of(m) for m in module_graph(ROOT)} - {"matrix"}  # the package's own `__init__`
    placed = [set(FORBIDDEN), set(LEAVES), set(TOP)]
    unplaced = sorted(units - set().union(*placed))
    assert not unplaced, f"units with no row, not a leaf nor top in docs/architecture.md: {unplaced}"
    twice = sorted(u for u in units if sum(u in group for group in placed) > 1)
    assert not twice, f"units placed twice in docs/architecture.md: {twice}"
    assert units >= TOP, f"top units that do not exist: {sorted(TOP - units)}"


def test_the_doc_lists_every_rule_unit_with_its_modules_and_the_walk_sees_them() -> None:
    graph = module_graph(ROOT)
    units = {unit_of(m) for m in graph}
    assert set(FORBIDDEN) <= units and set(FORBIDDEN_DIRECT) <= set(FORBIDDEN) and units >= LEAVES
    for banned in FORBIDDEN.values():
        assert banned <= units, f"docs/architecture.md forbids units that do not exist: {sorted(banned - units)}"
    for unit, where in MODULES.items():
        path = ROOT.parent / where
        assert path.exists() and (path.is_dir() == (where.endswith("/"))), f"{unit}: {where} is not its module"
        assert path.stem == unit, f"the row of {unit} names {where}"
    assert set(graph) >= SHARED
