"""`tests/unit` stays fast and process-free: a test that starts a process (a `matrix` CLI, a helper
interpreter, a server) belongs in `tests/e2e/`. Read from the source with `ast`; nothing is run."""

from __future__ import annotations

import ast
from pathlib import Path

UNIT = Path(__file__).parent
# Calls that start a process: subprocess's, os's spawn/exec family, and the test helpers that wrap them.
STARTERS = {"Popen", "run", "call", "check_call", "check_output", "spawnv", "spawnvp", "execv", "execvp", "fork"}
MODULES = {"subprocess", "os"}
HELPERS = {"subprocess", "popen"}  # `Matrix.subprocess(...)`, `Matrix.popen(...)` in tests/conftest.py


def starts_a_process(call: ast.Call) -> bool:
    func = call.func
    if not isinstance(func, ast.Attribute):
        return False
    if isinstance(func.value, ast.Name) and func.value.id in MODULES:
        return func.attr in STARTERS
    return func.attr in HELPERS


def test_no_unit_test_starts_a_process() -> None:
    found = [
        f"{path.name}:{node.lineno}"
        for path in sorted(UNIT.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call) and starts_a_process(node)
    ]
    assert found == [], f"move these tests to tests/e2e/: {found}"


def test_the_check_sees_each_way_of_starting_one() -> None:
    calls = ["subprocess.run(['x'])", "subprocess.Popen(['x'])", "os.fork()", "m.subprocess('run')", "m.popen('x')"]
    assert all(starts_a_process(ast.parse(code, mode="eval").body) for code in calls)  # type: ignore[arg-type]
    assert not starts_a_process(ast.parse("runner.run()", mode="eval").body)  # type: ignore[arg-type]
