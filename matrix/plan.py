"""Expand cases x runtimes into cells, and say why every other combination was left out.

A case combines with the runtimes of its own backend. A combination is excluded by the selection
(marker expression, --backend, --case, --runtime, --since/--until), by the case's version constraint,
or because the case or runtime is disabled. A runtime that lacks a fix the case requires is *kept* and
annotated: the cell is expected to fail, and a report must say so rather than hide it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

from matrix.cells import ROLES, CaseInfo, Cell, RuntimeInfo
from matrix.errors import ConfigError
from matrix.markers import Expression, check_known, matches
from matrix.versions import (
    VersionWindow,
    component_has_fix,
    parse_bound,
    parse_specifier,
    parse_version,
    specifier_admits,
)


@dataclass(frozen=True)
class Exclusion:
    case: str
    runtime: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"case": self.case, "runtime": self.runtime, "reason": self.reason}


@dataclass(frozen=True)
class Selection:
    """What the user asked for on the command line; the same options for `plan` and `run`."""

    marker_expression: str | None = None
    since: tuple[str, ...] = ()
    until: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()
    cases: tuple[str, ...] = ()
    runtimes: tuple[str, ...] = ()
    strict_markers: bool = True
    # Version skew (`matrix.skew`): every ordered pair of the selected runtimes, or one named pair.
    skew: bool = False
    skew_frontend: bool = False
    prefill_runtime: str | None = None
    decode_runtime: str | None = None

    def __post_init__(self) -> None:
        # `-m ""` means no marker filter, as on pytest's command line (an empty CI variable must not
        # select nothing and pass).
        if self.marker_expression == "":
            object.__setattr__(self, "marker_expression", None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "marker_expression": self.marker_expression,
            "since": list(self.since),
            "until": list(self.until),
            "backends": list(self.backends),
            "cases": list(self.cases),
            "runtimes": list(self.runtimes),
            **(self._skew_dict() if self.skewed else {}),
        }

    def _skew_dict(self) -> dict[str, Any]:
        return {"skew": self.skew, "skew_frontend": self.skew_frontend,
                "prefill_runtime": self.prefill_runtime, "decode_runtime": self.decode_runtime}  # fmt: skip

    @property
    def skewed(self) -> bool:
        return self.skew or self.prefill_runtime is not None


@dataclass(frozen=True)
class Plan:
    cells: tuple[Cell, ...]
    excluded: tuple[Exclusion, ...]
    selection: Selection

    def as_dict(self, *, explain: bool = False) -> dict[str, Any]:
        """The plan as `matrix plan --json` prints it; `explain` adds the excluded combinations."""
        data: dict[str, Any] = {"cells": [cell.as_dict() for cell in self.cells]}
        if explain:
            data["excluded"] = [exclusion.as_dict() for exclusion in self.excluded]
            if self.selection.skewed:
                data["pairs"] = [{"cell": c.key, **{role: c.runtime_of(role).version for role in ROLES}}
                                 for c in self.cells]  # fmt: skip
        return data


def missing_fixes(case: CaseInfo, runtime: RuntimeInfo) -> list[tuple[str, str]]:
    """(fix key, why) for each required fix the runtime's components lack."""
    missing = []
    for fix in case.required_fixes:
        have = runtime.components.get(fix.component)
        if have is None:
            missing.append((fix.key, f"lacks {fix.key}: runtime lists no {fix.component} component"))
        elif not component_has_fix(parse_version(have), list(fix.fixed_in)):
            missing.append(
                (fix.key, f"lacks {fix.key}: {fix.component} {have} predates the fix; expected to fail")
            )
    return missing


def _check_names(kind: str, wanted: Sequence[str], known: set[str]) -> None:
    import difflib

    for name in wanted:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ConfigError(
                f"unknown {kind} {name!r}{hint} (known: {', '.join(sorted(known)) or 'none'}; "
                f"see `matrix {kind}s list`)"
            )


def runtime_selector(text: str, backends: set[str]) -> tuple[str, Version]:
    """`vllm=0.30.0`, `vllm@v0.30.0` or `vllm-0.30.0` -> (backend, version)."""
    for sep in ("=", "@"):
        if sep in text:
            backend, _, version = text.partition(sep)
            break
    else:
        backend, _, version = text.rpartition("-")
    if not backend or not version:
        raise ConfigError(f"invalid --runtime {text!r}: write BACKEND=VERSION, e.g. vllm=0.30.0")
    _check_names("backend", [backend], backends)
    return backend, parse_version(version)


