"""The detection table ([M28]): per KV fault class, how many cells the default checks caught, with the Wilson
95 % interval, and which check caught each first; and the healthy twin's false alarms (A/A).

Read from the attempts of cases with a `kv_fault` (`matrix.check.faults`), as `outcome.judge_fault` left them:

* a fault cell that **passed** fired and was caught; its first failed check (the checks are recorded in the
  order they ran) is the one that caught it first;
* one that **failed** with `fault_undetected` fired and every check passed: missed;
* one **skipped** "not exercised" never fired (a pair that never came up included): it counts for nothing,
  and so do attempts that ended without evidence (interrupted; config, provision, recipe or infra failures);
* a healthy twin (`kv_fault = "none"`) that **failed**, erred or timed out on its own is a false alarm, named
  by its first failed check.

A release manager reads "what would this campaign have missed?" from the rate's lower bound: a class caught in
30 of 30 cells is caught in at least 88.6 % of such cells (95 %), not in all of them. "Caught without the
oracle" counts the caught cells where a check other than the equivalence oracle failed too: what a campaign
whose cases run no oracle would have caught.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.db.models import CellRun
from matrix.errors import ConfigError
from matrix.kv_faults import CLASSES, NONE, parse
from matrix.outcome import CELL_FAULT_STATUSES, FAILED, FINISHED_STATUSES, NO_EVIDENCE_KINDS, PASSED, SKIPPED
from matrix.report.data import load_cases, load_runtimes
from matrix.report.stats import wilson

__all__ = ["DetectionRow", "detection_table", "markdown"]

UNDETECTED = "fault_undetected"
# The equivalence oracle's check (`matrix.check.oracle.CHECK_NAME`; report may not import check).
ORACLE = "equivalent_to_aggregated"


@dataclass
class DetectionRow:
    """One fault class (or the healthy twin, `none`) on one runtime."""

    fault: str
    runtime: str
    cells: int = 0  # with evidence: caught + missed (fault), passed + false alarms (healthy)
    flagged: int = 0  # caught (a fault class) or false alarms (the healthy twin)
    not_exercised: int = 0
    no_evidence: int = 0
    fired: int = 0  # effective injections, summed over the cells
    # Caught by a check other than the equivalence oracle too: what a case without the oracle would catch.
    without_oracle: int = 0
    first: Counter[str] = field(default_factory=Counter)  # the check that caught it (or alarmed) first

    @property
    def healthy(self) -> bool:
        return self.fault == NONE

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.flagged, self.cells)

    def rate_text(self) -> str:
        if not self.cells:
            return "-"
        low, high = self.interval
        return f"{self.flagged}/{self.cells} = {self.flagged / self.cells:.1%} [{low:.1%}, {high:.1%}]"

    def first_text(self) -> str:
        return ", ".join(f"{name} {count}" for name, count in self.first.most_common()) or "-"

    def as_dict(self) -> dict[str, Any]:
        low, high = self.interval
        return {
            "fault": self.fault, "runtime": self.runtime, "cells": self.cells,
            "false_alarms" if self.healthy else "caught": self.flagged,
            "rate": self.flagged / self.cells if self.cells else None, "wilson95": [low, high] if self.cells else None,
            "not_exercised": self.not_exercised, "no_evidence": self.no_evidence, "fired": self.fired,
            "without_oracle": self.without_oracle,
            "first": dict(self.first.most_common()),
        }  # fmt: skip


def _first_check(checks: Iterable[Any], skip: str = "") -> str:
    for check in checks or ():
        name = str(check.get("name", "")) if isinstance(check, dict) else ""
        if name and name != skip:
            return name
    return ""


def _fired(message: str) -> int:
    """The injections `judge_fault` wrote into the message ("kv fault C on R fired N times ...")."""
    head = message.split(" fired ", 1)
    if len(head) < 2:
        return 0
    count = head[1].split(" ", 1)[0]
    return int(count) if count.isdigit() else 0


def detection_table(
    session: Session, campaigns: Iterable[int] = (), runtimes: Iterable[str] = ()
) -> list[DetectionRow]:
    """The table's rows, by class in the plugin's order (the healthy twin first), then runtime; `campaigns`
    and `runtimes` (`BACKEND=V` labels or bare versions) narrow the attempts read. Fault cases only."""
    faults: dict[int, str] = {}
    for case in load_cases(session):
        spec = case.info.launch.kv_fault
        if not spec:
            continue
        try:
            faults[case.id] = parse(spec).fault
        except ConfigError:
            continue  # a value the arm refused: its cells never ran a fault
    labels = {r.id: f"{r.backend}={r.version}" for r in load_runtimes(session)}
    wanted = set(runtimes)
    query = select(CellRun.case_id, CellRun.runtime_id, CellRun.status, CellRun.failure_kind, CellRun.message,
                   CellRun.checks).where(CellRun.case_id.in_(faults))  # fmt: skip
    if chosen := list(campaigns):
        query = query.where(CellRun.campaign_id.in_(chosen))
    rows: dict[tuple[str, str], DetectionRow] = {}
    for case_id, runtime_id, status, kind, message, checks in session.execute(query):
        if status not in FINISHED_STATUSES:
            continue
        label = labels.get(runtime_id, str(runtime_id))
        if wanted and label not in wanted and label.split("=", 1)[-1] not in wanted:
            continue
        fault = faults[case_id]
        row = rows.setdefault((fault, label), DetectionRow(fault, label))
        names = [str(c.get("name", "")) for c in checks or () if isinstance(c, dict)]
        missed = status == FAILED and UNDETECTED in names
        alarm = fault == NONE and status in CELL_FAULT_STATUSES  # a hang (timeout) of the healthy twin too
        evidence = kind not in NO_EVIDENCE_KINDS and (status == PASSED or missed or alarm)
        if not evidence:
            if status == SKIPPED and str(message).startswith("not exercised"):
                row.not_exercised += 1
            else:
                row.no_evidence += 1
            continue
        row.cells += 1
        if fault == NONE:
            if alarm:
                row.flagged += 1
                row.first[_first_check(checks) or str(kind)] += 1
            continue
        row.fired += _fired(str(message))
        if status == PASSED:  # fired and caught (`judge_fault`)
            row.flagged += 1
            row.without_oracle += any(name not in (ORACLE, UNDETECTED) for name in names)
            row.first[_first_check(checks, skip=UNDETECTED) or "failed without a named check"] += 1
    order = {name: i for i, name in enumerate((NONE, *CLASSES))}
    return sorted(rows.values(), key=lambda r: (order.get(r.fault, len(order)), r.fault, r.runtime))


COLUMNS = ("class", "runtime", "cells", "caught (healthy: false alarms), Wilson 95 %", "first caught by",
           "caught without the oracle", "not exercised", "injections")  # fmt: skip


def table_rows(rows: Iterable[DetectionRow]) -> list[tuple[str, ...]]:
    return [
        (f"{r.fault} (A/A)" if r.healthy else r.fault, r.runtime, str(r.cells), r.rate_text(), r.first_text(),
         "-" if r.healthy else f"{r.without_oracle}/{r.cells}", str(r.not_exercised),
         "-" if r.healthy else str(r.fired))
        for r in rows
    ]  # fmt: skip


def markdown(rows: list[DetectionRow]) -> str:
    """The table as Markdown (for docs/results/detection.md)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table_rows(rows)]
    return "\n".join(lines) + "\n"
