"""Release gate: GO or NO-GO for one runtime version under a policy, with every reason.

Rules, in the order they are checked for each required cell (a case the policy's marker expression
selects, of the runtime's backend, whose version constraint admits the version, and that is enabled):

1. A required fix the runtime's components lack blocks, before anything has run; waivers do not
   excuse it (the catalog knows the runtime is broken for this case).
2. The latest informative attempt (any campaign) must pass: a skipped, never-started or interrupted
   attempt proves nothing, so it never replaces an earlier pass or failure (it is reported beside it, with
   its reason). No informative attempt (never run, only skipped or interrupted, still running) leaves the
   cell *not run*; waivers do not excuse it (nothing shows how it behaves).
3. A failed attempt blocks unless a waiver for the case admits the version (its `runtime_spec`, empty
   meaning every version) and has not expired. A waiver is valid through its `expires` day (UTC);
   an expired one is reported and excuses nothing.
4. A *regression* is a case whose latest attempt passed on the previous release and fails now. The
   previous release is the greatest final version of the same backend below this one: pre-releases,
   dev builds and variants are skipped, because "it passed on the last release" is a promise only
   releases make (0.30.0 is compared with 0.29.0, not with 0.29.1rc1.dev347, nor with the variant
   0.29.0+vllm.rs.0.30.0 that PEP 440 sorts between them: a runtime derived from another, or a
   local-labelled build of a version that is a runtime itself, was never released). Under `regressions_block` (the
   default) a regression blocks even when a waiver covers its failure. A `recipe` failure (the engine refused a
   dependency of matrix's recipe at start-up, `matrix.outcome.unmet_requirement`) is never a regression: it is
   the recipe's fault, not the release's; it still fails the cell.
5. A pass that needed a retry (`flaky`) is reported; it blocks only under `flaky_blocks`.
   A failure of the check `loopback_only` alone (`matrix run --loopback-only`: it served correctly, a
   listener was beyond loopback) is an `exposure`: it blocks unless waived, and is never a regression.
6. Under `min_pass_rate` (with `min_samples`, default 1) rules 2, 3 and 5 judge the pass rate over every
   informative attempt of the cell on this runtime (repeats, retries, campaigns) instead of the latest
   attempt: fewer than `min_samples` samples is incomplete evidence; a Wilson 95 % lower bound at or
   above `min_pass_rate` passes; an upper bound below it fails (blocks unless waived); a bound on each
   side is inconclusive: incomplete evidence, run more repeats. A rate rule needs many samples: 30 of 30
   passes only show a rate above 0.89 (`docs/statistics.md`).
7. Under `max_slowdown` (a fraction, 0.10 = 10 %) each required cell's passed attempts are compared with
   the previous release's, metric by metric (`matrix.report.perf`): a change worse than `max_slowdown`
   that the Mann-Whitney test finds significant at `perf_alpha` (default 0.01) blocks (`slowdown`). A metric
   whose evidence cannot rule such a slowdown out (fewer than two passed attempts on a side, or a 95 % interval
   of the ratio that straddles the threshold: `perf.insufficiency`) is `insufficient-data`, one finding per
   case naming each such metric and why, never a silent pass: reported, and under `insufficient_blocks`
   missing evidence (INCOMPLETE).
8. Under `skew_both_ways` (true: every required case; a marker expression: the required cases it selects)
   the version-skew pair of this runtime and the previous release must be `works` or `clean-reject` in both
   directions, prefill=candidate/decode=previous and the reverse (`matrix.report.gate_skew`): another class
   blocks (`skew`), a direction with no finished attempt is missing evidence (`skew-not-run`).
9. A cell under a quarantine in force (`matrix.report.muted`: `matrix quarantine`, or automatic on flake
   evidence) is *muted*: its findings that say it misbehaved (failed, regression, flaky, low pass rate,
   exposure, slowdown) are reported with `[muted]` and do not block, and a `muted` finding names the
   quarantine, its owner and what it muted; a missing fix, missing evidence or a version-skew pair's finding
   (the pair is a cell of its own) still counts as ever.

The verdict: NO-GO when a finding blocks (a failure, a missing fix, a regression...); else INCOMPLETE
when a required cell has not run (the evidence is missing, nothing is known to be wrong: run the cells
and ask again); else GO. A GO where not every required cell passed (failures excused by waivers) says
so on its first line. A policy that selects no case for the runtime is N/A (not applicable): it says
nothing about the runtime either way. A NO-GO whose only blocking findings are missing fixes (and missing
evidence), where no required cell ran and failed, is *predicted*: known from the catalog before a cell ran,
and shown as such (a failure excused by a waiver still ran: that NO-GO is measured). `matrix gate` exits
0 for GO, 1 for NO-GO, 3 for INCOMPLETE, 4 for N/A and 2 for bad input.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from matrix.db.models import CellRun, GatePolicy, Waiver
from matrix.errors import ConfigError, MatrixError
from matrix.markers import Expression, MarkerUse, matches
from matrix.outcome import (
    CELL_FAULT_STATUSES,
    LOOPBACK_CHECK,
    PASSED,
    RECIPE,
    UNINFORMATIVE_STATUSES,
    exposure_only,
    later_skip,
    standing_attempt,
)
from matrix.plan import missing_fixes
from matrix.report.data import (
    AttemptRow,
    CaseView,
    RuntimeView,
    iter_attempt_rows,
    load_cases,
    load_runtimes,
)
from matrix.report.gate_skew import SKEW_KIND, SKEW_NOT_RUN, judge_skew
from matrix.report.muted import MUTABLE_KINDS, QuarantineView, load_quarantines
from matrix.report.perf import DEFAULT_ALPHA, METRICS, Samples, compare_metrics, load_samples
from matrix.report.stats import INSTALL_HINT, PassRate, pass_rate, significance_available
from matrix.text import clean, printable
from matrix.versions import parse_specifier, parse_version, specifier_admits

__all__ = [
    "EXIT_CODES", "KNOWN_RULES", "GateCell", "GateResult", "Known", "Policy", "Reason", "WaiverView",
    "evaluate_gate", "gate_text",
]  # fmt: skip

NO_RATE = PassRate(0, 0, "")
# Rule 7's finding for a metric the evidence cannot judge (too few samples, an interval straddling the bar).
INSUFFICIENT_DATA = "insufficient-data"
# `matrix gate` exit code per verdict (2 is bad input, as for every command).
EXIT_CODES: Mapping[str, int] = {"GO": 0, "NO-GO": 1, "INCOMPLETE": 3, "N/A": 4}
# Blocking findings a NO-GO can be *predicted* from, before anything ran: the catalog knows a fix is missing.
PREDICTED_KINDS = frozenset({"missing-fix"})
# Blocking findings that mean "evidence missing" rather than "something is wrong".
INCOMPLETE_KINDS = frozenset({"not-run", "few-samples", "inconclusive", "slowdown-untested", SKEW_NOT_RUN,
                              INSUFFICIENT_DATA})  # fmt: skip

# Rule name -> default. Unknown rule names in a policy are an error, so a typo cannot silently relax it.
KNOWN_RULES: Mapping[str, Any] = {
    "flaky_blocks": False,
    "regressions_block": True,
    "min_pass_rate": None,
    "min_samples": 1,
    "max_slowdown": None,
    "perf_alpha": DEFAULT_ALPHA,
    "skew_both_ways": False,
    "insufficient_blocks": False,
}


# What each rule means, for the gate page and `gate_text` ("which rules a policy has").
RULE_TEXT: Mapping[str, str] = {
    "flaky_blocks": "a pass that needed a retry blocks",
    "regressions_block": "a case that passed on the previous release and fails now blocks, even when waived",
    "min_pass_rate": "the Wilson 95 % lower bound of the pass rate must reach this",
    "min_samples": "fewer informative attempts than this is incomplete evidence",
    "max_slowdown": "a metric worse than on the previous release by more than this fraction, significantly, blocks",
    "perf_alpha": "significance level of the slowdown rule's Mann-Whitney test",
    "skew_both_ways": "prefill=candidate/decode=previous release and the reverse must be works or clean-reject",
    "insufficient_blocks": "a metric max_slowdown cannot judge (too few samples, interval straddling it) is "
                           "incomplete evidence",
}


@dataclass(frozen=True)
class Policy:
    name: str
    expression: str
    description: str
    flaky_blocks: bool
    regressions_block: bool
    min_pass_rate: float | None = None
    min_samples: int = 1
    max_slowdown: float | None = None
    perf_alpha: float = DEFAULT_ALPHA
    # False: off; True: every required case; a marker expression: the required cases it selects.
    skew_both_ways: bool | str = False
    insufficient_blocks: bool = False

    def rules(self) -> dict[str, Any]:
        return {"flaky_blocks": self.flaky_blocks, "regressions_block": self.regressions_block,
                "min_pass_rate": self.min_pass_rate, "min_samples": self.min_samples,
                "max_slowdown": self.max_slowdown, "perf_alpha": self.perf_alpha,
                "skew_both_ways": self.skew_both_ways, "insufficient_blocks": self.insufficient_blocks}  # fmt: skip

    def judges_skew(self, markers: Iterable[MarkerUse]) -> bool:
        """Whether `skew_both_ways` applies to a required case with these markers."""
        if isinstance(self.skew_both_ways, str):
            return matches(Expression.compile(self.skew_both_ways), markers)
        return self.skew_both_ways

    def rule_lines(self) -> list[tuple[str, str, str]]:
        """(rule, value, meaning) of every rule in force; rules of the rate or speed family that are off say so."""
        found = [
            ("flaky_blocks", _yes_no(self.flaky_blocks), RULE_TEXT["flaky_blocks"]),
            ("regressions_block", _yes_no(self.regressions_block), RULE_TEXT["regressions_block"]),
        ]
        if self.min_pass_rate is None:
            found.append(("min_pass_rate", "off", "the latest attempt must pass"))
        else:
            found.append(("min_pass_rate", f"{self.min_pass_rate:g}", RULE_TEXT["min_pass_rate"]))
            found.append(("min_samples", str(self.min_samples), RULE_TEXT["min_samples"]))
        if self.max_slowdown is None:
            found.append(("max_slowdown", "off", "performance is not judged"))
        else:
            found.append(("max_slowdown", f"{self.max_slowdown:g} ({100 * self.max_slowdown:g} %)",
                          RULE_TEXT["max_slowdown"]))  # fmt: skip
            found.append(("perf_alpha", f"{self.perf_alpha:g}", RULE_TEXT["perf_alpha"]))
            found.append(("insufficient_blocks", _yes_no(self.insufficient_blocks), RULE_TEXT["insufficient_blocks"]))
        if self.skew_both_ways is not False:
            scope = "every required case" if self.skew_both_ways is True else f"cases {self.skew_both_ways}"
            found.append(("skew_both_ways", scope, RULE_TEXT["skew_both_ways"]))
        return found


def _yes_no(value: bool) -> str:
    return "yes" if value else "no"


@dataclass(frozen=True)
class WaiverView:
    case: str
    runtime_spec: str
    reason: str
    link: str
    expires: dt.date | None
    owner: str = ""

    def expired(self, today: dt.date) -> bool:
        return self.expires is not None and today > self.expires

    def admits(self, version: str) -> bool:
        return not self.runtime_spec or specifier_admits(parse_specifier(self.runtime_spec), parse_version(version))

    def describe(self) -> str:
        until = f" until {self.expires.isoformat()}" if self.expires else ""
        link = f" ({self.link})" if self.link else ""
        spec = self.runtime_spec or "any version"
        owner = f" (owner {clean(self.owner)})" if self.owner else ""
        return f"waiver {spec}{until}{owner}: {clean(self.reason)}{link}"


@dataclass(frozen=True)
class Reason:
    """One finding. `blocking` findings make the gate NO-GO; the others are reported for the record."""

    # missing-fix | not-run | failed | regression | flaky | waived | waiver-expired | unexpected-pass | no-cases
    # | skipped-later (a skip or interruption after the attempt that decides: reported, never blocking)
    # | exposure (served correctly, but `--loopback-only` found a listener beyond loopback)
    kind: str
    case: str
    message: str
    blocking: bool


@dataclass(frozen=True)
class GateCell:
    """One required cell and what the gate made of it."""

    case: CaseView
    attempt: AttemptRow | None
    previous: AttemptRow | None
    missing: tuple[str, ...]
    waiver: WaiverView | None
    expired_waivers: tuple[WaiverView, ...]
    blocking: bool
    # Every informative attempt on this runtime: what `min_pass_rate` judges (shown under any policy).
    rate: PassRate = NO_RATE
    # The quarantine in force for the cell (`matrix.report.muted`), and the findings it kept from blocking.
    quarantine: QuarantineView | None = None
    muted: tuple[Reason, ...] = ()

    @property
    def status(self) -> str:
        return self.attempt.status if self.attempt else "not run"


@dataclass(frozen=True)
class GateResult:
    runtime: RuntimeView
    policy: Policy
    previous: RuntimeView | None
    cells: tuple[GateCell, ...]
    not_required: tuple[tuple[str, str], ...]  # (case, why) of cases the expression selects but that do not apply
    reasons: tuple[Reason, ...]
    today: dt.date

    @property
    def go(self) -> bool:
        return not any(r.blocking for r in self.reasons)

    @property
    def incomplete(self) -> bool:
        """Only missing evidence blocks: no finding says the runtime is wrong."""
        blocking = [r for r in self.reasons if r.blocking]
        return bool(blocking) and all(r.kind in INCOMPLETE_KINDS for r in blocking)

    @property
    def applicable(self) -> bool:
        """The policy selects a case that applies to the runtime: there is something to gate."""
        return bool(self.cells)

    @property
    def verdict(self) -> str:
        if not self.applicable:
            return "N/A"
        return "GO" if self.go else "INCOMPLETE" if self.incomplete else "NO-GO"

    @property
    def measured_failures(self) -> list[GateCell]:
        """Required cells whose standing attempt ran and failed by the cell's own fault (waived or not)."""
        return [c for c in self.cells if c.attempt is not None and c.attempt.status in CELL_FAULT_STATUSES]

    @property
    def predicted(self) -> bool:
        """A NO-GO known before any measurement: only missing fixes (and missing evidence) block, and no
        required cell ran and failed, so the verdict comes from the catalog alone. A failure that ran is a
        measurement even when a waiver excuses it: that NO-GO is not a prediction."""
        blocking = {r.kind for r in self.reasons if r.blocking}
        from_catalog = self.verdict == "NO-GO" and bool(blocking & PREDICTED_KINDS) and blocking <= (
            PREDICTED_KINDS | INCOMPLETE_KINDS
        )
        return from_catalog and not self.measured_failures

    @property
    def verdict_text(self) -> str:
        """The verdict as shown: a predicted NO-GO says so, N/A says why."""
        if self.predicted:
            return "NO-GO (predicted)"
        return self.verdict

    @property
    def skew_line(self) -> str:
        """The version-skew findings that decide the verdict, in one line ("" when none blocks)."""
        blocking = [r for r in self.reasons if r.blocking and r.kind in (SKEW_KIND, SKEW_NOT_RUN)]
        if not blocking:
            return ""
        previous = self.previous.version if self.previous else "?"
        # Each skew message starts with its headline, the pair and its class, up to the first colon.
        what = "; ".join(f"{r.case}: {r.message.split(':', 1)[0]}" for r in blocking)
        return f"version skew with the previous release {previous}: {what}"

    @property
    def explanation(self) -> str:
        """One line under a verdict that is not a plain measurement ("" for the others)."""
        if self.skew_line:
            return self.skew_line
        if self.predicted:
            return ("predicted, not measured: the catalog says a required fix is missing; no required cell has "
                    "failed (run them to measure)")  # fmt: skip
        blocking = {r.kind for r in self.reasons if r.blocking}
        if self.verdict == "NO-GO" and blocking & PREDICTED_KINDS and blocking <= PREDICTED_KINDS | INCOMPLETE_KINDS:
            ran = ", ".join(c.case.name for c in self.measured_failures)
            # Every failure here is waived (an unwaived one would block on its own): measured, not predicted.
            return (f"measured, not predicted: {ran} ran and failed (waived); NO-GO because the catalog says a "
                    "required fix is missing, which no waiver excuses")  # fmt: skip
        if not self.applicable:
            return f"not applicable: policy {self.policy.name} selects no case that applies to {self.runtime.label}"
        return ""

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    @property
    def muted(self) -> list[GateCell]:
        """Required cells under a quarantine, whether or not it muted a finding this time."""
        return [c for c in self.cells if c.quarantine is not None]

    @property
    def passed(self) -> int:
        return sum(1 for c in self.cells if c.status == PASSED)

    @property
    def caveat(self) -> str:
        """Why a GO is lenient (not every required cell passed), else ""."""
        if not self.go or self.passed == len(self.cells):
            return ""
        waived = sum(1 for r in self.reasons if r.kind == "waived")
        muted = sum(1 for c in self.cells if c.muted)
        return (f"lenient: only {self.passed} of {len(self.cells)} required cells passed; "
                f"{waived} failure(s) excused by waivers" + (f", {muted} cell(s) muted by quarantine" if muted else ""))

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "predicted": self.predicted,
            "exit_code": self.exit_code,
            "caveat": self.caveat,
            "required": len(self.cells),
            "passed": self.passed,
            "backend": self.runtime.backend,
            "version": self.runtime.version,
            "policy": {"name": self.policy.name, "expression": self.policy.expression, **self.policy.rules()},
            "previous_release": self.previous.version if self.previous else None,
            "reasons": [{"kind": r.kind, "case": r.case, "message": r.message, "blocking": r.blocking}
                        for r in self.reasons],
            "cells": [{"case": c.case.name, "status": c.status, "flaky": bool(c.attempt and c.attempt.flaky),
                       "pass_rate": c.rate.as_dict(),
                       "previous": c.previous.status if c.previous else None, "missing_fixes": list(c.missing),
                       "waived": c.waiver is not None, "blocking": c.blocking,
                       "quarantine": c.quarantine.as_dict() if c.quarantine else None,
                       "muted": [{"kind": r.kind, "message": r.message} for r in c.muted]} for c in self.cells],
            "muted": [c.case.name for c in self.muted],
            "not_required": [{"case": case, "why": why} for case, why in self.not_required],
            "date": self.today.isoformat(),
        }  # fmt: skip