def make_plan(
    cases: Sequence[CaseInfo],
    runtimes: Sequence[RuntimeInfo],
    selection: Selection,
    *,
    known_markers: set[str],
    known_backends: set[str],
) -> Plan:
    """Pure planning: no database, no processes (`matrix.catalog.queries.plan_from_db` reads the catalog for it)."""
    expression = None
    if selection.marker_expression is not None:
        expression = Expression.compile(selection.marker_expression)
        if selection.strict_markers:
            check_known(expression, known_markers)
    _check_names("backend", list(selection.backends), known_backends)
    _check_names("case", list(selection.cases), {c.name for c in cases})
    window = VersionWindow(
        since=tuple(parse_bound(s) for s in selection.since),
        until=tuple(parse_bound(u) for u in selection.until),
    )
    for bound in (*window.since, *window.until):
        if bound.backend is not None:
            _check_names("backend", [bound.backend], known_backends)
    wanted_runtimes = {runtime_selector(r, known_backends) for r in selection.runtimes}
    pair = _named_pair(selection, known_backends)
    if pair:
        wanted_runtimes = set(pair)
    if wanted_runtimes:
        present = {(r.backend, r.parsed_version) for r in runtimes}
        for backend, version in wanted_runtimes - present:
            raise ConfigError(f"unknown runtime {backend}={version}; see `matrix runtimes list`")

    by_backend: dict[str, list[RuntimeInfo]] = {}
    for runtime in sorted(runtimes, key=lambda r: (r.backend, r.parsed_version)):
        by_backend.setdefault(runtime.backend, []).append(runtime)

    cells: list[Cell] = []
    excluded: list[Exclusion] = []
    for case in cases:
        for runtime in by_backend.get(case.backend, []):
            reason = _exclusion_reason(case, runtime, selection, expression, window, wanted_runtimes)
            if reason:
                excluded.append(Exclusion(case.name, runtime.label, reason))
                continue
            missing = missing_fixes(case, runtime)
            cells.append(Cell(case, runtime, tuple(k for k, _ in missing), tuple(why for _, why in missing)))
        if not by_backend.get(case.backend):
            excluded.append(Exclusion(case.name, "-", f"backend {case.backend} has no runtimes"))
    def exclude(case: str, runtime: str, why: str) -> None:
        excluded.append(Exclusion(case, runtime, why))

    if pair:
        from matrix.skew import pair_cells

        backend = pair[0][0]
        _check_pair_backend(backend, [c for c in cases if _case_reason(c, selection, expression) is None])
        find = {(r.backend, r.parsed_version): r for r in runtimes}
        diagonal = [c for c in cells if c.case.backend == backend]
        cells = pair_cells(diagonal, find[pair[0]], find[pair[1]], exclude)
        if diagonal and not cells and pair[0] != pair[1]:
            _refuse_shared("--prefill-runtime/--decode-runtime", diagonal)
    elif selection.skew:
        from matrix.skew import expand_skew

        _check_skew_grid(cells, selection)
        diagonal = cells
        cells = expand_skew(cells, frontend=selection.skew_frontend, excluded=exclude)
        if cells and not any(c.skewed for c in cells):
            _refuse_shared("--skew", diagonal)
    return Plan(tuple(cells), tuple(excluded), selection)


def _refuse_shared(option: str, diagonal: Sequence[Cell]) -> None:
    """When every selected case runs prefill and decode in one process, a skew plans no pair at all: say so
    (exit 2) rather than run the diagonal, or nothing, as if the skew had been asked of it."""
    from matrix.skew import shared_process

    shared = {c.case.name: shared_process(c.case) for c in diagonal}
    if all(shared.values()):
        names = ", ".join(sorted(shared))
        raise ConfigError(
            f"{option}: {names}: {next(iter(shared.values()))}; select disaggregated cases (`matrix plan` with "
            "--explain lists the excluded pairs)"
        )


