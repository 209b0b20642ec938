"""View models for the pages: what each template shows, computed from `Results` in plain Python.

Templates only loop and print. Every piece of untrusted text (messages, check messages, completions,
log tails) is cleaned here or by `log_tails` (redacted, printable, bounded); the templates' autoescaping
then makes it inert.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from matrix.outcome import (
    EXPOSED,
    FAILED_STATUSES,
    LOOPBACK_CHECK,
    PASSED,
    SKIPPED,
    beyond_loopback,
    describe_listeners,
    exposure_only,
)
from matrix.report import links
from matrix.report.data import AttemptDetail, AttemptRow, CaseView, ResultCell, Results, RuntimeView
from matrix.report.fmt import flatten, fmt_pairs, fmt_peaks, fmt_seconds, fmt_time
from matrix.report.stats import pass_rate
from matrix.report.trend import Trend, trend
from matrix.text import clean, printable, shorten

__all__ = [
    "STATUS_LABELS",
    "AttemptGroup",
    "AttemptView",
    "BackendSection",
    "CampaignRow",
    "CampaignSummary",
    "CellView",
    "Column",
    "GateBadge",
    "GridCell",
    "GridRow",
    "attempt_view",
    "backend_sections",
    "campaign_summaries",
    "cell_views",
    "group_attempts",
    "page_attempt_ids",
    "status_counts",
    "status_label",
]

# Every status has a text label, so the grid reads without colour.
STATUS_LABELS: Mapping[str, str] = {
    "passed": "PASS",
    "failed": "FAIL",
    "error": "ERROR",
    "timeout": "TIMEOUT",
    # Not a stored status: a failure of `--loopback-only` alone (`shown_status`), exposure is its own finding.
    EXPOSED: "EXPOSED",
    "skipped": "SKIP",
    "interrupted": "INTERRUPTED",
    "not-run": "NOT RUN",
    "running": "RUNNING",
    "pending": "PENDING",
    "none": "NO RESULT",
    "n/a": "n/a",
}
MESSAGE_LIMIT = 16_000
CHECK_LIMIT = 2_000
COMPLETION_LIMIT = 2_000


def status_label(status: str) -> str:
    return STATUS_LABELS.get(status, status.upper())


def status_css(status: str) -> str:
    return "st-" + links.slug(status)


def _check_names(attempt: AttemptRow | AttemptDetail) -> list[str]:
    return [str(c.get("name", "")) for c in attempt.checks if isinstance(c, Mapping)]


def shown_status(attempt: AttemptRow | AttemptDetail) -> str:
    """The status a page shows: `exposed` for a pair that served correctly but failed `--loopback-only`
    (a listener another host could reach; `docs/security.md`), else the stored status."""
    if exposure_only(attempt.status, attempt.failure_kind, _check_names(attempt)):
        return EXPOSED
    return attempt.status


def exposure_note(attempt: AttemptRow | AttemptDetail) -> str:
    """Where the exposed attempt listened ("listens beyond loopback: prefill 0.0.0.0:41234/tcp")."""
    return next((clean(str(c.get("message", ""))) for c in attempt.checks
                 if isinstance(c, Mapping) and c.get("name") == LOOPBACK_CHECK), "")  # fmt: skip


NOTE_LIMIT = 60


class GateBadge(NamedTuple):
    """A runtime's gate verdict under one policy, linking to the page with every reason."""

    policy: str
    verdict: str  # whatever the gate says (GO, NO-GO, INCOMPLETE), shown as given
    css: str
    href: str
    title: str


@dataclass(frozen=True)
class Column:
    runtime: RuntimeView
    href: str
    counts: str  # "1 passed, 1 skipped": words, never a fraction that hides skips
    gates: tuple[GateBadge, ...] = ()


class GridCell(NamedTuple):
    status: str
    label: str
    css: str
    href: str | None
    title: str
    notes: tuple[str, ...]


@dataclass(frozen=True)
class GridRow:
    case: CaseView
    cells: tuple[GridCell, ...]
    trend: Trend | None


@dataclass(frozen=True)
class BackendSection:
    backend: str
    columns: tuple[Column, ...]
    rows: tuple[GridRow, ...]


def counts_text(statuses: Iterable[str]) -> str:
    """``2 passed, 1 failed, 1 skipped`` in the report's status order; ``no results`` for none."""
    counts = Counter(statuses)
    order = [s for s in STATUS_LABELS if counts[s]] + sorted(s for s in counts if s not in STATUS_LABELS)
    return ", ".join(f"{counts[s]} {s}" for s in order) or "no results"


