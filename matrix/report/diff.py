"""What changed between two campaigns, cell by cell ([M30] item 5): `matrix diff A B` and the report's
"since the last campaign" page.

A cell is a (case, runtime, roles) triple, as in `matrix.report.episodes`: a skew pair is its own cell. Within
each campaign the attempt that stands for a cell is `outcome.standing_attempt` of that campaign's attempts
alone, so an earlier campaign's pass never hides this one's failure. Cells fall into:

* **new failures**: failed in B, passed in A or not there (or only skipped or interrupted there);
* **still failing**: failed in both;
* **fixed**: failed in A, passed in B;
* **newly slow**: passed in both and a metric of B's passed attempts is significantly worse than A's
  (`matrix.report.perf.compare_metrics`, the rule of `matrix compare`); with too few samples or without
  scipy the cell is **insufficient data** (or `slower (not tested)` when past the threshold), never
  "unchanged": one run a side cannot say a runtime did not get slower;
* **not run**: in A with a pass or a failure, and in B not at all or only skipped or interrupted.

Failures are grouped by a *signature*: the failure kind and the first line of the message with what
differs from cell to cell for one cause (numbers, hex ids, uuids, paths, hosts and ports) written as
placeholders, so fifty cells failing for one reason read as one line with fifty members.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from matrix.db.models import Backend, Campaign, Case, CellRun, Runtime
from matrix.errors import ConfigError
from matrix.outcome import CELL_FAULT_STATUSES, PASSED, standing_attempt
from matrix.report.compare import SLOWER_UNTESTED, testable, untested_slowdowns
from matrix.report.perf import MetricVerdict, Samples, attempt_metrics, compare_metrics
from matrix.report.stats import DEFAULT_ALPHA, DEFAULT_THRESHOLD, significance_available
from matrix.text import clean, shorten

__all__ = [
    "CATEGORIES",
    "FAIL_ON",
    "CampaignDiff",
    "Group",
    "Member",
    "diff_campaigns",
    "latest_pair",
    "normalise",
    "resolve_campaign",
    "signature",
]

SIGNATURE_CHARS = 200
# A message's first line is all a signature reads; the rest (log tails) is cut in SQL, not carried.
MESSAGE_CHARS = 2000
INSUFFICIENT = "insufficient data"
CATEGORIES = ("new failures", "still failing", "fixed", "newly slow", "not run")
# What `matrix diff --fail-on` exits 1 for: new failures by default, the release manager's first question.
FAIL_ON: Mapping[str, tuple[str, ...]] = {
    "never": (),
    "new": ("new failures",),
    "slow": ("new failures", "newly slow"),
    "failure": ("new failures", "newly slow", "still failing"),
}

# The normaliser's rules, in order: earlier ones remove what later ones would cut into pieces (a uuid's
# digit groups, a URL's port, a path's numbered directories).
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_UUID = re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")
_URL = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*)://(\[[0-9A-Fa-f:.]+\]|[^\s/:'\"<>]+)(:\d+)?(/[^\s'\"<>]*)?")
_IPV4 = r"\d{1,3}(?:\.\d{1,3}){3}"
_HOST_PORT = re.compile(rf"(?<![\w.])(?:{_IPV4}|localhost|\[[0-9A-Fa-f:.]+\]|[A-Za-z][\w-]*(?:\.[\w-]+)+):\d{{1,5}}\b")
_IP = re.compile(rf"(?<![\w.]){_IPV4}(?![\w.])")
_PORT_WORD = re.compile(r"\b(ports?)(\s*[=:]?\s*)\d{1,5}\b", re.IGNORECASE)
_WIN_PATH = re.compile(r"(?<![\w])[A-Za-z]:\\[^\s'\"<>]+")
# Two components or more ("/tmp/x", "./logs/a"): one ("/v1", "tokens/s") is too often not a path.
_PATH = re.compile(r"(?<![\w<>/])(?:~|\.{1,2})?(?:/[\w.@+%=-]+){2,}/?|(?<![\w<>/])~/[\w.@+%=-]+")
_HEX_PREFIXED = re.compile(r"\b0[xX][0-9a-fA-F]+\b")
# A run of 6+ hex digits with a digit and a letter in it: a sha, a container or request id ("decade",
# "facade" and "1234567" are not).
_HEX_ID = re.compile(r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{6,}\b")
# A number standing alone, with its decimals and exponent; a unit may follow ("12.5s" -> "<n>s"), but a
# number inside a word ("h100", "e2e", "sm90") is part of a name and stays.
_NUMBER = re.compile(r"(?<![A-Za-z0-9_.])\d+(?:\.\d+)*(?:[eE][-+]?\d+)?")
_SPACE = re.compile(r"\s+")


def normalise(line: str) -> str:
    """One line of a failure with what varies between cells failing for one reason written as placeholders:
    uuids and hex ids `<id>`, paths `<path>`, hosts `<host>`, ports `<port>`, numbers `<n>`."""
    text = _ANSI.sub("", line)
    text = _UUID.sub("<id>", text)

    def url(match: re.Match[str]) -> str:
        port = ":<port>" if match.group(3) else ""
        return f"{match.group(1)}://<host>{port}{match.group(4) or ''}"

    text = _URL.sub(url, text)
    text = _HOST_PORT.sub("<host>:<port>", text)
    text = _IP.sub("<host>", text)
    text = _PORT_WORD.sub(lambda m: f"{m.group(1)}{m.group(2)}<port>", text)
    text = _WIN_PATH.sub("<path>", text)
    text = _PATH.sub("<path>", text)
    text = _HEX_PREFIXED.sub("<id>", text)
    text = _HEX_ID.sub("<id>", text)
    text = _NUMBER.sub("<n>", text)
    return _SPACE.sub(" ", text).strip()


def signature(status: str, failure_kind: str | None, message: str, checks: Sequence[Any] = ()) -> str:
    """A failure's signature: its kind, then its message's first line normalised (`normalise`), or the names
    of its failed checks when the message is empty."""
    kind = failure_kind or status
    first = next((line for line in (message or "").splitlines() if line.strip()), "")
    if not first:
        first = ", ".join(sorted({str(c.get("name")) for c in checks if isinstance(c, Mapping) and c.get("name")}))
    text = normalise(clean(first))
    return shorten(f"{kind}: {text}" if text else kind, SIGNATURE_CHARS)


class _Row(NamedTuple):
    id: int
    campaign_id: int
    key: tuple[int, int, str]
    uid: str
    status: str
    failure_kind: str | None
    message: str
    checks: Any
    metrics: dict[str, float]


@dataclass(frozen=True)
class Side:
    """A cell's standing attempt in one campaign."""

    uid: str
    status: str
    failure_kind: str | None
    signature: str

    def as_dict(self) -> dict[str, Any]:
        return {"uid": self.uid, "status": self.status, "failure_kind": self.failure_kind,
                "signature": self.signature}  # fmt: skip