def _policy(session: Session, name: str) -> Policy:
    row = session.scalar(select(GatePolicy).where(GatePolicy.name == name, GatePolicy.retired.is_(False)))
    if row is None:
        known = ", ".join(session.scalars(select(GatePolicy.name).where(GatePolicy.retired.is_(False)))) or "none"
        raise ConfigError(f"unknown gate policy {name!r} (known: {known}; see `matrix gates list`)")
    rules = dict(row.rules or {})
    unknown = sorted(set(rules) - set(KNOWN_RULES))
    if unknown:
        raise ConfigError(
            f"gate policy {name!r} has unknown rule(s) {', '.join(unknown)}; known rules: {', '.join(KNOWN_RULES)}"
        )
    for key, value in rules.items():
        _check_rule(name, key, value)
    values = {**KNOWN_RULES, **rules}
    return Policy(
        row.name, row.expression, row.description, values["flaky_blocks"], values["regressions_block"],
        _float(values["min_pass_rate"]), int(values["min_samples"]), _float(values["max_slowdown"]),
        float(values["perf_alpha"]), values["skew_both_ways"], values["insufficient_blocks"],
    )  # fmt: skip


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


# Numeric rules: (smallest, largest, what it means) for the error message.
_NUMERIC_RULES: Mapping[str, tuple[float, float, str]] = {
    "min_pass_rate": (0.0, 1.0, "a pass rate from 0 to 1 (0.95: the Wilson lower bound must reach 95 %)"),
    "min_samples": (1, 1_000_000, "a whole number of attempts, at least 1"),
    "max_slowdown": (0.0, 10.0, "a fraction from 0 to 10 (0.10: 10 % worse)"),
    "perf_alpha": (1e-9, 0.5, "a significance level above 0 and at most 0.5 (e.g. 0.01)"),
}


