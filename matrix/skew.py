"""Version-skew cells: a case whose prefill and decode (and, on a Dynamo arm, frontend) run different runtimes.

Operators upgrade a disaggregated deployment one pool at a time, so a prefill worker of version A hands KV to a
decode worker of version B for hours. `expand_skew` turns the diagonal cells a plan selected into every ordered
pair of their runtimes (N x N, the diagonal included); `pair_cell` makes the one pair that
`--prefill-runtime`/`--decode-runtime` name. Pure: no database, no processes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from matrix.cells import ROLES, CaseInfo, Cell, RuntimeInfo

# The arms whose frontend is an engine process of its own (and so can run another version than the workers).
FRONTEND_ARMS = frozenset({"dynamo"})


@dataclass(frozen=True)
class SkewAsk:
    """What the command line asked of the skew: a grid (`--skew`, `--skew-frontend`) or one named pair."""

    grid: bool = False
    frontend: bool = False
    prefill: str | None = None
    decode: str | None = None

    @property
    def asked(self) -> bool:
        return self.grid or self.prefill is not None


def shared_process(case: CaseInfo) -> str | None:
    """Why `case` runs its prefill and decode in one process (so the two cannot run different runtimes), or None.

    Decided from the case's launch table, at plan time: building both environments first and only then
    finding one process for two roles (`matrix.launch.roles.skew_role`) wastes the builds and ends in an error.
    """
    if getattr(case.launch, "aggregated", None):
        return "its prefill and decode are one aggregated worker process (launch.aggregated), so they cannot " \
            "run different runtimes"
    if getattr(case.launch, "script", None):
        return "its launch script starts prefill and decode as one process (launch.script), so they cannot run " \
            "different runtimes"
    return None


def roles_for(case: CaseInfo, frontend: bool) -> tuple[str, ...]:
    """The roles a skew of `case` varies: prefill and decode, and the frontend of a Dynamo arm when asked."""
    return ROLES if frontend and case.arm in FRONTEND_ARMS else ROLES[1:]


def skew_cell(diagonal: Sequence[Cell], by_role: dict[str, Cell]) -> Cell:
    """The cell whose roles run the runtimes of `by_role`'s cells (all of one case); a diagonal tuple gives
    the diagonal cell itself, so its id does not change. Missing fixes of every role's runtime carry over."""
    runtimes = {role: cell.runtime for role, cell in by_role.items()}
    if len({r.label for r in runtimes.values()}) == 1:
        return next(iter(by_role.values()))
    fixes: dict[str, str] = {}
    for role in ROLES:
        if role in by_role:
            cell = by_role[role]
            for key, why in zip(cell.missing_fixes, cell.missing_reasons, strict=True):
                fixes.setdefault(key, f"{role} {cell.runtime.version} {why}")
    base = by_role.get("decode", diagonal[0])
    roles = tuple((role, runtimes[role]) for role in ROLES if role in runtimes)
    return Cell(base.case, base.runtime, tuple(fixes), tuple(fixes.values()), roles)


def expand_skew(
    cells: Sequence[Cell], *, frontend: bool, excluded: Callable[[str, str, str], None] | None = None
) -> list[Cell]:
    """Every ordered tuple of each case's selected runtimes, one cell each, grouped by case in plan order.

    A case whose roles share one process (`shared_process`) keeps its diagonal only; `excluded(case,
    runtimes, why)` hears of each tuple left out."""
    out: list[Cell] = []
    for name, group in itertools.groupby(cells, key=lambda c: c.case.name):
        diagonal = list(group)
        roles = roles_for(diagonal[0].case, frontend)
        shared = shared_process(diagonal[0].case)
        for choice in itertools.product(diagonal, repeat=len(roles)):
            cell = skew_cell(diagonal, dict(zip(roles, choice, strict=True)))
            if shared and cell.skewed:
                if excluded is not None:
                    excluded(name, " ".join(f"{role}={v}" for role, v in cell.role_versions.items()), shared)
                continue
            out.append(cell)
    return out


def pair_cells(
    cells: Sequence[Cell], prefill: RuntimeInfo, decode: RuntimeInfo, excluded: Callable[[str, str, str], None]
) -> list[Cell]:
    """The one named pair for each case both runtimes were selected for; `excluded(case, runtime, why)` hears
    of each case of that backend that one of the two was excluded from."""
    out: list[Cell] = []
    for name, group in itertools.groupby(cells, key=lambda c: c.case.name):
        by_label = {c.runtime.label: c for c in group}
        missing = [r.label for r in (prefill, decode) if r.label not in by_label]
        if missing:
            excluded(name, " ".join(missing), "the named pair needs both runtimes selected for the case")
            continue
        shared = shared_process(next(iter(by_label.values())).case)
        if shared and prefill.label != decode.label:
            excluded(name, f"prefill={prefill.version} decode={decode.version}", shared)
            continue
        out.append(skew_cell(list(by_label.values()), {"prefill": by_label[prefill.label],
                                                       "decode": by_label[decode.label]}))  # fmt: skip
    return out


def every_skew_cell(cells: Sequence[Cell]) -> list[Cell]:
    """Every skew cell `cells` could make (each case's ordered pairs, and on a Dynamo arm its frontend x prefill x
    decode tuples), the diagonal left out: what a skew cell's id or key (`run --cell`, a stored campaign) names
    when the plan it is looked up in was made without `--skew` (a CI shard runs `matrix run --cell IDS`)."""
    by_case = sorted(cells, key=lambda c: c.case.name)  # stable: each case's runtimes keep the plan's order
    seen: dict[str, Cell] = {}
    for frontend in (False, True):
        for cell in expand_skew(by_case, frontend=frontend):
            if cell.skewed:
                seen.setdefault(cell.key, cell)
    return list(seen.values())