# The newest outcomes of a flaky cell shown in the grid ("P" pass, "F" failure, oldest first).
HISTORY_LIMIT = 12


def _grid_cell(
    cell: ResultCell | None, runtime: RuntimeView, case: CaseView, excluded: str | None, reasons: Mapping[int, str]
) -> GridCell:
    key = f"{case.name}@{runtime.label}"
    if cell is None:
        why = excluded or "not a cell of this selection"
        return GridCell("n/a", "n/a", "st-na", None, f"{key}: {why}", ())
    href = links.cell_href(runtime.backend, runtime.version, case.name)
    last = cell.latest
    notes: list[str] = []
    if cell.missing:
        notes.append("lacks fix")
    if last is None:
        return GridCell("none", status_label("none"), "st-none", href, f"{key}: no attempt yet", tuple(notes))
    detail = last.status
    shown = shown_status(last)
    if last.failure_kind:
        detail += f" ({last.failure_kind}" + (f": {', '.join(last.check_names)}" if last.check_names else "") + ")"
    if shown == EXPOSED:
        # Served correctly; where it listened is the finding, named in the grid itself.
        where = exposure_note(last)
        notes.append(shorten(where or "listens beyond loopback", NOTE_LIMIT))
        detail = f"exposed under --loopback-only: {where}" if where else "exposed under --loopback-only"
    elif last.status in FAILED_STATUSES and last.failure_kind:  # the grid names the failure kind and checks
        # What failed, in the grid itself: the kind and the checks ("validation: worker_ids_distinct").
        checks = ", ".join(last.check_names)
        notes.append(shorten(f"{last.failure_kind}: {checks}" if checks else last.failure_kind, NOTE_LIMIT))
    reason = reasons.get(last.id, "")
    if last.status == SKIPPED and reason:
        notes.append(shorten(reason, NOTE_LIMIT))
        detail += f": {reason}"
    if last.attempt > 1:
        notes.append(f"attempt {last.attempt}")
    rate = pass_rate([a.status for a in cell.attempts])
    if rate.samples > 1:
        # Several samples (repeats, retries, campaigns): how often it passes and how sure that is.
        low, high = rate.interval
        notes.append(f"pass {rate.passed}/{rate.samples} (95 % CI {100 * low:.0f}-{100 * high:.0f} %)")
        detail += f"; {rate.text()}"
    if last.flaky or rate.flaky:
        notes.append("flaky")
    if rate.flaky:
        notes.append(f"history {rate.history[-HISTORY_LIMIT:]}")
    if last.unexpected_pass:
        notes.append("unexpected pass")
    skip = cell.later_skip
    if skip is not None:
        # The skip stands beside the result it did not replace.
        notes.append(f"then {status_label(skip.status).lower()}")
        detail += f"; later {skip.status} in campaign {skip.campaign_id} (proves nothing)"
    runs = len(cell.attempts)
    # A plain first-try pass needs no tooltip; leaving it out keeps a 100,000-cell grid a third smaller.
    plain = last.status == PASSED and runs == 1 and not notes
    title = "" if plain else f"{key}: {detail}; attempt {last.attempt}; {runs} run(s) in all"
    return GridCell(shown, status_label(shown), status_css(shown), href, title, tuple(notes))


def backend_sections(
    results: Results,
    reasons: Mapping[int, str] | None = None,
    gates: Mapping[int, tuple[GateBadge, ...]] | None = None,
) -> list[BackendSection]:
    """One grid per backend: its versions (PEP 440 order) as columns, its cases as rows.

    `reasons` maps an attempt id to why it was skipped; `gates` a runtime id to its gate verdicts."""
    reasons = reasons or {}
    gates = gates or {}
    sections = []
    for backend in results.backends():
        runtimes = results.runtimes_of(backend)
        cases = results.cases_of(backend)
        if not runtimes or not cases:
            continue
        columns = []
        for runtime in runtimes:
            outcomes = [c.latest for c in (results.cells.get((case.id, runtime.id)) for case in cases) if c]
            finished = [shown_status(o) for o in outcomes if o is not None]
            href = links.runtime_page(runtime.backend, runtime.version)
            columns.append(Column(runtime, href, counts_text(finished), gates.get(runtime.id, ())))
        versions = [runtime.version for runtime in runtimes]
        rows = []
        for case in cases:
            cells: list[GridCell] = []
            ready: list[list[float]] = []
            request: list[list[float]] = []
            for runtime in runtimes:
                cell = results.cells.get((case.id, runtime.id))
                excluded = results.excluded.get((case.id, runtime.id))
                cells.append(_grid_cell(cell, runtime, case, excluded, reasons))
                # Every repeat with a timing (all campaigns in scope): the chart shows their spread.
                attempts = cell.attempts if cell else []
                ready.append([a.ready_s for a in attempts if a.ready_s is not None])
                request.append([a.request_s for a in attempts if a.request_s is not None])
            rows.append(GridRow(case, tuple(cells), trend(versions, ready, request)))
        sections.append(BackendSection(backend, tuple(columns), tuple(rows)))
    return sections