def _check_rule(policy: str, key: str, value: Any) -> None:
    if key in _NUMERIC_RULES:
        low, high, meaning = _NUMERIC_RULES[key]
        number = isinstance(value, int | float) and not isinstance(value, bool)
        whole = key != "min_samples" or isinstance(value, int)
        if not (number and whole and low <= value <= high):
            raise ConfigError(f"gate policy {policy!r}: rule {key} must be {meaning}, got {value!r}")
    elif key == "skew_both_ways" and isinstance(value, str):
        try:
            Expression.compile(value)
        except MatrixError as exc:
            raise ConfigError(f"gate policy {policy!r}: rule skew_both_ways must be true, false or a marker "
                              f"expression: {exc}") from None  # fmt: skip
    elif not isinstance(value, bool):
        raise ConfigError(f"gate policy {policy!r}: rule {key} must be true or false, got {value!r}")


def _find_runtime(runtimes: Sequence[RuntimeView], backend: str, version: str) -> RuntimeView:
    wanted = parse_version(version)
    for runtime in runtimes:
        if runtime.backend == backend and runtime.parsed == wanted:
            return runtime
    if not any(r.backend == backend for r in runtimes):
        backends = ", ".join(sorted({r.backend for r in runtimes})) or "none"
        raise ConfigError(f"unknown backend {backend!r} (backends with runtimes: {backends})")
    known = ", ".join(r.version for r in runtimes if r.backend == backend)
    raise ConfigError(f"no runtime {backend} {wanted} (known versions: {known}; see `matrix runtimes list`)")


