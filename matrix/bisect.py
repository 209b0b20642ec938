"""`matrix bisect`: the first version between a good and a bad runtime at which a case changes outcome.

Every probe is a normal attempt of one *bisect campaign*: the cell is appended to the campaign's stored
selection with a `pending` row and run by `run_campaign` with a `resume` start, the same path as `matrix run
--resume`, so it is recorded, shown, reported and exported like any other attempt. The search itself
(`next_probe`) is a pure function of the verdicts known so far, so a bisect stopped by Ctrl-C continues
from its recorded attempts when the same command is run again.

Deterministic failures: the bad end is probed once (does it really fail?), then a binary search over the
versions between: at most 1 + ceil(log2(n - 1)) <= ceil(log2 n) + 1 cells for n versions. With
`--repeat K` every probe runs K times; any failure makes a version bad, a mix of passes and failures
makes it *flaky*, and a version that passed K times is reported *unsure* when a flaky failure was seen
(such a failure passes K times with probability (1 - observed failure rate) ** K).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from matrix import __version__
from matrix.catalog.queries import plan_from_db
from matrix.cells import Cell
from matrix.db.engine import transaction
from matrix.db.models import Campaign, CellRun
from matrix.errors import ConfigError
from matrix.outcome import FAILED_STATUSES
from matrix.plan import Selection
from matrix.text import excerpt
from matrix.versions import parse_version

PASSED, FAILED = "passed", "failed"
# Outcomes that say something about the version; skipped/interrupted/not-run say nothing.
DECISIVE = frozenset({"passed"}) | (FAILED_STATUSES - {"interrupted"})

Echo = Callable[[str], None]


@dataclass
class Probe:
    index: int
    version: str
    statuses: list[str] = field(default_factory=list)  # finished attempts, oldest first
    messages: list[str] = field(default_factory=list)
    uids: list[str] = field(default_factory=list)
    skipped: str = ""  # why this version gave no outcome (not provisionable here, skipped): stepped around

    @property
    def verdict(self) -> str:
        """good | bad | flaky (mixed: counted bad) | skip (no outcome: stepped around) | unknown."""
        decisive = [s for s in self.statuses if s in DECISIVE]
        if not decisive:
            return "skip" if self.skipped else "unknown"
        fails = sum(1 for s in decisive if s != PASSED)
        if fails == 0:
            return "good"
        return "bad" if fails == len(decisive) else "flaky"


@dataclass
class BisectResult:
    campaign_id: int
    case: str
    backend: str
    versions: list[str]
    good: str
    bad: str
    probes: list[Probe]
    first: str | None = None  # the oldest version with the newer end's outcome (first bad, or first good)
    last_other: str | None = None  # the version just before it
    direction: str = "first bad"  # or "first good" when GOOD is the newer end
    unsure: list[str] = field(default_factory=list)
    note: str = ""
    cells_run: int = 0  # attempts this invocation ran (a resumed bisect reuses earlier ones)
    confidence: float | None = None  # the posterior of `first` (probabilistic bisection only)
    # The good end's version when it was taken as given (never run in this bisect): the result rests on it.
    assumed_good: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "campaign": self.campaign_id, "case": self.case, "backend": self.backend, "good": self.good,
            "bad": self.bad, "versions": len(self.versions), "direction": self.direction, "first": self.first,
            "last_other": self.last_other, "unsure": self.unsure, "note": self.note, "cells_run": self.cells_run,
            "confidence": self.confidence, "assumed_good": self.assumed_good,
            "attempts": sum(len(p.statuses) for p in self.probes),
            "probes": [{"version": p.version, "verdict": p.verdict, "statuses": p.statuses,
                        "messages": p.messages, "attempts": p.uids, "skipped": p.skipped} for p in self.probes],
        }  # fmt: skip


def max_cells(n: int) -> int:
    """The deterministic bound this bisection keeps: ceil(log2 n) + 1 cells for n versions."""
    return math.ceil(math.log2(n)) + 1 if n > 1 else 1


def next_probe(n: int, bad_index: int, verdicts: dict[int, str]) -> tuple[int | None, int | None]:
    """(index to probe next, None) or (None, index of the oldest version with the newer end's outcome).

    `bad_index` is 0 (the bad end is the oldest: searching for the first *good* version) or n - 1.
    The good end is taken as given; `verdicts[i]` is "good", "bad" or "flaky" (counted bad). Returns
    (None, None) when the bad end does not fail: there is nothing to bisect.
    """
    if bad_index not in verdicts:
        return bad_index, None
    if verdicts[bad_index] == "good":
        return None, None
    # Walk from the oldest version: lo has the old end's outcome, hi the new end's. A version that gave no
    # outcome ("skip") is stepped around, as `git bisect skip` does: the nearest untried one to the middle.
    new_is_bad = bad_index == n - 1
    lo, hi = 0, n - 1
    while hi - lo > 1:
        candidates = [i for i in range(lo + 1, hi) if verdicts.get(i) != "skip"]
        if not candidates:
            return None, hi  # every version between gave no outcome: the caller names them as unsure
        middle = (lo + hi) // 2
        mid = min(candidates, key=lambda i: (abs(i - middle), i))
        if mid not in verdicts:
            return mid, None
        is_bad = verdicts[mid] != "good"
        if is_bad == new_is_bad:
            hi = mid
        else:
            lo = mid
    return None, hi


def _bisect_params(case: str, backend: str, good: str, bad: str, repeat: int) -> dict[str, Any]:
    return {"case": case, "backend": backend, "good": good, "bad": bad, "repeat": repeat}


def _cells(session: Session, case: str, backend: str | None, good: str, bad: str) -> tuple[str, list[Cell], int]:
    """(backend, the case's cells on every planned runtime between GOOD and BAD sorted by version, bad's index)."""
    selection = Selection(cases=(case,), backends=(backend,) if backend else (), strict_markers=False)
    cells = list(plan_from_db(session, selection).cells)
    if not cells:
        where = f" on backend {backend!r}" if backend else ""
        raise ConfigError(
            f"case {case!r} has no runnable cell{where}; "
            f"see `matrix cases list` and `matrix plan --case {case} --explain`"
        )
    backends = sorted({c.runtime.backend for c in cells})
    if len(backends) > 1:
        raise ConfigError(f"case {case!r} runs on {', '.join(backends)}: choose one with --backend")
    try:
        lo_v, hi_v = parse_version(good), parse_version(bad)
    except ConfigError as exc:
        raise ConfigError(f"--between: {exc}") from None
    if lo_v == hi_v:
        raise ConfigError("--between GOOD BAD needs two different versions")
    by_version = {parse_version(c.runtime.version): c for c in cells}
    for v, name in ((lo_v, "GOOD"), (hi_v, "BAD")):
        if v not in by_version:
            known = ", ".join(str(k) for k in sorted(by_version))
            raise ConfigError(
                f"--between: {name} {v} is not a runtime the case runs on ({backends[0]}: {known}); "
                f"add it (`matrix discover`, `matrix runtime add`) or pick one of these"
            )
    low, high = min(lo_v, hi_v), max(lo_v, hi_v)
    ordered = [by_version[v] for v in sorted(by_version) if low <= v <= high]
    bad_index = len(ordered) - 1 if hi_v > lo_v else 0
    return backends[0], ordered, bad_index


def _component_cells(
    session: Session, case: str, backend: str | None, component: str, good: str, bad: str, on: str | None,
    index_url: str | None, echo: Echo,
) -> tuple[str, list[Cell], int, str]:  # fmt: skip
    """(backend, one cell per released version of the component under the fixed base runtime, ordered by the
    component's version; bad's index; the base runtime's version)."""
    from matrix.bisect_component import index_versions, make_variants
    from matrix.component_sources import derive, index_project
    from matrix.db.models import Runtime

    selection = Selection(cases=(case,), backends=(backend,) if backend else (), strict_markers=False)
    cells = list(plan_from_db(session, selection).cells)
    if not cells:
        raise ConfigError(f"case {case!r} has no runnable cell; see `matrix plan --case {case} --explain`")
    backends = sorted({c.runtime.backend for c in cells})
    if len(backends) > 1:
        raise ConfigError(f"case {case!r} runs on {', '.join(backends)}: choose one with --backend")
    if on is not None:
        on_version = parse_version(on.split("=", 1)[1] if "=" in on else on)
        cells = [c for c in cells if c.runtime.parsed_version == on_version]
        if not cells:
            raise ConfigError(f"--on {on}: not a runtime the case runs on; see `matrix plan --case {case}`")

    def varies(cell: Cell, version: str) -> bool:
        """Whether the component's source lets this runtime's recipe change it (raising the reason if asked)."""
        try:
            derive(cell.runtime.backend, cell.runtime.version, dict(cell.runtime.provider),
                   dict(cell.runtime.components), {component: version}, f"runtime {cell.runtime.label}")  # fmt: skip
        except ConfigError as exc:
            return "already has" in str(exc)
        return True

    pinning = [c for c in cells if varies(c, bad)]
    if not pinning:
        newest = max(cells, key=lambda c: c.runtime.parsed_version)
        derive(newest.runtime.backend, newest.runtime.version, dict(newest.runtime.provider),
               dict(newest.runtime.components), {component: bad}, f"runtime {newest.runtime.label}")  # fmt: skip
    base_cell = max(pinning, key=lambda c: c.runtime.parsed_version)
    project = index_project(backends[0], component)
    if project != component:
        echo(f"{component} versions are the releases of {project} on the index (component sources)")
    try:
        versions, left_out = index_versions(project, good, bad, index_url)
    except ConfigError as exc:
        raise ConfigError(f"--component {component}: {exc}") from None
    if left_out:
        echo(f"{component} on the index: left out {', '.join(left_out)}")
    base = session.get(Runtime, base_cell.runtime.id)
    assert base is not None
    variants = make_variants(session, base, component, versions)
    named = tuple(f"{backends[0]}={r.version}" for r in variants)
    planned = plan_from_db(session, Selection(cases=(case,), backends=(backends[0],), runtimes=named,
                                              strict_markers=False)).cells  # fmt: skip
    by_version = {c.runtime.version: c for c in planned}
    missing = [r.version for r in variants if r.version not in by_version]
    if missing:
        raise ConfigError(
            f"case {case!r} does not run on the variants {', '.join(missing)}; see `matrix plan --explain`"
        )
    ordered = [by_version[r.version] for r in variants]
    bad_index = len(ordered) - 1 if parse_version(bad) > parse_version(good) else 0
    return backends[0], ordered, bad_index, base.version


def _find_or_create_campaign(session: Session, params: dict[str, Any], selection: Selection) -> tuple[int, bool]:
    """An unfinished bisect campaign with these parameters (resumed), else a new one."""
    for campaign in session.scalars(select(Campaign).order_by(Campaign.id.desc())):
        info = (campaign.selection or {}).get("bisect")
        if isinstance(info, dict) and {k: info.get(k) for k in params} == params and "result" not in info:
            return campaign.id, True
    from matrix.campaign import git_sha

    campaign = Campaign(
        status="finished", selection={**selection.as_dict(), "cells": [], "bisect": dict(params)},
        host=socket.gethostname(), executor="local", git_sha=git_sha(), matrix_version=__version__,
        owner_pid=os.getpid(),
    )  # fmt: skip
    session.add(campaign)
    session.flush()
    return campaign.id, False


def _evidence(session: Session, campaign_id: int, cell: Cell) -> tuple[list[CellRun], CellRun | None]:
    rows = list(
        session.scalars(
            select(CellRun)
            .where(CellRun.campaign_id == campaign_id, CellRun.case_id == cell.case.id,
                   CellRun.runtime_id == cell.runtime.id)
            .order_by(CellRun.attempt)
        )
    )  # fmt: skip
    finished = [r for r in rows if r.status in DECISIVE]
    pending = next((r for r in rows if r.status == "pending"), None)
    return finished, pending


def _queue(session: Session, campaign_id: int, cell: Cell) -> None:
    """Append the cell to the campaign's selection and give it a pending attempt (unless it has one)."""
    from matrix.schedule.claims import new_uid

    campaign = session.get(Campaign, campaign_id)
    assert campaign is not None
    selection = dict(campaign.selection)
    if cell.key not in selection.get("cells", []):
        selection["cells"] = [*selection.get("cells", []), cell.key]
        campaign.selection = selection  # a new dict, so the JSON column is written
    rows = list(
        session.scalars(
            select(CellRun).where(CellRun.campaign_id == campaign_id, CellRun.case_id == cell.case.id,
                                  CellRun.runtime_id == cell.runtime.id)
        )
    )  # fmt: skip
    if any(r.status == "pending" for r in rows):
        return
    attempt = max((r.attempt for r in rows), default=0) + 1
    session.add(CellRun(uid=new_uid(), campaign_id=campaign_id, case_id=cell.case.id, runtime_id=cell.runtime.id,
                        attempt=attempt, status="pending", checks=[]))  # fmt: skip


_STAMP = re.compile(r"^(line \d+: )?(\d{4}-\d\d-\d\dT[\d:.]+(Z|[+-]\d\d:\d\d)?\s+)*")
_ERRORISH = re.compile(r"\b(ERROR|FATAL|Exception|Error|error)\b")
_QUIET_LEVELS = frozenset({"WARN", "WARNING", "INFO", "DEBUG", "TRACE"})
_ERROR_FIELD = re.compile(r'\berror="([^"]+)"')


def _log_evidence(lines: list[str]) -> str:
    """The first real error among the message's "error lines" section (`role: text`, timestamps dropped), or "".

    A health timeout's first line only says the server never got ready; the reason is in a log."""
    role, inside = "", False
    for line in lines:
        if line.startswith("--- "):
            inside = line.startswith("--- error lines")
            continue
        if not inside:
            continue
        if line.startswith("==> ") and line.endswith(" <=="):
            role = line[4:-4]
            continue
        text = _STAMP.sub("", line).strip()
        level = text.split(maxsplit=1)[0] if text else ""
        if not _ERRORISH.search(text) or text.startswith("Traceback") or level in _QUIET_LEVELS:
            continue
        field = _ERROR_FIELD.search(text)  # structured logs carry the cause in error="..."
        detail = field.group(1) if field else text
        return f"{role}: {excerpt(detail, 160, end=True)}" if role else excerpt(detail, 160, end=True)
    return ""


def _first_line(row: CellRun) -> str:
    """A failed attempt's evidence: its kind and first line, and the first error of its logs."""
    if row.status == PASSED:
        return ""
    text = (row.message or "").strip().splitlines()
    head = text[0] if text else ""
    kind = f"{row.failure_kind}: " if row.failure_kind else ""
    found = _log_evidence(text[1:])
    return excerpt(kind + head, 160) + (f" [{found}]" if found else "")


def _attempt(
    factory: sessionmaker[Session], campaign_id: int, cell: Cell, selection: Selection,
    run_options: dict[str, Any] | None,
) -> str:  # fmt: skip
    """Run one more attempt of `cell` in the bisect campaign, through `matrix run --resume`'s path; its status."""
    from matrix.campaign import EXIT_INTERRUPTED, RunOptions, run_campaign
    from matrix.schedule.start import Start

    with transaction(factory) as session:
        before, _ = _evidence(session, campaign_id, cell)
        _queue(session, campaign_id, cell)
    options = RunOptions(selection=selection, start=Start("resume", campaign_id), quiet=True, **(run_options or {}))
    if run_campaign(factory, options, echo=lambda line: None) == EXIT_INTERRUPTED:
        raise BisectInterrupted(campaign_id)
    with transaction(factory) as session:
        after, _ = _evidence(session, campaign_id, cell)
        if len(after) > len(before):
            return after[-1].status
        # Skipped or not run: this version says nothing, and bisecting around it would guess.
        last = session.scalars(
            select(CellRun).where(CellRun.campaign_id == campaign_id, CellRun.case_id == cell.case.id,
                                  CellRun.runtime_id == cell.runtime.id)
            .order_by(CellRun.attempt.desc())
        ).first()  # fmt: skip
        why = f"{last.status}: {last.message}" if last is not None else "no attempt recorded"
    raise NoOutcome(excerpt(why.splitlines()[0], 200))


class NoOutcome(Exception):
    """A probe was skipped or not run: the version says nothing about the case."""


def _fill_from_index(
    factory: sessionmaker[Session], case: str, backend: str | None, good: str, bad: str, index_url: str | None,
    echo: Echo,
) -> None:  # fmt: skip
    """Turn the index's releases between GOOD and BAD that the catalog lacks into runtimes (the backend's
    `runtime_template`, as `matrix discover` does), so the bisection walks every released version."""
    from matrix.db.models import Case
    from matrix.discover import SKIPPED, fill_between

    with transaction(factory) as session:
        if backend is None:
            row = session.scalar(select(Case).where(Case.name == case, Case.retired.is_(False)))
            if row is None:
                raise ConfigError(f"unknown case {case!r}; see `matrix cases list`")
            backend = row.backend.name
        try:
            found = fill_between(session, backend, good, bad, index_url=index_url)
        except ConfigError as exc:
            raise ConfigError(f"--from-index: {exc}") from None
    releases = [f for f in found.found if f.action != "channel"]
    added = [f.version for f in releases if f.action == "added"]
    left_out = [f"{f.version} ({f.action})" for f in found.found if f.action in SKIPPED]
    echo(f"{found.package} on the index between {good} and {bad}: {len(releases)} release(s), "
         f"{len(added)} added as runtimes{': ' + ', '.join(added) if added else ''}")  # fmt: skip
    if left_out:
        echo(f"  left out: {', '.join(left_out)}")


class BisectInterrupted(Exception):
    def __init__(self, campaign_id: int) -> None:
        super().__init__(campaign_id)
        self.campaign_id = campaign_id


def bisect(
    factory: sessionmaker[Session], case: str, good: str, bad: str, *, backend: str | None = None, repeat: int = 1,
    echo: Echo = print, run_options: dict[str, Any] | None = None, flaky: float | None = None,
    confidence: float = 0.95, cell_limit: int = 100, from_index: bool = False, index_url: str | None = None,
    component: str | None = None, on: str | None = None,
) -> BisectResult:  # fmt: skip
    """Run the bisection; raises `BisectInterrupted` (campaign resumable) when a probe was interrupted.

    With `flaky` (the failure rate of a bad version) the search is probabilistic (`matrix.bisect_prob`):
    one attempt at a time until one version holds `confidence`, or `cell_limit` attempts."""
    if repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    if flaky is not None and not 0 < flaky < 1:
        raise ConfigError("--flaky RATE is the failure rate of a bad version: a number between 0 and 1, e.g. 0.4")
    if not 0.5 <= confidence < 1:
        raise ConfigError("--confidence must be at least 0.5 and below 1, e.g. 0.95")
    if flaky is not None and repeat > 1:
        raise ConfigError("--flaky chooses how often to run each version: drop --repeat")
    if from_index and component:
        raise ConfigError("--component reads the component's versions from the index already: drop --from-index")
    if on and not component:
        raise ConfigError("--on names the engine runtime a --component bisect keeps fixed: give --component too")
    if from_index:
        _fill_from_index(factory, case, backend, good, bad, index_url, echo)
    with transaction(factory) as session:
        if component:
            backend_name, cells, bad_index, base = _component_cells(
                session, case, backend, component, good, bad, on, index_url, echo
            )
            versions = [str(parse_version(c.runtime.components[component])) for c in cells]
            what = f"{component} versions under {backend_name}-{base}"
        else:
            backend_name, cells, bad_index = _cells(session, case, backend, good, bad)
            versions = [c.runtime.version for c in cells]
            what = f"{backend_name} versions"
        params = _bisect_params(case, backend_name, str(parse_version(good)), str(parse_version(bad)), repeat)
        if component:
            params.update(component=component, on=base)
        if flaky is not None:
            if bad_index == 0:
                raise ConfigError("--flaky bisects a break: give GOOD older than BAD")
            params.update(flaky=flaky, confidence=confidence)
        # A component bisect's variants are planned only when named, so its campaign names them.
        named = tuple(f"{backend_name}={c.runtime.version}" for c in cells) if component else ()
        selection = Selection(cases=(case,), backends=(backend_name,), runtimes=named, strict_markers=False)
        campaign_id, resumed = _find_or_create_campaign(session, params, selection)
    n = len(cells)
    echo(f"{'resuming ' if resumed else ''}bisect campaign {campaign_id}: {case} over {n} {what} "
         f"{versions[0]} .. {versions[-1]} (at most {max_cells(n) * repeat} cells)")  # fmt: skip
    probes: dict[int, Probe] = {}
    cells_run = 0
    if flaky is not None:
        return _bisect_flaky(factory, campaign_id, cells, versions, params, selection, echo, run_options, cell_limit)
    while True:
        verdicts = {i: p.verdict for i, p in probes.items()}
        index, first = next_probe(n, bad_index, verdicts)
        if index is None:
            break
        cell = cells[index]
        probe = probes.setdefault(index, Probe(index, versions[index]))
        while True:
            with transaction(factory) as session:
                finished, _ = _evidence(session, campaign_id, cell)
                probe.statuses = [r.status for r in finished]
                probe.messages = [_first_line(r) for r in finished]
                probe.uids = [r.uid for r in finished]
            if len(finished) >= repeat:
                break
            echo(f"probe {cell.runtime.label} (attempt {len(finished) + 1} of {repeat})")
            try:
                status = _attempt(factory, campaign_id, cell, selection, run_options)
            except NoOutcome as exc:
                if index == bad_index:
                    raise ConfigError(
                        f"cannot bisect: the bad end {cell.runtime.label} gives no outcome ({exc}); "
                        "make it runnable here (`matrix doctor`) or choose another BAD"
                    ) from None
                probe.skipped = str(exc)
                echo(f"  {cell.runtime.label}: no outcome ({exc}); stepping around it")
                break
            echo(f"  {cell.runtime.label}: {status}")
            cells_run += 1
    result = BisectResult(
        campaign_id, case, backend_name, versions, params["good"], params["bad"],
        [probes[i] for i in sorted(probes)], cells_run=cells_run,
        direction="first bad" if bad_index == n - 1 else "first good",
    )  # fmt: skip
    if first is None:
        result.note = f"the bad end {params['bad']} passed here: nothing to bisect"
    else:
        result.first = versions[first]
        result.last_other = versions[first - 1]
        # Versions stepped around just before the boundary could hold it: the change is at one of them or
        # at `first`.
        gap = []
        i = first - 1
        while i > 0 and i in probes and probes[i].verdict == "skip":
            gap.append(i)
            i -= 1
        if gap:
            result.last_other = versions[i]
            result.unsure = [versions[j] for j in sorted(gap)]
            result.note = (f"{', '.join(result.unsure)} gave no outcome ({probes[gap[0]].skipped}): the change is at "
                           f"one of them or at {result.first}")  # fmt: skip
    mixed = [p for p in result.probes if p.verdict == "flaky"]
    if mixed and repeat > 1:
        fails = sum(sum(1 for s in p.statuses if s != PASSED) for p in mixed)
        rate = fails / sum(len(p.statuses) for p in mixed)
        miss = (1 - rate) ** repeat
        result.unsure = [p.version for p in result.probes if p.verdict == "good"]
        if result.unsure:
            result.note = (f"failures are flaky (observed rate {rate:.0%}): each version that passed {repeat} times "
                           f"could still be bad with probability {miss:.1%}")  # fmt: skip
    elif mixed:
        result.unsure = [p.version for p in mixed]
        result.note = "a probe both passed and failed: rerun with --repeat K to bisect a flaky failure"
    good_index = n - 1 - bad_index
    if n > 1 and good_index not in probes:
        # Only the bad end and the versions between are run: say so, with the command that checks the good end.
        result.assumed_good = versions[good_index]
        said = (f"the good end {versions[good_index]} was assumed to pass without running it here "
                f"(`matrix run --case {case} --runtime {cells[good_index].runtime.backend}="
                f"{cells[good_index].runtime.version}` checks it)")  # fmt: skip
        result.note = f"{result.note}; {said}" if result.note else said
    _record_result(factory, campaign_id, result)
    return result


def _bisect_flaky(
    factory: sessionmaker[Session], campaign_id: int, cells: list[Cell], versions: list[str], params: dict[str, Any],
    selection: Selection, echo: Echo, run_options: dict[str, Any] | None, cell_limit: int,
) -> BisectResult:  # fmt: skip
    from matrix.bisect_prob import next_version, posterior

    n, rate, confidence = len(cells), float(params["flaky"]), float(params["confidence"])
    probes: dict[int, Probe] = {}
    cells_run = 0
    while True:
        with transaction(factory) as session:
            for index, cell in enumerate(cells):
                finished, _ = _evidence(session, campaign_id, cell)
                if finished:
                    probes[index] = Probe(index, versions[index], [r.status for r in finished],
                                          [_first_line(r) for r in finished], [r.uid for r in finished])  # fmt: skip
        observations = {
            i: (sum(1 for s in p.statuses if s != PASSED), sum(1 for s in p.statuses if s == PASSED))
            for i, p in probes.items()
        }
        p = posterior(n, observations, rate)
        best = max(range(n), key=lambda i: p[i])
        attempts = sum(len(pr.statuses) for pr in probes.values())
        if p[best] >= confidence or attempts >= cell_limit:
            break
        index = next_version(p, rate)
        echo(f"probe {cells[index].runtime.label} (P(first bad = {versions[best]}) = {p[best]:.2f})")
        try:
            status = _attempt(factory, campaign_id, cells[index], selection, run_options)
        except NoOutcome as exc:
            raise ConfigError(
                f"cannot bisect: {cells[index].runtime.label} gives no outcome ({exc}); a probabilistic bisection "
                "needs every version runnable: make it runnable here (`matrix doctor`) or bisect a range without it"
            ) from None
        echo(f"  {cells[index].runtime.label}: {status}")
        cells_run += 1
    result = BisectResult(campaign_id, params["case"], params["backend"], versions, params["good"], params["bad"],
                          [probes[i] for i in sorted(probes)], cells_run=cells_run)  # fmt: skip
    result.confidence = p[best]
    result.unsure = [versions[i] for i in range(n) if i != best and p[i] >= 0.01]
    if p[best] >= confidence:
        result.first, result.last_other = versions[best], versions[best - 1]
        result.note = (f"first bad {versions[best]} with probability {p[best]:.3f} (>= {confidence}), assuming a bad "
                       f"version fails {rate:.0%} of its attempts and {params['bad']} is bad")  # fmt: skip
    else:
        result.note = (f"not confident after {attempts} attempts (--max-cells): most likely first bad "
                       f"{versions[best]} at {p[best]:.2f}")  # fmt: skip
    _record_result(factory, campaign_id, result)
    return result


def _record_result(factory: sessionmaker[Session], campaign_id: int, result: BisectResult) -> None:
    """The campaign's bisect entry gets its result: the same command later starts a new bisect."""
    with transaction(factory) as session:
        campaign = session.get(Campaign, campaign_id)
        assert campaign is not None
        info = dict(campaign.selection.get("bisect", {}))
        info["result"] = {
            "first": result.first, "last_other": result.last_other, "direction": result.direction,
            "unsure": result.unsure, "note": result.note, "confidence": result.confidence,
            # The version line the report draws: every version in range, and what each probe found.
            "versions": result.versions, "verdicts": {p.version: p.verdict for p in result.probes},
            "evidence": {p.version: next((m for m in p.messages if m), p.skipped) for p in result.probes},
        }  # fmt: skip
        campaign.selection = {**campaign.selection, "bisect": info}


@contextlib.contextmanager
def stdout_to_stderr(active: bool) -> Any:
    """With --json, stdout carries only the result: the campaign's own lines go to stderr."""
    if not active:
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield
