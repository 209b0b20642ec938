"""No module of `matrix` uses another module's private (`_x`) names (read from the source with `ast`).

A name with a leading underscore is its module's own business: a second module that needs it needs a public
name (the runner's steps that the shared-engine grid calls are `matrix.runner`'s public API for that reason).
Counted: `from matrix.m import _x` (also relative and inside functions) and `m._x` where `m` names a module
of the package (`import matrix.m as m`, `from matrix import m`). Dunders (`__version__`) are not private.
"""

from __future__ import annotations

import ast
from pathlib import Path

import matrix

ROOT = Path(matrix.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The dotted module an ImportFrom names, relative ones resolved against `module`."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def private_uses(root: Path) -> list[str]:
    """`file:line: module uses other._x` for every use of another module's private name under `root`."""
    modules = _modules(root)
    package = root.name
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases: dict[str, str] = {}  # local name -> the package's module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        aliases[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, path, node)
                if source != package and not source.startswith(package + "."):
                    continue
                for alias in node.names:
                    if _private(alias.name) and source != module:
                        found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {module} imports "
                                     f"{source}.{alias.name}")  # fmt: skip
                    elif f"{source}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr)
                    and aliases.get(node.value.id, module) != module):  # fmt: skip
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {module} uses "
                             f"{aliases[node.value.id]}.{node.attr}")  # fmt: skip
    return found


def test_no_module_of_matrix_uses_another_modules_private_names() -> None:
    found = private_uses(ROOT)
    assert not found, "private names used across modules (make them public):\n" + "\n".join(found)


def test_the_checker_finds_each_kind_of_private_use_in_a_planted_tree(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '1'\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("_hidden = 1\nshown = 2\n\n\ndef f() -> int:\n    return _hidden\n")
    (pkg / "clean.py").write_text("from pkg import __version__\nfrom pkg.a import shown\nimport os\nos._exit\n")
    assert private_uses(tmp_path / "pkg") == []
    (pkg / "b.py").write_text("def g():\n    from pkg.a import _hidden\n    return _hidden\n")
    (pkg / "sub" / "c.py").write_text("from ..a import _hidden\n")
    (pkg / "d.py").write_text("from pkg import a\nimport pkg.a as alias\nx = a._hidden + alias._hidden\n")
    found = private_uses(tmp_path / "pkg")
    assert found == [
        "pkg/b.py:2: pkg.b imports pkg.a._hidden",
        "pkg/d.py:3: pkg.d uses pkg.a._hidden",
        "pkg/d.py:3: pkg.d uses pkg.a._hidden",
        "pkg/sub/c.py:1: pkg.sub.c imports pkg.a._hidden",
    ], found