def is_variant(runtimes: Sequence[RuntimeView], runtime: RuntimeView) -> bool:
    """A runtime derived from another of its backend: made by `runtime derive`, `run --with` or `bisect
    --component` (source "derived"), or a local-labelled build of a version that is a runtime itself
    (`0.29.0+vllm.rs.0.30.0` written by hand or with `base`, `0.32.0+container`). A variant is not a release:
    PEP 440 sorts `0.29.0+vllm.rs.0.30.0` after 0.29.0, yet nobody shipped it."""
    if runtime.info.derived:
        return True
    if runtime.parsed.local is None:
        return False
    public = parse_version(runtime.parsed.public)
    return any(r.backend == runtime.backend and r.parsed == public for r in runtimes)


def previous_release(runtimes: Sequence[RuntimeView], runtime: RuntimeView) -> RuntimeView | None:
    """The greatest release of the same backend below `runtime`: pre-releases, dev builds and variants
    (`is_variant`) skipped. For a variant that is its base's release (or the one below it)."""
    older = [
        r for r in runtimes
        if r.backend == runtime.backend and r.parsed < runtime.parsed and not r.parsed.is_prerelease
        and not is_variant(runtimes, r)
    ]  # fmt: skip
    return max(older, key=lambda r: r.parsed, default=None)