@dataclass(frozen=True)
class Member:
    """One cell of a category: case, runtime label (with a skew pair's roles), each side, and a note (the
    metrics of a slowdown, why a cell counts as not run)."""

    case: str
    runtime: str
    a: Side | None
    b: Side | None
    note: str = ""
    # The runtime's backend and version apart, for a link to the cell on its runtime page (a skew pair's
    # cell, with `roles`, lives on its case's skew page instead).
    backend: str = ""
    version: str = ""
    roles: str = ""

    @property
    def cell(self) -> str:
        return f"{self.case}@{self.runtime}"

    def as_dict(self) -> dict[str, Any]:
        return {"case": self.case, "runtime": self.runtime, "a": self.a.as_dict() if self.a else None,
                "b": self.b.as_dict() if self.b else None, "note": self.note}  # fmt: skip


@dataclass(frozen=True)
class Group:
    """The failures that share a signature."""

    signature: str
    members: tuple[Member, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"signature": self.signature, "cells": len(self.members),
                "members": [m.as_dict() for m in self.members]}  # fmt: skip


@dataclass(frozen=True)
class CampaignDiff:
    a: int
    b: int
    new_failures: tuple[Group, ...] = ()
    still_failing: tuple[Group, ...] = ()
    fixed: tuple[Member, ...] = ()
    newly_slow: tuple[Member, ...] = ()
    not_run: tuple[Member, ...] = ()
    # Passed in both, and what the timings could not decide: too few samples, or no significance test.
    insufficient: tuple[Member, ...] = ()
    unchanged: int = 0  # passed in both, no metric regressed under the test
    new_passing: int = 0  # passed in B, not in A
    threshold: float = DEFAULT_THRESHOLD
    alpha: float = DEFAULT_ALPHA
    significance_missing: bool = False

    @property
    def title(self) -> str:
        return f"campaign {self.a} -> campaign {self.b}"

    def cells(self, category: str) -> int:
        found: Sequence[Any] = {
            "new failures": self.new_failures, "still failing": self.still_failing, "fixed": self.fixed,
            "newly slow": self.newly_slow, "not run": self.not_run,
        }[category]  # fmt: skip
        return sum(len(g.members) for g in found) if category in ("new failures", "still failing") else len(found)

    def counts(self) -> dict[str, int]:
        """Cells per category, the empty ones left out; then the passing cells the diff says nothing of."""
        counts = {c: self.cells(c) for c in CATEGORIES}
        counts |= {INSUFFICIENT: len(self.insufficient), "unchanged": self.unchanged, "new passing": self.new_passing}
        return {name: n for name, n in counts.items() if n}

    def failing(self, fail_on: str) -> list[str]:
        """The categories `--fail-on FAIL_ON` exits 1 for that have cells."""
        return [c for c in FAIL_ON[fail_on] if self.cells(c)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "a": self.a, "b": self.b, "counts": self.counts(),
            "new_failures": [g.as_dict() for g in self.new_failures],
            "still_failing": [g.as_dict() for g in self.still_failing],
            "fixed": [m.as_dict() for m in self.fixed],
            "newly_slow": [m.as_dict() for m in self.newly_slow],
            "not_run": [m.as_dict() for m in self.not_run],
            "insufficient_data": [m.as_dict() for m in self.insufficient],
            "unchanged": self.unchanged, "new_passing": self.new_passing,
            "threshold": self.threshold, "alpha": self.alpha, "significance_tested": not self.significance_missing,
        }  # fmt: skip

    def lines(self) -> list[str]:
        """The diff for a terminal, in `matrix compare`'s manner: a heading per category, a line per
        signature with its cells."""
        out = [f"{self.title}: " + (", ".join(f"{n} {name}" for name, n in self.counts().items()) or "no cells")]
        for name, groups in (("new failures", self.new_failures), ("still failing", self.still_failing)):
            if groups:
                out.append(f"{name} ({self.cells(name)} cells, {len(groups)} signatures):")
                for group in groups:
                    out.append(f"  [{len(group.members)}] {group.signature}")
                    out.extend(f"      {m.cell}" + (f" (was {m.a.status})" if m.a else "") for m in group.members)
        for name, members in (("fixed", self.fixed), ("newly slow", self.newly_slow), ("not run", self.not_run),
                              (INSUFFICIENT, self.insufficient)):  # fmt: skip
            if members:
                out.append(f"{name} ({len(members)}):")
                out.extend(f"  {m.cell}" + (f": {m.note}" if m.note else "") for m in members)
        if self.significance_missing:
            out.append("significance not tested: newly slow needs scipy (pip install 'disagg-matrix[stats]'); a "
                       f"slowdown past the threshold is '{SLOWER_UNTESTED}'")  # fmt: skip
        return out