def status_counts(cells: Iterable[ResultCell]) -> list[tuple[str, str, int]]:
    """(status, label, count) of the latest attempts, "none" for cells without one, plus flaky passes."""
    counts: Counter[str] = Counter()
    flaky = 0
    for cell in cells:
        last = cell.latest
        counts[shown_status(last) if last else "none"] += 1
        flaky += bool(last and last.flaky)
    order = [s for s in STATUS_LABELS if counts[s]] + sorted(s for s in counts if s not in STATUS_LABELS)
    found = [(s, status_label(s), counts[s]) for s in order]
    if flaky:
        found.append(("flaky", "FLAKY", flaky))
    return found


class AttemptView(NamedTuple):
    """One attempt on a runtime page.

    The structured facts (timings, ids, usage, ports, exit codes, components, GPU, peaks) are joined
    into one aligned text block per attempt: a page may hold 100,000 attempts, and one escaped block
    renders an order of magnitude faster than a table cell per value while reading the same.
    """

    detail: AttemptDetail
    label: str
    css: str
    campaign_href: str
    headline: str
    message: str
    checks: tuple[tuple[str, str], ...]
    completion: str
    facts: str


def _pairs(data: Mapping[str, Any]) -> str:
    """``key value · key value`` in recorded order, for flat mappings (ports, exit codes, components)."""
    if not data:
        return ""
    items = tuple(data.items())
    try:
        return _joined(items)
    except TypeError:  # an unhashable (nested) value
        return _nested(data)


@functools.lru_cache(maxsize=4096)  # exit codes, components and GPU repeat across most attempts
def _joined(items: tuple[tuple[str, Any], ...]) -> str:
    if any(isinstance(v, dict | list | tuple) for _, v in items):
        return _nested(dict(items))
    return " · ".join([f"{key} {value}" for key, value in items])


def _nested(data: Mapping[str, Any]) -> str:
    """Nested mappings (GPU, peaks) as dotted keys, byte counts in units."""
    return " · ".join([f"{key} {value}" for key, value in flatten(data)]) if data else ""


def _facts(d: AttemptDetail) -> str:
    lines = [
        ("timings", f"ready {fmt_seconds(d.ready_s)} · request {fmt_seconds(d.request_s)} · TTFT "
                    f"{fmt_seconds(d.ttft_s)} · teardown {fmt_seconds(d.teardown_s)} · total {fmt_seconds(d.total_s)}"),
        ("worker ids", f"prefill {d.prefill_worker_id or '-'} · decode {d.decode_worker_id or '-'}"
         if d.prefill_worker_id or d.decode_worker_id else ""),
        ("usage", f"prompt tokens {_or_dash(d.prompt_tokens)} · completion tokens {_or_dash(d.completion_tokens)} · "
                  f"finish reason {d.finish_reason or '-'}" if d.prompt_tokens is not None or d.finish_reason else ""),
        ("ports", _pairs(d.ports)),
        ("exit codes", _pairs(d.exit_codes)),
        ("components", _pairs(d.components)),
        # Words and units, never recorded keys (`cpu_s.decode`): "CPU time: decode 0.080 s".
        ("GPU", fmt_pairs(d.gpu) if d.gpu else ""),
        ("peaks", fmt_peaks(d.peaks) if d.peaks else ""),
        ("listens on", describe_listeners([e for e in d.listeners if isinstance(e, Mapping)])),
    ]  # fmt: skip
    # Structured values the runner recorded: made printable, not redacted (that is for free text).
    return printable("\n".join(f"{label:<11} {text}" for label, text in lines if text))


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _headline(d: AttemptDetail) -> str:
    parts = [d.uid, f"{fmt_time(d.started_at)} → {fmt_time(d.finished_at)}"]
    if d.failure_kind:
        parts.append(f"failure kind {d.failure_kind}")
    if d.flaky:
        parts.append("flaky (passed after a failed attempt)")
    if d.expected_failure:
        parts.append(f"expected failure: {d.expected_failure}")
    if d.unexpected_pass:
        parts.append("unexpected pass")
    if d.owner_host:
        parts.append(f"on {d.owner_host}")
    exposed = beyond_loopback([e for e in d.listeners if isinstance(e, Mapping)])
    if exposed:
        parts.append(f"listens beyond loopback: {describe_listeners(exposed)}")
    return printable(" · ".join(parts))