def _required(
    cases: Sequence[CaseView], runtime: RuntimeView, policy: Policy
) -> tuple[list[CaseView], list[tuple[str, str]]]:
    expression = Expression.compile(policy.expression)
    required, skipped = [], []
    for case in cases:
        if case.retired or case.backend != runtime.backend or not matches(expression, case.info.markers):
            continue
        constraint = case.info.version_constraint
        if constraint and not specifier_admits(parse_specifier(constraint), runtime.parsed):
            skipped.append((case.name, f"version {runtime.version} outside the case's constraint {constraint}"))
        elif not case.info.enabled:
            skipped.append((case.name, "case is disabled"))
        else:
            required.append(case)
    return required, skipped


def _failure_text(attempt: AttemptRow) -> str:
    checks = ", ".join(attempt.check_names)
    kind = f" ({attempt.failure_kind})" if attempt.failure_kind else ""
    return f"{attempt.status}{kind}" + (f": {checks}" if checks else "")


@dataclass(frozen=True)
class Known:
    """What the report already holds when it judges every runtime: every attempt summary by (case id, runtime
    id), oldest first, as the gate would read them (`iter_attempt_rows`), and a reader of the perf samples
    that reads each pair of runtimes once (the comparison of a release with the one before reads the same)."""

    history: Mapping[tuple[int, int], Sequence[AttemptRow]] | None  # None: read them (a scoped report lacks some)
    samples: Callable[[Sequence[int]], Mapping[tuple[int, int], Samples]]


