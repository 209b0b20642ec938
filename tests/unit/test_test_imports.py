"""Test modules import shared code from `tests.helpers`, never from another test module or a conftest.

A test module that imports another one runs the other's module-level code, collects nothing new and breaks
when the other file is moved or renamed; a conftest imported by name is loaded a second time under another
module name. Fixtures belong in the conftest.py of the directory whose tests use them.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.cli import REPO

TESTS = REPO / "tests"


def _is_test_module(name: str) -> bool:
    """A module pytest collects or loads as a conftest: `test_*.py`, or `conftest.py`."""
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def imports_of_test_modules(path: Path, root: Path = REPO) -> list[str]:
    """`file:line module` for each import in `path` of a test module (names imported from a package count
    as modules: `from tests.unit import test_x`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.ImportFrom):  # relative: `from .test_x import y`, `from . import test_x`
            modules = [node.module or "", *(alias.name for alias in node.names)]
        else:
            continue
        bad = [m for m in modules if m and _is_test_module(m) and (m.startswith("tests.") or node.level > 0)]
        found += [f"{path.relative_to(root)}:{node.lineno} {m}" for m in bad]
    return found


def test_no_test_module_imports_another_test_module() -> None:
    offenders = [hit for path in sorted(TESTS.rglob("*.py")) for hit in imports_of_test_modules(path)]
    assert offenders == [], "move what these share into tests/helpers/ (fixtures into a conftest.py):\n" + "\n".join(
        offenders
    )


def test_the_check_sees_each_form_of_import(tmp_path: Path) -> None:
    """The guard itself: each way of importing a test module is found, helpers and third parties are not."""
    planted = tmp_path / "test_planted.py"
    planted.write_text(
        "import tests.e2e.test_run_reference\n"
        "from tests.unit.test_catalog import x\n"
        "from tests.unit import test_arms\n"
        "from tests.conftest import Matrix\n"
        "from .test_sibling import y\n"
        "from tests.helpers.cli import Matrix\n"
        "import pytest\n"
        "from test_utils import z\n"
    )
    hits = [hit.split(" ", 1)[1] for hit in imports_of_test_modules(planted, root=tmp_path)]
    assert hits == ["tests.e2e.test_run_reference", "tests.unit.test_catalog", "tests.unit.test_arms",
                    "tests.conftest", "test_sibling"]  # fmt: skip