def attempt_view(detail: AttemptDetail) -> AttemptView:
    checks = tuple(
        (clean(str(c.get("name", ""))), shorten(clean(str(c.get("message", ""))), CHECK_LIMIT))
        for c in detail.checks
        if isinstance(c, Mapping)
    )
    return AttemptView(
        detail=detail,
        label=status_label(shown_status(detail)),
        css=status_css(shown_status(detail)),
        campaign_href=links.campaign_page(detail.campaign_id),
        headline=_headline(detail),
        message=shorten(clean(detail.message), MESSAGE_LIMIT) if detail.message else "",
        checks=checks,
        completion=shorten(clean(detail.completion_excerpt), COMPLETION_LIMIT) if detail.completion_excerpt else "",
        facts=_facts(detail),
    )


@dataclass(frozen=True)
class MissingFix:
    key: str
    why: str
    href: str | None


class AttemptGroup(NamedTuple):
    """Consecutive attempts (newest first) that ended the same way: the newest shown whole, the others
    named ("6 attempts, same failure"; "20 attempts, all passed alike" for the repeats of a passing cell),
    so a page does not repeat one block six, or twenty, times."""

    view: AttemptView
    repeats: tuple[AttemptView, ...]

    @property
    def attempts(self) -> int:
        return 1 + len(self.repeats)

    @property
    def passed(self) -> bool:
        return self.view.detail.status == PASSED


# A runtime page stays bounded however long the history: each cell shows its newest SHOWN_ATTEMPTS
# attempts whole (logs included) and the one that stands for it; older ones are counts, a pass/fail trend
# and one line per failure (the newest LISTED_FAILURES). Inlining every log tail made a page of 10^5
# attempts 115 MB.
SHOWN_ATTEMPTS = 10
LISTED_FAILURES = 20
TREND_LIMIT = 200


class OlderAttempts(NamedTuple):
    """A cell's attempts older than those shown whole: how many, how they ended, and their failures."""

    attempts: int
    counts: str
    trend: str  # "P" pass, "F" failure, oldest first, the newest TREND_LIMIT of them
    trend_cut: bool
    failures: tuple[AttemptView, ...]  # newest first, one line each
    more_failures: int


class CellView(NamedTuple):
    anchor: str
    case: CaseView
    status: str
    label: str
    css: str
    flaky: bool
    missing: tuple[MissingFix, ...]
    attempts: tuple[AttemptView, ...]  # newest first
    groups: tuple[AttemptGroup, ...] = ()  # the same attempts, identical failures grouped
    older: OlderAttempts | None = None  # the attempts not in `attempts`


_DIGITS = re.compile(r"\d+")


def _outcome_key(view: AttemptView) -> tuple[str, ...]:
    """What makes two attempts "the same": status, kind, checks and message with numbers masked (ports,
    pids, timings and timestamps differ between attempts of one failure, or of one pass)."""
    d = view.detail
    checks = tuple(f"{name}: {_DIGITS.sub('#', message)}" for name, message in view.checks)
    message = _DIGITS.sub("#", "\n".join(line.split(" ", 1)[-1] for line in view.message.splitlines()))
    return (d.status, d.failure_kind or "", message, *checks)


def group_attempts(views: Iterable[AttemptView]) -> tuple[AttemptGroup, ...]:
    """Runs of consecutive identical attempts (failures, or passes alike) as one group each."""
    groups: list[AttemptGroup] = []
    last_key: tuple[str, ...] | None = None
    for view in views:
        key = _outcome_key(view)
        if groups and key == last_key:
            head = groups[-1]
            groups[-1] = AttemptGroup(head.view, (*head.repeats, view))
        else:
            groups.append(AttemptGroup(view, ()))
        last_key = key
    return tuple(groups)


def _missing(cell: ResultCell) -> tuple[MissingFix, ...]:
    fixes = {f.key: f for f in cell.case.info.required_fixes}
    found = []
    for why in cell.missing:
        key = next((k for k in fixes if f"lacks {k}:" in why), "")
        link = fixes[key].link if key else ""
        found.append(MissingFix(key, clean(why), links.external_url(link)))
    return tuple(found)


