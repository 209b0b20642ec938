"""JUnit XML (pytest's xunit2 flavour) for CI systems: one testsuite per runtime, one testcase per cell.

The xunit2 schema allows properties only on a testsuite, so each runtime is a suite that carries the
backend, version, tag, channel, provider and component versions; its testcases are the cells. A cell's
latest attempt decides its testcase: a pass is empty, a failure of any kind is a ``<failure>`` whose
text lists every failed check (the schema has no ``<error>`` element, so timeouts and interruptions
are failures whose ``type`` says which), a skip or a cell that never ran is ``<skipped>``. A pass that
needed retries carries the failed attempts as ``<flakyFailure>`` elements. ``<system-out>`` holds the
message and the tail of each process log, redacted.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence

from sqlalchemy.orm import Session

from matrix.outcome import FAILED_STATUSES, PASSED, standing_attempt
from matrix.report.data import AttemptDetail, ResultCell, Results, RuntimeView, load_details_of
from matrix.report.fmt import fmt_time
from matrix.report.skew import SkewGrid, skew_grids
from matrix.text import clean, log_tails, printable, shorten

__all__ = ["junit_xml"]

# Per log, in each testcase: CI systems keep whole files in memory, so tails are shorter than the pages'.
TAIL_LINES = 100
TAIL_BYTES = 16 * 1024
MESSAGE_ATTR_LIMIT = 300


def _seconds(value: float | None) -> str:
    return f"{value or 0.0:.3f}"


def _properties(suite: ET.Element, runtime: RuntimeView) -> None:
    props = ET.SubElement(suite, "properties")
    values = [
        ("backend", runtime.backend),
        ("version", runtime.version),
        ("tag", runtime.tag),
        ("channel", runtime.channel),
        ("provider", str(runtime.provider.get("kind", ""))),
    ] + [(f"component:{name}", version) for name, version in sorted(runtime.components.items())]
    for name, value in values:
        ET.SubElement(props, "property", name=clean(name), value=clean(value))


def _failure_summary(attempt: AttemptDetail) -> str:
    checks = [str(c.get("name", "")) for c in attempt.checks]
    head = attempt.failure_kind or attempt.status
    if checks:
        return f"{head}: {', '.join(checks)}"
    first_line = clean(attempt.message).strip().splitlines()[:1]
    return f"{head}: {first_line[0]}" if first_line else head


def _failure_text(attempt: AttemptDetail, cell: ResultCell) -> str:
    lines = [f"{c.get('name', '')}: {c.get('message', '')}" for c in attempt.checks]
    if attempt.message:
        lines.append(attempt.message)
    if expected := cell.expected_failure(attempt):
        lines.append("expected to fail: " + expected)
    return clean("\n".join(lines))


def _system_out(attempt: AttemptDetail, cell: ResultCell) -> str:
    parts = [
        f"cell {cell.key}, attempt {attempt.attempt} of campaign {attempt.campaign_id}, id {attempt.uid}",
        f"status {attempt.status}; started {fmt_time(attempt.started_at)}, finished {fmt_time(attempt.finished_at)}",
        f"worker ids: prefill {attempt.prefill_worker_id or '-'}, decode {attempt.decode_worker_id or '-'}",
    ]
    if attempt.unexpected_pass:
        parts.append("unexpected pass: the runtime lacks a required fix, yet the cell passed")
    if attempt.completion_excerpt:
        parts.append("completion excerpt: " + clean(attempt.completion_excerpt))
    for tail in log_tails(attempt.log_dir, max_lines=TAIL_LINES, max_bytes=TAIL_BYTES):
        cut = f" of {tail.size} bytes" if tail.truncated else ""
        parts.append(f"----- {tail.name}.log: last {tail.lines} line(s){cut} -----\n{tail.text}")
    return printable("\n".join(parts))  # the cell key holds catalog names


def _testcase(suite: ET.Element, cell: ResultCell, attempts: Sequence[AttemptDetail]) -> str:
    """Add the cell's testcase; return its outcome: passed, failed or skipped."""
    last = standing_attempt(attempts)
    case = ET.SubElement(
        suite, "testcase", classname=clean(cell.runtime.label), name=clean(cell.case.name),
        time=_seconds(last.total_s if last else None),
    )  # fmt: skip
    if last is None:
        ET.SubElement(case, "skipped", type="no-result", message="no attempt yet")
        return "skipped"
    outcome = "passed"
    if last.status in FAILED_STATUSES:
        outcome = "failed"
        failure = ET.SubElement(
            case, "failure", type=clean(f"{last.status}:{last.failure_kind or ''}").rstrip(":"),
            message=shorten(clean(_failure_summary(last)), MESSAGE_ATTR_LIMIT),
        )  # fmt: skip
        failure.text = _failure_text(last, cell)
    elif last.status != PASSED:
        outcome = "skipped"
        reason = clean(last.message) or last.status
        ET.SubElement(case, "skipped", type=clean(last.status), message=shorten(reason, MESSAGE_ATTR_LIMIT))
    elif last.flaky:
        for earlier in attempts:
            if earlier.campaign_id == last.campaign_id and earlier.attempt < last.attempt:
                flaky = ET.SubElement(
                    case, "flakyFailure", type=clean(earlier.failure_kind or earlier.status),
                    message=shorten(clean(_failure_summary(earlier)), MESSAGE_ATTR_LIMIT),
                )  # fmt: skip
                ET.SubElement(flaky, "system-out").text = _failure_text(earlier, cell)
    ET.SubElement(case, "system-out").text = _system_out(last, cell)
    return outcome