def evaluate_gate(
    session: Session,
    backend: str,
    version: str,
    policy_name: str = "release",
    *,
    today: dt.date | None = None,
    known: Known | None = None,
) -> GateResult:
    """Judge `backend` `version` under the policy `policy_name`; see the module docstring for the rules.
    `known`: what a caller judging many runtimes (the report) has already read."""
    today = today or dt.datetime.now(dt.UTC).date()
    policy = _policy(session, policy_name)
    runtimes = load_runtimes(session)
    runtime = _find_runtime(runtimes, backend.lower(), version)
    previous = previous_release(runtimes, runtime)
    required, not_required = _required(load_cases(session), runtime, policy)
    ids = {c.id for c in required}
    runtime_ids = [runtime.id] + ([previous.id] if previous else [])
    history: dict[tuple[int, int], list[AttemptRow]] = {}
    if known is not None and known.history is not None:
        for key, attempts in known.history.items():
            if key[0] in ids and key[1] in runtime_ids:
                history[key] = list(attempts)
    else:
        for attempt in iter_attempt_rows(session, [CellRun.runtime_id.in_(runtime_ids), CellRun.case_id.in_(ids)]):
            history.setdefault((attempt.case_id, attempt.runtime_id), []).append(attempt)
    waivers: dict[int, list[WaiverView]] = {}
    for w in session.scalars(
        select(Waiver).where(Waiver.retired.is_(False), Waiver.case_id.in_(ids)).options(selectinload(Waiver.case))
    ):
        waivers.setdefault(w.case_id, []).append(
            WaiverView(w.case.name, w.runtime_spec, w.reason, w.link, w.expires, w.owner)
        )
    quarantines = [q for q in load_quarantines(session, ids, current_only=True) if q.active(today)]

    skips = _skip_messages(session, history.values())
    load = known.samples if known is not None else functools.partial(load_samples, session)
    samples = load(runtime_ids) if policy.max_slowdown is not None else {}
    reasons: list[Reason] = []
    cells: list[GateCell] = []
    for case in required:
        attempts = history.get((case.id, runtime.id), [])
        now = standing_attempt(attempts)
        before = standing_attempt(history.get((case.id, previous.id), [])) if previous else None
        applicable = [w for w in waivers.get(case.id, []) if w.admits(runtime.version)]
        valid = next((w for w in applicable if not w.expired(today)), None)
        expired = tuple(w for w in applicable if w.expired(today))
        rate = pass_rate([a.status for a in attempts])
        if policy.min_pass_rate is None:
            found = _judge(case, runtime, previous, policy, now, before, valid, expired, skips)
        else:
            found = _judge_rate(case, runtime, policy, rate, valid, expired)
        if policy.max_slowdown is not None and previous is not None:
            found.extend(_slowdowns(case, runtime, previous, policy, samples))
        if policy.judges_skew(case.info.markers):
            found.extend(Reason(kind, case.name, message, blocks) for kind, message, blocks in judge_skew(
                session, case.name, runtime.backend, runtime.version, previous.version if previous else None))
        skip = later_skip(attempts, now)
        if skip is not None and now is not None:
            found.append(Reason("skipped-later", case.name, f"{_skip_text(skip, skips)} after the {now.status} "
                                f"attempt of campaign {now.campaign_id}, which decides: it proves nothing about "
                                "the runtime", False))  # fmt: skip
        quarantine = next((q for q in quarantines if q.covers(case.id, runtime.id)), None)
        found, muted = _mute(found, quarantine)
        reasons.extend(found)
        missing = tuple(key for key, _ in missing_fixes(case.info, runtime.info))
        cells.append(GateCell(case, now, before, missing, valid, expired, any(r.blocking for r in found), rate,
                              quarantine, muted))  # fmt: skip
    if not required:
        # Not applicable, not NO-GO: nothing is wrong with the runtime, the policy does not speak about it.
        reasons.append(
            Reason("no-cases", "", f"policy {policy.name} ({policy.expression}) selects no case that applies to "
                   f"{runtime.label}: the gate does not apply (N/A), it shows neither that it works nor that it "
                   "does not", False)
        )  # fmt: skip
    return GateResult(runtime, policy, previous, tuple(cells), tuple(not_required), tuple(reasons), today)


def _mute(found: list[Reason], quarantine: QuarantineView | None) -> tuple[list[Reason], tuple[Reason, ...]]:
    """A quarantined cell's blocking findings of the kinds a quarantine mutes become reported, not blocking,
    each saying so, and one `muted` finding names the quarantine; other findings are left as they are."""
    if quarantine is None:
        return found, ()
    muted = tuple(r for r in found if r.blocking and r.kind in MUTABLE_KINDS)
    kept = [Reason(r.kind, r.case, f"{r.message} [muted]", False) if r in muted else r for r in found]
    what = "; would have blocked on " + ", ".join(r.kind for r in muted) if muted else "; nothing to mute this time"
    kept.append(Reason("muted", quarantine.case, f"{quarantine.describe()}{what}", False))
    return kept, muted


