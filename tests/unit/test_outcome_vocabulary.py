"""Every outcome is made in `matrix/outcome.py`: elsewhere no `CellOutcome(...)`, no status or failure kind
passed as a literal keyword (`replace(o, status="error")`), and no status or failure kind compared with or
assigned to `.status`/`.failure_kind` as a literal (`row.status == "passed"`): readers use the names
(`PASSED`, ...) and the sets (`FAILED_STATUSES`, ...) of `outcome.py`. Read with `ast`, nothing imported.

A row's lifecycle states `pending` and `running` are the claims' (not outcomes), and a campaign's own status
(`running`, `finished`, `interrupted`) is another vocabulary: neither is checked here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import matrix
from matrix.outcome import FAILURE_KINDS, FINISHED_STATUSES

ROOT = Path(matrix.__file__).parent
OUTCOME_WORDS = frozenset(FINISHED_STATUSES) | frozenset(FAILURE_KINDS)
_FIELDS = ("status", "failure_kind")


def _literals(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [value for element in node.elts for value in _literals(element)]
    return []


def _is_outcome_field(node: ast.expr) -> bool:
    """`x.status`, `x.failure_kind` or a variable of that name, unless it is a campaign's."""
    if isinstance(node, ast.Attribute) and node.attr in _FIELDS:
        return "campaign" not in ast.unparse(node.value).lower()
    return isinstance(node, ast.Name) and node.id in _FIELDS


def spelled_outcomes(source: str, where: str) -> list[str]:
    """`where:line: what` for each outcome spelled outside `outcome.py` in `source`."""
    found = []

    def spelled(node: ast.expr) -> bool:
        return any(value in OUTCOME_WORDS for value in _literals(node))

    for node in ast.walk(ast.parse(source)):
        what = ""
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name == "CellOutcome":
                what = "CellOutcome(...) built outside outcome.py"
            elif any(kw.arg in _FIELDS and spelled(kw.value) for kw in node.keywords):
                what = "status/failure_kind keyword spelled as a literal"
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_outcome_field(side) for side in sides) and any(spelled(side) for side in sides):
                what = "status/failure_kind compared with a literal"
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and any(_is_outcome_field(t) for t in targets) and spelled(node.value):
                what = "status/failure_kind assigned a literal"
        if what:
            found.append(f"{where}:{getattr(node, 'lineno', 0)}: {what}: {ast.unparse(node)[:100]}")
    return found


def test_no_outcome_is_spelled_outside_outcome_py() -> None:
    found = [
        hit
        for path in sorted(ROOT.rglob("*.py"))
        if path != ROOT / "outcome.py"
        for hit in spelled_outcomes(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT.parent)))
    ]
    assert not found, "outcomes spelled outside matrix/outcome.py (use its constructors and names):\n" + "\n".join(
        found
    )


def test_the_rule_catches_each_spelling_and_leaves_the_rest() -> None:
    source = """
a = CellOutcome("failed", "startup", "x")
b = replace(o, status="error", failure_kind="config")
if row.status == "passed" or o.failure_kind in ("startup", "health"):
    row.status = "interrupted"
status: Status = "timeout"
# not outcomes: a row's lifecycle, a campaign's own status, a constant, an unrelated "failed"
ok = row.status == "pending" or campaign.status != "interrupted" or o.status == PASSED
log("failed", level="error")
"""
    lines = [hit.split(":")[1] for hit in spelled_outcomes(source, "x.py")]
    assert sorted(set(map(int, lines))) == [2, 3, 4, 5, 6]