def _shown_details(session: Session, cells: Sequence[ResultCell]) -> dict[int, list[AttemptDetail]]:
    """Case id -> the attempts a testcase prints (oldest first): the standing attempt and, when it is a
    flaky pass, the earlier attempts of its campaign. The cells' summaries (the same rows, orphans shown
    as interrupted alike) choose them, so only those rows are read in full, not every cell's history."""
    wanted: dict[int, list[int]] = {}
    for cell in cells:
        last = standing_attempt(cell.attempts)
        if last is None:
            continue
        earlier: list[int] = []
        if last.status == PASSED and last.flaky:
            earlier = [a.id for a in cell.attempts if a.campaign_id == last.campaign_id and a.attempt < last.attempt]
        wanted[cell.case.id] = [*sorted(earlier), last.id]  # the standing one last: it stands in this list too
    found = load_details_of(session, [i for ids in wanted.values() for i in ids])
    return {case_id: [found[i] for i in ids] for case_id, ids in wanted.items()}


def junit_xml(session: Session, results: Results) -> bytes:
    """The JUnit XML document for the cells of `results` (their latest attempts), as UTF-8 bytes."""
    root = ET.Element("testsuites", name="matrix")
    totals = {"tests": 0, "failures": 0, "skipped": 0}
    total_time = 0.0
    for runtime in results.runtimes:
        cells = results.cells_of_runtime(runtime.id)
        details = _shown_details(session, cells)
        suite = ET.Element("testsuite", name=clean(runtime.label))
        _properties(suite, runtime)
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        suite_time = 0.0
        started = []
        host = ""
        for cell in cells:
            attempts = details.get(cell.case.id, [])
            counts[_testcase(suite, cell, attempts)] += 1
            last = standing_attempt(attempts)
            if last is not None:
                suite_time += last.total_s or 0.0
                host = host or last.owner_host
                if last.started_at is not None:
                    started.append(last.started_at)
        suite.set("tests", str(len(cells)))
        suite.set("failures", str(counts["failed"]))
        suite.set("errors", "0")
        suite.set("skipped", str(counts["skipped"]))
        suite.set("time", _seconds(suite_time))
        if started:
            suite.set("timestamp", min(started).isoformat(timespec="seconds"))
        if host:
            suite.set("hostname", clean(host))
        root.append(suite)
        totals["tests"] += len(cells)
        totals["failures"] += counts["failed"]
        totals["skipped"] += counts["skipped"]
        total_time += suite_time
    for grid in skew_grids(session, [c.name for c in results.cases], results.campaign_id):
        counts = _skew_suite(root, grid)
        totals["tests"] += sum(counts.values())
        totals["failures"] += counts["failed"]
        totals["skipped"] += counts["skipped"]
    root.set("tests", str(totals["tests"]))
    root.set("failures", str(totals["failures"]))
    root.set("errors", "0")
    root.set("time", _seconds(total_time))
    ET.indent(root)
    return bytes(ET.tostring(root, encoding="utf-8", xml_declaration=True))


# Skew classes that are findings (the pair is broken in a way users meet); works and clean-reject pass.
SKEW_FINDINGS = frozenset({"hang", "error-answer", "healthy-but-wrong", "crash", "exposed"})


def _skew_suite(root: ET.Element, grid: SkewGrid) -> dict[str, int]:
    """A testsuite `skew CASE` with a testcase per skew pair (the diagonal is in its runtime's suite): a
    finding class fails, not-run is skipped, works and clean-reject (an honest refusal) pass."""
    suite = ET.SubElement(root, "testsuite", name=clean(f"skew {grid.case}"))
    properties = ET.SubElement(suite, "properties")
    for name, value in (("backend", grid.backend), ("case", grid.case), ("versions", " ".join(grid.versions))):
        ET.SubElement(properties, "property", name=name, value=clean(value))
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for entry in (e for e in grid.entries if e.skewed):
        case = ET.SubElement(suite, "testcase", classname=clean(f"{grid.backend} skew"), name=clean(entry.cell),
                             time="0")  # fmt: skip
        summary = shorten(clean(f"{entry.verdict.cls}: {entry.verdict.reason}"), MESSAGE_ATTR_LIMIT)
        if entry.verdict.cls in SKEW_FINDINGS:
            counts["failed"] += 1
            ET.SubElement(case, "failure", type=entry.verdict.cls, message=summary).text = clean(entry.verdict.reason)
        elif entry.verdict.cls == "not-run":
            counts["skipped"] += 1
            ET.SubElement(case, "skipped", type="not-run", message=summary)
        else:
            counts["passed"] += 1
        roles = ", ".join(f"{role} {version}" for role, version in entry.roles.items())
        ET.SubElement(case, "system-out").text = printable(
            f"cell {entry.cell} ({roles}), attempt {entry.uid} of campaign {entry.campaign_id}: {summary}"
        )
    suite.set("tests", str(sum(counts.values())))
    suite.set("failures", str(counts["failed"]))
    suite.set("errors", "0")
    suite.set("skipped", str(counts["skipped"]))
    suite.set("time", "0")
    return counts