def resolve_campaign(session: Session, text: str) -> int:
    """A campaign id from the command line: a number, `last` (the newest campaign) or `last~N` (N before it)."""
    spec = text.strip().lower()
    if spec.isdigit():
        if session.get(Campaign, int(spec)) is None:
            raise ConfigError(f"no campaign {text}: `matrix campaigns list` shows them")
        return int(spec)
    match = re.fullmatch(r"last(?:~(\d+))?", spec)
    if match is None:
        raise ConfigError(f"campaign {text!r}: give an id, `last` or `last~N` (N campaigns before the last)")
    back = int(match.group(1) or 0)
    ids = list(session.scalars(select(Campaign.id).order_by(Campaign.id.desc()).offset(back).limit(1)))
    if not ids:
        raise ConfigError(f"campaign {text}: there are not {back + 1} campaigns; `matrix campaigns list` shows them")
    return int(ids[0])


def latest_pair(campaign_ids: Iterable[int]) -> tuple[int, int] | None:
    """The newest campaign and the one before it, for the report's page; None with fewer than two."""
    ids = sorted(set(campaign_ids))
    return (ids[-2], ids[-1]) if len(ids) >= 2 else None


def _decoded(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _rows(session: Session, campaigns: Sequence[int]) -> list[_Row]:
    """Every attempt of `campaigns`, oldest first, with its metrics when it passed."""
    stmt = (
        select(CellRun.id, CellRun.campaign_id, CellRun.case_id, CellRun.runtime_id, CellRun.roles_key, CellRun.uid,
               CellRun.status, CellRun.failure_kind, func.substr(CellRun.message, 1, MESSAGE_CHARS), CellRun.checks,
               CellRun.ready_s, CellRun.ttft_s, CellRun.request_s, CellRun.completion_tokens, CellRun.kv_ledger,
               CellRun.peaks)
        .where(CellRun.campaign_id.in_(list(campaigns)))
        .order_by(CellRun.id)
    )  # fmt: skip
    rows = []
    for (rid, campaign, case, runtime, roles, uid, status, kind, message, checks, ready, ttft, request, tokens,
         ledger, peaks) in session.execute(stmt):  # fmt: skip
        metrics: dict[str, float] = {}
        if status == PASSED:
            found = _decoded(peaks)
            traffic = found.get("traffic") if isinstance(found, dict) else None
            metrics = attempt_metrics(ready, ttft, request, tokens, _decoded(ledger), traffic)
        rows.append(_Row(rid, campaign, (case, runtime, roles or ""), uid, status, kind, message or "",
                         _decoded(checks) or (), metrics))  # fmt: skip
    return rows


def _klass(row: _Row | None) -> str:
    """pass, fail, or none: a skip, a not-run or an interruption says nothing about the runtime."""
    if row is None:
        return "none"
    if row.status == PASSED:
        return "pass"
    return "fail" if row.status in CELL_FAULT_STATUSES else "none"


def _side(row: _Row | None) -> Side | None:
    if row is None:
        return None
    sig = signature(row.status, row.failure_kind, row.message, row.checks) if _klass(row) == "fail" else ""
    return Side(row.uid, row.status, row.failure_kind, sig)


def _samples(rows: Sequence[_Row]) -> Samples:
    found: Samples = {}
    for row in rows:
        if row.status == PASSED:
            for name, value in row.metrics.items():
                found.setdefault(name, []).append(value)
    return found


def _grouped(members: Iterable[Member]) -> tuple[Group, ...]:
    by: dict[str, list[Member]] = {}
    for member in members:
        assert member.b is not None
        by.setdefault(member.b.signature, []).append(member)
    groups = [Group(sig, tuple(sorted(found, key=lambda m: (m.case, m.runtime)))) for sig, found in by.items()]
    return tuple(sorted(groups, key=lambda g: (-len(g.members), g.signature)))


def _labels(session: Session) -> tuple[dict[int, str], dict[int, tuple[str, str]]]:
    cases = {case_id: name for case_id, name in session.execute(select(Case.id, Case.name))}
    runtimes = {
        runtime_id: (str(backend), str(version))
        for runtime_id, backend, version in session.execute(
            select(Runtime.id, Backend.name, Runtime.version).join(Backend, Runtime.backend_id == Backend.id)
        )
    }
    return cases, runtimes


def _metric_note(metrics: Sequence[MetricVerdict]) -> str:
    return "; ".join(m.text() for m in metrics)


def diff_campaigns(
    session: Session, a: int, b: int, threshold: float = DEFAULT_THRESHOLD, alpha: float = DEFAULT_ALPHA
) -> CampaignDiff:
    """Campaign `a` (older) against `b` (newer), cell by cell (see the module docstring)."""
    per_cell: dict[tuple[int, int, str], dict[int, list[_Row]]] = {}
    for row in _rows(session, (a, b)):
        per_cell.setdefault(row.key, {}).setdefault(row.campaign_id, []).append(row)
    cases, runtimes = _labels(session)
    significance = significance_available()
    new: list[Member] = []
    still: list[Member] = []
    fixed: list[Member] = []
    slow: list[Member] = []
    not_run: list[Member] = []
    insufficient: list[Member] = []
    unchanged = new_passing = 0
    for key, sides in per_cell.items():
        case_id, runtime_id, roles = key
        rows_a, rows_b = sides.get(a, []), sides.get(b, [])
        ra, rb = standing_attempt(rows_a), standing_attempt(rows_b)
        ka, kb = _klass(ra), _klass(rb)
        backend, version = runtimes.get(runtime_id, ("runtime", str(runtime_id)))
        label = f"{backend}-{version}" + (f"[{roles}]" if roles else "")
        name = cases.get(case_id, f"case {case_id}")

        def member(note: str = "") -> Member:
            # Called within this iteration only, so the loop's variables are this cell's.
            return Member(name, label, _side(ra), _side(rb), note, backend, version, roles)  # noqa: B023

        if kb == "fail":
            (still if ka == "fail" else new).append(member())
        elif kb == "pass" and ka == "fail":
            fixed.append(member())
        elif kb == "pass" and ka == "pass":
            metrics = compare_metrics(_samples(rows_a), _samples(rows_b), threshold, alpha, need_p=significance)
            regressed = [m for m in metrics if m.regression]
            untested = untested_slowdowns(metrics, threshold) if not significance else []
            if regressed:
                slow.append(member(_metric_note(regressed)))
            elif untested:
                slow.append(member(f"{SLOWER_UNTESTED}: {_metric_note(untested)}"))
            elif not any(testable(m) for m in metrics) or not significance:
                why = "too few passed attempts a side to test (2+ needed)" if significance else "no significance test"
                insufficient.append(member(why))
            else:
                unchanged += 1
        elif kb == "pass":
            new_passing += 1
        elif ka != "none":  # in A with a result, in B absent or only skipped or interrupted
            note = f"{rb.status} in campaign {b}" if rb is not None else f"not in campaign {b}"
            not_run.append(member(note))

    def by_cell(found: list[Member]) -> tuple[Member, ...]:
        return tuple(sorted(found, key=lambda m: (m.case, m.runtime)))

    return CampaignDiff(a, b, _grouped(new), _grouped(still), by_cell(fixed), by_cell(slow), by_cell(not_run),
                        by_cell(insufficient), unchanged, new_passing, threshold, alpha,
                        significance_missing=not significance)  # fmt: skip