def _judge(
    case: CaseView,
    runtime: RuntimeView,
    previous: RuntimeView | None,
    policy: Policy,
    now: AttemptRow | None,
    before: AttemptRow | None,
    waiver: WaiverView | None,
    expired: tuple[WaiverView, ...],
    skips: Mapping[int, str],
) -> list[Reason]:
    """Every finding for one required cell."""
    name = case.name
    found = [Reason("missing-fix", name, why, True) for _, why in missing_fixes(case.info, runtime.info)]
    for w in expired:
        found.append(Reason("waiver-expired", name, f"{w.describe()} expired: it excuses nothing", False))
    if now is None or (now.status != PASSED and now.status not in CELL_FAULT_STATUSES):
        if now is None:
            what = "never run"
        elif now.status in UNINFORMATIVE_STATUSES:
            what = f"latest attempt {_skip_text(now, skips)}"
        else:
            what = f"latest attempt is {now.status} (campaign {now.campaign_id})"
        found.append(Reason("not-run", name, f"not run on {runtime.label}: {what}", True))
        return found
    if now.status == PASSED:
        if now.flaky:
            rule = "blocks under flaky_blocks" if policy.flaky_blocks else "reported, not blocking"
            found.append(
                Reason("flaky", name, f"passed only after a failed attempt (flaky; {rule})", policy.flaky_blocks)
            )
        if now.unexpected_pass:
            found.append(Reason("unexpected-pass", name, "passed although a required fix is missing: check the "
                                "fix's fixed_in versions in the catalog", False))  # fmt: skip
        return found
    if exposure_only(now.status, now.failure_kind, now.check_names):
        found.append(_exposure(name, runtime, previous, now, before, waiver))
        return found
    failure = _failure_text(now)
    # A recipe fault (an engine refused a dependency our recipe installed) says nothing about the release:
    # it fails the cell, but it is never a regression of the release.
    regression = previous is not None and before is not None and before.status == PASSED and now.failure_kind != RECIPE
    if now.failure_kind == RECIPE:
        failure += " (the runtime's recipe, not the release: fix the recipe's pins and run it again)"
    if waiver is None:
        found.append(Reason("failed", name, f"{failure} on {runtime.label} (campaign {now.campaign_id})", True))
    else:
        found.append(Reason("waived", name, f"{failure}, excused by {waiver.describe()}", False))
    if regression and previous is not None:
        blocks = policy.regressions_block
        note = " even though waived (regressions_block)" if waiver and blocks else ""
        found.append(
            Reason("regression", name, f"passed on the previous release {previous.version}, {failure} on "
                   f"{runtime.version}{note}", blocks or waiver is None)
        )  # fmt: skip
    return found


def _exposure(
    name: str, runtime: RuntimeView, previous: RuntimeView | None, now: AttemptRow, before: AttemptRow | None,
    waiver: WaiverView | None,
) -> Reason:  # fmt: skip
    """A cell that served correctly but failed `--loopback-only`: exposure, its own finding (`docs/security.md`).
    Never a regression: the previous release's pass may have had the same listeners, judged without the flag."""
    where = next((str(c.get("message", "")) for c in now.checks if c.get("name") == LOOPBACK_CHECK), "")
    text = (f"{clean(where) or 'listens beyond loopback'} on {runtime.label} (campaign {now.campaign_id}, "
            "--loopback-only): served correctly, but another host could reach it")  # fmt: skip
    if previous is not None and before is not None and before.status == PASSED:
        text += (f"; not a regression: the previous release {previous.version} passed, its listeners not judged "
                 "unless run with --loopback-only too")  # fmt: skip
    if waiver is not None:
        return Reason("waived", name, f"exposure: {text}, excused by {waiver.describe()}", False)
    return Reason("exposure", name, text, True)


def _judge_rate(
    case: CaseView,
    runtime: RuntimeView,
    policy: Policy,
    rate: PassRate,
    waiver: WaiverView | None,
    expired: tuple[WaiverView, ...],
) -> list[Reason]:
    """Every finding for one required cell under `min_pass_rate` (rule 6)."""
    name = case.name
    wanted = policy.min_pass_rate or 0.0
    found = [Reason("missing-fix", name, why, True) for _, why in missing_fixes(case.info, runtime.info)]
    for w in expired:
        found.append(Reason("waiver-expired", name, f"{w.describe()} expired: it excuses nothing", False))
    history = f" (history {rate.history})" if rate.flaky else ""
    if rate.samples < policy.min_samples:
        found.append(Reason("few-samples", name, f"{rate.text()} on {runtime.label}: fewer than min_samples = "
                            f"{policy.min_samples}; incomplete evidence, run more (`matrix run --repeat N`)", True))
        return found  # fmt: skip
    low, high = rate.interval
    if low >= wanted:
        if rate.flaky:
            found.append(Reason("flaky", name, f"{rate.text()}: flaky{history}, above min_pass_rate "
                                f"{wanted:g}", policy.flaky_blocks))  # fmt: skip
        return found
    if high >= wanted:
        found.append(Reason("inconclusive", name, f"{rate.text()}{history}: cannot tell whether the pass rate "
                            f"reaches min_pass_rate {wanted:g}; run more repeats", True))  # fmt: skip
        return found
    text = f"{rate.text()}{history}: below min_pass_rate {wanted:g} (even the Wilson upper bound)"
    if waiver is None:
        found.append(Reason("low-pass-rate", name, f"{text} on {runtime.label}", True))
    else:
        found.append(Reason("waived", name, f"{text}, excused by {waiver.describe()}", False))
    return found