def _check_pair_backend(backend: str, chosen: Sequence[CaseInfo]) -> None:
    """--prefill-runtime/--decode-runtime of a backend that none of the selected cases runs on would plan
    nothing and exit 0 ("nothing to run"): a clear refusal instead."""
    if chosen and not any(c.backend == backend for c in chosen):
        backends = ", ".join(sorted({c.backend for c in chosen}))
        raise ConfigError(
            f"--prefill-runtime/--decode-runtime name {backend} runtimes, but the selected cases run on {backends}: "
            f"name runtimes of their backend, or select {backend} cases (--backend {backend})"
        )


def _check_skew_grid(cells: Sequence[Cell], selection: Selection) -> None:
    """`--skew` needs two runtimes of a case to pair, and `--skew-frontend` an arm with a frontend process of
    its own: without them the grid is the diagonal alone, which is not what was asked."""
    from matrix.skew import FRONTEND_ARMS

    if not cells:
        return
    per_case: dict[str, set[str]] = {}
    for cell in cells:
        per_case.setdefault(cell.case.name, set()).add(cell.runtime.label)
    if all(len(labels) < 2 for labels in per_case.values()):
        only = ", ".join(sorted({label for labels in per_case.values() for label in labels}))
        raise ConfigError(
            f"--skew pairs two or more runtimes of a case's backend, but the selection gives each case one ({only}): "
            "select more runtimes (--runtime, --since/--until) or drop --skew"
        )
    if selection.skew_frontend and not any(c.case.arm in FRONTEND_ARMS for c in cells):
        arms = ", ".join(sorted({c.case.arm for c in cells}))
        raise ConfigError(
            f"--skew-frontend varies the frontend of a {'/'.join(sorted(FRONTEND_ARMS))} arm, and the selected "
            f"cases' arms ({arms}) have no frontend process of their own: drop --skew-frontend"
        )


def _named_pair(selection: Selection, backends: set[str]) -> tuple[tuple[str, Version], tuple[str, Version]] | None:
    """--prefill-runtime and --decode-runtime: one (backend, version) each, of one backend; both or neither."""
    prefill, decode = selection.prefill_runtime, selection.decode_runtime
    if prefill is None and decode is None:
        if selection.skew_frontend and not selection.skew:
            raise ConfigError("--skew-frontend widens --skew: add --skew")
        return None
    if prefill is None or decode is None:
        raise ConfigError("--prefill-runtime and --decode-runtime name one pair: give both")
    if selection.skew or selection.runtimes:
        raise ConfigError("--prefill-runtime/--decode-runtime name one pair: drop --skew and --runtime")
    p, d = runtime_selector(prefill, backends), runtime_selector(decode, backends)
    if p[0] != d[0]:
        raise ConfigError(f"a pair runs one backend: prefill is {p[0]}, decode is {d[0]}")
    return p, d


def _case_reason(case: CaseInfo, selection: Selection, expression: Expression | None) -> str | None:
    """Why the selection leaves `case` out whatever the runtime, or None when it selects it."""
    if selection.cases and case.name not in selection.cases:
        return "case not selected by --case"
    if selection.backends and case.backend not in selection.backends:
        return "backend not selected by --backend"
    if expression is not None and not matches(expression, case.markers):
        return f"markers {' '.join(case.marker_texts) or '(none)'} not selected by -m {expression.text!r}"
    if not case.enabled:
        return "case is disabled"
    return None


def _exclusion_reason(
    case: CaseInfo,
    runtime: RuntimeInfo,
    selection: Selection,
    expression: Expression | None,
    window: VersionWindow,
    wanted_runtimes: set[tuple[str, Version]],
) -> str | None:
    reason = _case_reason(case, selection, expression)
    if reason:
        return reason
    if wanted_runtimes and (runtime.backend, runtime.parsed_version) not in wanted_runtimes:
        return "runtime not selected by --runtime"
    if runtime.derived and not wanted_runtimes:
        return "a derived variant (runtime derive, run --with, bisect --component): name it with --runtime to run it"
    admitted, why = window.admits(runtime.backend, runtime.parsed_version)
    if not admitted:
        return why or "outside the version window"
    if case.version_constraint and not specifier_admits(
        parse_specifier(case.version_constraint), runtime.parsed_version
    ):
        return f"version {runtime.version} outside the case's constraint {case.version_constraint}"
    if not runtime.enabled:
        return "runtime is disabled"
    return None
