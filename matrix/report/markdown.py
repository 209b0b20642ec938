"""Markdown summaries for pull-request comments and ``$GITHUB_STEP_SUMMARY``.

Markdown renderers pass some HTML through and turn ``[text](url)`` into links, so every value from the
database is escaped: HTML's special characters become entities, Markdown's punctuation is
backslash-escaped, ``@`` gets a zero-width space (no mentions), and newlines become spaces so a table
row stays one row. Lists are capped, because a step summary is limited to 1 MiB.
"""

from __future__ import annotations

import re
from collections import Counter

from matrix.outcome import FAILED_STATUSES
from matrix.report.data import ResultCell, Results
from matrix.report.gate import GateResult
from matrix.report.views import STATUS_LABELS, status_label
from matrix.text import clean, shorten

__all__ = ["gate_markdown", "md", "results_markdown"]

MAX_ROWS = 100
TEXT_LIMIT = 200

_MD_PUNCTUATION = re.compile(r"([\\`*_{}\[\]()#+!|~])")
# "@name" after a space or at the start would notify someone; "case@runtime" would not.
_MENTION = re.compile(r"(^|[^\w])@")


def md(text: object, limit: int = TEXT_LIMIT) -> str:
    """`text` as inert Markdown on one line (see the module docstring)."""
    value = shorten(" ".join(clean(str(text)).split()), limit)
    value = value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    value = _MD_PUNCTUATION.sub(r"\\\1", value)
    return _MENTION.sub("\\1@\u200b", value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _capped(rows: list[list[str]], what: str) -> tuple[list[list[str]], list[str]]:
    if len(rows) <= MAX_ROWS:
        return rows, []
    return rows[:MAX_ROWS], ["", f"... and {len(rows) - MAX_ROWS} more {what} (see the HTML report)"]


def results_markdown(results: Results) -> str:
    """Counts per runtime, then every failure, flaky pass and unexpected pass."""
    cells = list(results.cells.values())
    counts = Counter(_status(c) for c in cells)
    summary = ", ".join(f"{n} {status_label(s).lower()}" for s, n in counts.most_common())
    scope = f"campaign {results.campaign_id}" if results.campaign_id is not None else "latest results"
    lines = [f"## matrix: {len(cells)} cells ({scope})", "", summary or "no cells", ""]

    statuses = [s for s in STATUS_LABELS if counts[s]]
    per_runtime: list[list[str]] = []
    for runtime in results.runtimes:
        mine = results.cells_of_runtime(runtime.id)
        here = Counter(_status(c) for c in mine)
        per_runtime.append([md(runtime.label)] + [str(here[s]) for s in statuses])
    if per_runtime:
        rows, more = _capped(per_runtime, "runtimes")
        lines += _table(["runtime"] + [status_label(s) for s in statuses], rows) + more + [""]

    failures = [c for c in cells if (last := c.latest) is not None and last.status in FAILED_STATUSES]
    if failures:
        rows, more = _capped([_failure_row(c) for c in sorted(failures, key=lambda c: c.key)], "failures")
        lines += [f"### Failures ({len(failures)})", ""]
        lines += _table(["cell", "status", "kind", "failed checks", "note"], rows) + more + [""]
    flaky = sorted((c for c in cells if c.latest and c.latest.flaky), key=lambda c: c.key)
    if flaky:
        lines += [f"### Flaky passes ({len(flaky)})", ""]
        lines += [f"- {md(c.key)}: passed on attempt {c.latest.attempt}" for c in flaky[:MAX_ROWS] if c.latest]
        lines += [""]
    surprising = sorted((c for c in cells if c.latest and c.latest.unexpected_pass), key=lambda c: c.key)
    if surprising:
        lines += [f"### Unexpected passes ({len(surprising)})", ""]
        lines += [f"- {md(c.key)}: {md('; '.join(c.missing))}" for c in surprising[:MAX_ROWS]] + [""]
    return "\n".join(lines)


def _status(cell: ResultCell) -> str:
    last = cell.latest
    return last.status if last else "none"


def _failure_row(cell: ResultCell) -> list[str]:
    last = cell.latest
    assert last is not None
    note = cell.expected_failure(last)
    return [
        md(cell.key),
        status_label(last.status),
        md(last.failure_kind or ""),
        md(", ".join(last.check_names)),
        md(f"expected: {note}" if note else ""),
    ]


def gate_markdown(result: GateResult) -> str:
    """The gate's verdict, every reason and the required cells."""
    runtime, policy = result.runtime, result.policy
    caveat = f" ({md(result.caveat)})" if result.caveat else ""
    lines = [
        f"## Release gate: **{result.verdict_text}**{caveat} for {md(runtime.backend)} {md(runtime.version)}",
        "",
        *([md(result.explanation), ""] if result.explanation else []),
        f"Required cells: {len(result.cells)} ({result.passed} passed)."
        + (" Required cells have not run and nothing found is wrong: run them and ask again." if result.incomplete
           else ""),
        "",
        f"Policy `{md(policy.name)}`: {md(policy.expression)} ("
        + ", ".join(f"{rule} {md(value)}" for rule, value, _ in policy.rule_lines())
        + f"); previous release {md(result.previous.version) if result.previous else 'none'}.",
        "",
    ]
    if result.reasons:
        rows = [["yes" if r.blocking else "no", md(r.kind), md(r.case), md(r.message, 400)] for r in result.reasons]
        capped, more = _capped(rows, "reasons")
        lines += _table(["blocks", "kind", "case", "reason"], capped) + more + [""]
    else:
        lines += ["Every required cell passed.", ""]
    if result.cells:
        rows = [
            [md(c.case.name), status_label(c.status), md(c.previous.status if c.previous else "-"),
             "yes" if c.blocking else "no"]
            for c in result.cells
        ]  # fmt: skip
        capped, more = _capped(rows, "cells")
        lines += ["### Required cells", "", *_table(["case", "status", "previous release", "blocks"], capped), *more]
    return "\n".join(lines) + "\n"