def _older(attempts: list[AttemptRow], details: Mapping[int, AttemptDetail]) -> OlderAttempts | None:
    """The summary of `attempts` (oldest first; summaries only: counts and trend need no message or log), with
    the newest LISTED_FAILURES failures whole from `details`; None for none."""
    if not attempts:
        return None
    history = pass_rate([a.status for a in attempts]).history
    failed = [a for a in reversed(attempts) if a.status in FAILED_STATUSES]
    return OlderAttempts(
        attempts=len(attempts),
        counts=counts_text(shown_status(a) for a in attempts),
        trend=history[-TREND_LIMIT:],
        trend_cut=len(history) > TREND_LIMIT,
        failures=tuple(attempt_view(details[a.id]) for a in failed[:LISTED_FAILURES]),
        more_failures=max(0, len(failed) - LISTED_FAILURES),
    )


def _split(cell: ResultCell) -> tuple[list[AttemptRow], list[AttemptRow]]:
    """(shown whole, newest first; older, oldest first): the newest SHOWN_ATTEMPTS, plus the attempt that
    decides the cell wherever it is in the history (it is always shown whole)."""
    attempts, last = cell.attempts, cell.latest
    shown = attempts[-SHOWN_ATTEMPTS:]
    older = attempts[: max(0, len(attempts) - SHOWN_ATTEMPTS)]
    if last is not None and all(a.id != last.id for a in shown):
        older = [a for a in older if a.id != last.id]
        shown = [last, *shown]
    return list(reversed(shown)), older


def page_attempt_ids(cells: Iterable[ResultCell]) -> set[int]:
    """The attempts a runtime page shows whole (every column, log tails too): per cell its newest
    SHOWN_ATTEMPTS, the one that decides it and the newest LISTED_FAILURES older failures. The rest of a long
    history is counted from the summaries the report already holds, so a page reads what it prints."""
    wanted: set[int] = set()
    for cell in cells:
        shown, older = _split(cell)
        wanted.update(a.id for a in shown)
        failed = [a for a in reversed(older) if a.status in FAILED_STATUSES]
        wanted.update(a.id for a in failed[:LISTED_FAILURES])
    return wanted


def cell_views(cells: list[ResultCell], details: Mapping[int, AttemptDetail]) -> Iterator[CellView]:
    """The cells of one runtime page, built one at a time as the template streams them; `details` holds
    every attempt of `page_attempt_ids(cells)` by id."""
    for cell in cells:
        last = cell.latest
        status = shown_status(last) if last else "none"
        shown, older = _split(cell)
        views = tuple(attempt_view(details[a.id]) for a in shown)
        yield CellView(
            anchor=links.cell_anchor(cell.case.name),
            case=cell.case,
            status=status,
            label=status_label(status),
            css=status_css(status),
            flaky=bool(last and last.flaky),
            missing=_missing(cell),
            attempts=views,
            groups=group_attempts(views),
            older=_older(older, details),
        )


class CampaignRow(NamedTuple):
    case: str
    runtime: str
    href: str
    attempt: AttemptRow
    label: str
    css: str
    reason: str  # why it was skipped; empty otherwise


@dataclass
class CampaignSummary:
    """What a campaign page lists: counts per runtime and status, and every attempt that did not pass
    cleanly (failures, skips, flaky passes). Passing attempts are counted, not listed: a campaign can
    hold tens of thousands of them, and their details are on the runtime pages."""

    attempts: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    by_runtime: dict[str, Counter[str]] = field(default_factory=dict)
    rows: list[CampaignRow] = field(default_factory=list)


def campaign_summaries(
    results: Results, reasons: Mapping[int, str] | None = None, whole: Container[int] | None = None
) -> dict[int, CampaignSummary]:
    """A summary per campaign in scope, built in one pass over the attempts (`reasons`: skipped attempts' why).
    With `whole`, only those campaigns' summaries are complete; the others count their attempts only (what the
    index shows of a campaign whose page a refresh leaves as it was)."""
    reasons = reasons or {}
    summaries: dict[int, CampaignSummary] = {}
    for cell in results.cells.values():
        for attempt in cell.attempts:
            summary = summaries.get(attempt.campaign_id)
            if summary is None:
                summary = summaries[attempt.campaign_id] = CampaignSummary()
            summary.attempts += 1
            if whole is not None and attempt.campaign_id not in whole:
                continue
            summary.counts[attempt.status] += 1
            summary.by_runtime.setdefault(cell.runtime.label, Counter())[attempt.status] += 1
            if attempt.status != PASSED or attempt.flaky:
                href = links.cell_href(cell.runtime.backend, cell.runtime.version, cell.case.name)
                label, css = status_label(attempt.status), status_css(attempt.status)
                reason = reasons.get(attempt.id, "")
                summary.rows.append(CampaignRow(cell.case.name, cell.runtime.label, href, attempt, label, css, reason))
    for summary in summaries.values():
        summary.rows.sort(key=lambda r: r.attempt.id)
    return summaries