def _slowdowns(
    case: CaseView,
    runtime: RuntimeView,
    previous: RuntimeView,
    policy: Policy,
    samples: Mapping[tuple[int, int], Mapping[str, list[float]]],
) -> list[Reason]:
    """Metrics significantly worse than on the previous release by more than `max_slowdown` (rule 7)."""
    before = dict(samples.get((case.id, previous.id), {}))
    now = dict(samples.get((case.id, runtime.id), {}))
    found = []
    if not significance_available():
        testable = [m for m in now if len(now[m]) > 1 and len(before.get(m, ())) > 1]
        if testable:  # the rule applies but cannot be judged: missing evidence, never a silent pass
            found.append(Reason("slowdown-untested", case.name, f"max_slowdown not checked against "
                                f"{previous.version}: the significance test needs scipy ({INSTALL_HINT})", True))
        return found  # fmt: skip
    unjudged = []
    for metric in compare_metrics(before, now, policy.max_slowdown or 0.0, policy.perf_alpha):
        if metric.regression:
            found.append(Reason("slowdown", case.name, f"{metric.text()} against {previous.version} "
                                f"(max_slowdown {policy.max_slowdown:g}, alpha {policy.perf_alpha:g})", True))
        elif metric.insufficient:
            unjudged.append(f"{metric.comparison.metric} x{metric.comparison.ratio:.3f} ({metric.insufficient})")
    # A metric this release has and the previous one has no passed sample of cannot be judged either.
    unjudged += [f"{m} (no passed attempt on {previous.version})" for m, direction in METRICS.items()
                 if direction and now.get(m) and not before.get(m)]  # fmt: skip
    if unjudged:
        rule = "incomplete evidence (insufficient_blocks)" if policy.insufficient_blocks else "reported, not blocking"
        found.append(Reason(INSUFFICIENT_DATA, case.name, f"max_slowdown {policy.max_slowdown:g} cannot be judged "
                            f"against {previous.version} for " + "; ".join(unjudged) + f": run more repeats "
                            f"(`matrix run --repeat N`); {rule}", policy.insufficient_blocks))
    return found  # fmt: skip


def _skip_messages(session: Session, histories: Iterable[Sequence[AttemptRow]]) -> dict[int, str]:
    """Attempt id -> message of every skipped or not-run attempt (their reasons: "needs 1 GPU, host has 0")."""
    ids = [a.id for attempts in histories for a in attempts if a.status in UNINFORMATIVE_STATUSES]
    found: dict[int, str] = {}
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        for attempt_id, message in session.execute(select(CellRun.id, CellRun.message).where(CellRun.id.in_(chunk))):
            found[attempt_id] = message
    return found


def _skip_text(attempt: AttemptRow, skips: Mapping[int, str]) -> str:
    reason = clean(skips.get(attempt.id, "")).strip().splitlines()
    why = f": {reason[0]}" if reason else ""
    return f"was {attempt.status} (campaign {attempt.campaign_id}){why}"


def gate_text(result: GateResult) -> str:
    """The verdict and every reason, for a terminal."""
    policy = result.policy
    caveat = f" ({result.caveat})" if result.caveat else ""
    lines = [
        f"{result.verdict_text}{caveat}: {result.runtime.backend} {result.runtime.version} under policy "
        f"{policy.name} ({policy.expression})",
    ]
    if result.explanation:
        lines.append(f"  {result.explanation}")
    for reason in result.reasons:
        mark = "x" if reason.blocking else "-"
        subject = f"{reason.case}: " if reason.case else ""
        lines.append(f"  {mark} {reason.kind:<15} {subject}{reason.message}")
    previous = result.previous.version if result.previous else "none"
    lines.append(f"required cells: {len(result.cells)} ({result.passed} passed); previous release: {previous}")
    if result.muted:
        lines.append("muted (quarantined, not blocking): " + "; ".join(
            f"{c.case.name} (owner {clean(c.quarantine.owner)}, {c.quarantine.entry})"
            for c in result.muted if c.quarantine is not None))  # fmt: skip
    lines.append("rules: " + "; ".join(f"{rule} {value}" for rule, value, _ in policy.rule_lines()))
    if result.incomplete:
        lines.append("INCOMPLETE: no finding says the runtime is wrong, but required cells have not run: run them "
                     "(on a host that can) and ask again")  # fmt: skip
    for case, why in result.not_required:
        lines.append(f"  not required: {case}: {why}")
    return printable("\n".join(lines))


def load_policy(session: Session, name: str) -> Policy:
    """The gate policy `name`, its rules checked (`ConfigError` naming the known ones when there is none)."""
    return _policy(session, name)


def required_cases(
    cases: Sequence[CaseView], runtime: RuntimeView, policy: Policy
) -> tuple[list[CaseView], list[tuple[str, str]]]:
    """The cases `policy` requires of `runtime`, and (case, why) of those it selects that do not apply."""
    return _required(cases, runtime, policy)
