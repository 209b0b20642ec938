"""Render the HTML report: index (grid by version), one page per runtime, per campaign, comparisons.

Pages are static and self-contained (inline CSS and SVG, no script, no external asset), so they open
from `file://`, from a CI artifact or from any static host. Autoescaping is on for every template, and
nothing from the database is ever marked safe.
"""

from __future__ import annotations

import datetime as dt
import gc
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import BytecodeCache, Environment, FileSystemBytecodeCache, FileSystemLoader, StrictUndefined
from sqlalchemy.orm import Session

from matrix import __version__
from matrix.paths import staging_path
from matrix.plan import Selection
from matrix.redact import redact_pair
from matrix.report import links, refresh
from matrix.report.compare import Comparison, Holding, Side, compare
from matrix.report.data import CampaignView, Results, RuntimeView, load_details_of, load_results, load_skip_reasons
from matrix.report.fmt import flatten, fmt_age, fmt_ratio, fmt_seconds, fmt_time
from matrix.report.gate import GateResult, Known, evaluate_gate, previous_release
from matrix.report.perf import Samples, load_samples
from matrix.report.views import (
    STATUS_LABELS,
    CampaignSummary,
    GateBadge,
    backend_sections,
    campaign_summaries,
    cell_views,
    page_attempt_ids,
    status_counts,
    status_label,
)
from matrix.resources import resource_dir
from matrix.text import clean, log_tails, printable

__all__ = ["Written", "environment", "refresh_report", "render_compare", "render_gate", "write_report"]


def environment() -> Environment:
    """The Jinja2 environment of every page: autoescape on, undefined names are errors."""
    env = Environment(
        loader=FileSystemLoader(resource_dir("templates")),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        # Every printed value is made printable first (control bytes as visible escapes), so a catalog
        # name or note carrying NUL or ESC reaches no page raw; autoescaping then makes it inert.
        finalize=_printable,
        bytecode_cache=_compiled_templates(),
    )
    env.filters["seconds"] = fmt_seconds
    env.filters["ratio"] = fmt_ratio
    env.filters["age"] = fmt_age
    env.globals["status_label"] = status_label
    env.globals["log_tails"] = log_tails
    env.globals["cell_href"] = _cell_href
    env.globals["gate_css"] = gate_css
    env.globals["matrix_version"] = __version__
    return env


def _compiled_templates() -> BytecodeCache | None:
    """Where compiled templates are kept between commands: compiling the report's templates took a tenth of a
    `matrix run`'s report refresh at 10^5 attempts. Jinja keys each entry by the template's source and the
    interpreter, and replaces files atomically; a data directory we cannot write to means no cache."""
    from matrix.paths import data_dir

    directory = data_dir() / "cache" / "templates"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return FileSystemBytecodeCache(str(directory))


def gate_css(result: GateResult) -> str:
    """The class of a verdict on the gate page: a predicted NO-GO and N/A look unlike a measured one."""
    if result.predicted:
        return "predicted"
    return {"GO": "go", "INCOMPLETE": "incomplete", "N/A": "na"}.get(result.verdict, "nogo")


def _badge_css(result: GateResult) -> str:
    """The class of a verdict badge on the index."""
    if result.predicted:
        return "verdict-predicted"
    return "verdict-" + ("na" if result.verdict == "N/A" else links.slug(result.verdict.lower()))


def _printable(value: Any) -> Any:
    return printable(value) if isinstance(value, str) else value


def _cell_href(runtime: RuntimeView, case: Any) -> str:
    return links.cell_href(runtime.backend, runtime.version, case.name)


def _now() -> str:
    return fmt_time(dt.datetime.now(dt.UTC))


def _write(env: Environment, template: str, path: Path, context: Mapping[str, Any]) -> None:
    """Stream a page to a temporary file, then move it into place: a reader never sees half a page. The file's
    name is this writer's own: two runners of one campaign may refresh one report at once."""
    tmp = staging_path(path)
    stream = env.get_template(template).stream(generated=_now(), **context)
    stream.enable_buffering(256)  # join small pieces before writing: fewer calls per page
    try:
        stream.dump(str(tmp), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _scope_text(results: Results) -> str:
    if results.campaign_id is not None:
        return f"Campaign {results.campaign_id}"
    if results.selection is None:
        return "Every planned cell and every cell with results"
    # Lists in words (`backends=reference, vllm`), never a Python repr (`backends=['reference']`).
    parts = [f"{k}={', '.join(map(str, v)) if isinstance(v, list | tuple) else v}"
             for k, v in results.selection.as_dict().items() if v]  # fmt: skip
    return "Selection " + (", ".join(parts) if parts else "(everything)")


def default_comparisons(
    results: Results, session: Session | None = None, backends: set[str] | None = None, known: Known | None = None
) -> list[Comparison]:
    """Per backend (of `backends`, default all), the newest runtime with results against the one before it
    (PEP 440 order); with a `session`, its metrics too (a `slower` verdict needs them), read through `known`
    when given."""
    found = []
    cases = {c.id: c for c in results.cases}
    for backend in results.backends():
        if backends is not None and backend not in backends:
            continue
        with_results = [r for r in results.runtimes_of(backend) if _has_results(results, r)]
        if len(with_results) < 2:
            continue
        older, newer = with_results[-2], with_results[-1]
        attempts = sorted((a for a in results.attempts() if a.runtime_id in (older.id, newer.id)), key=lambda a: a.id)
        samples = None
        if known is not None:
            samples = known.samples([older.id, newer.id])
        elif session is not None:
            samples = load_samples(session, [older.id, newer.id])
        found.append(compare(cases, Side(older.spec, (older,)), Side(newer.spec, (newer,)), attempts, samples))
    return found


def _has_results(results: Results, runtime: RuntimeView) -> bool:
    return any(cell.attempts for cell in results.cells_of_runtime(runtime.id))


def bisect_line(selection: Mapping[str, Any]) -> dict[str, Any] | None:
    """A finished bisect campaign as a version line: each version in range with its probe's verdict, and
    the boundary (between `last_other` and `first`) marked. None for other campaigns."""
    info = selection.get("bisect")
    if not isinstance(info, Mapping):
        return None
    result = info.get("result")
    if not isinstance(result, Mapping) or not isinstance(result.get("versions"), list):
        return None
    verdicts = result.get("verdicts") or {}
    evidence = result.get("evidence") or {}
    unsure = set(result.get("unsure") or [])
    first = result.get("first")
    steps = []
    for version in result["versions"]:
        verdict = str(verdicts.get(version, "not probed"))
        if verdict == "not probed" and str(version) == str(info.get("good")):
            verdict = "good (given)"  # GOOD is taken as given, never probed
        steps.append({
            "version": str(version), "verdict": verdict, "css": _VERDICT_CSS.get(verdict, "st-not-run"),
            "first": version == first, "unsure": version in unsure, "evidence": clean(str(evidence.get(version, ""))),
        })  # fmt: skip
    what = info.get("component") or info.get("backend", "")
    return {
        "what": str(what), "case": str(info.get("case", "")), "direction": str(result.get("direction", "")),
        "first": first, "last_other": result.get("last_other"), "note": clean(str(result.get("note") or "")),
        "steps": steps, "probed": sum(1 for s in steps if s["verdict"] != "not probed"),
    }  # fmt: skip


_VERDICT_CSS = {
    "good": "st-passed", "good (given)": "st-passed", "bad": "st-failed", "flaky": "st-flaky", "unknown": "st-skipped",
}  # fmt: skip


def _campaign_context(campaign: CampaignView) -> dict[str, Any]:
    duration = campaign.duration_s
    return {
        "campaign": campaign,
        "started": fmt_time(campaign.started_at),
        "finished": fmt_time(campaign.finished_at),
        "duration": fmt_seconds(duration) if duration is not None else "-",
    }


@dataclass(frozen=True)
class Written:
    """What a report write did: the index page, how many pages it wrote, and whether it was a refresh that
    left the pages the new campaigns do not reach as they were."""

    index: Path
    pages: int
    partial: bool


def write_report(session: Session, out_dir: Path, selection: Selection | None = None) -> Path:
    """Write the whole report into `out_dir` and return the index page's path.

    Reads the database in a handful of queries (catalog, attempt summaries, campaigns) plus one query per
    runtime page for the attempts it shows whole.
    """
    return _report(session, out_dir, selection, None).index


def refresh_report(session: Session, out_dir: Path, campaigns: Sequence[int]) -> Written:
    """After `matrix run` of `campaigns`: when `out_dir` holds a whole-database report written from the same
    inputs (`matrix.report.refresh`), rewrite only the pages those campaigns' attempts reach (their runtimes,
    the campaigns, the gates and comparisons that read those runtimes, the index); else write every page."""
    return _report(session, out_dir, None, campaigns)


def _report(
    session: Session, out_dir: Path, selection: Selection | None, campaigns: Sequence[int] | None
) -> Written:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    # The report allocates hundreds of thousands of small objects that live until it ends and form no
    # reference cycles; the cyclic collector would walk all of them again and again (a quarter of the
    # time at 100,000 attempts) and free nothing. Peak memory is the same without it.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        results = load_results(session, selection)
        if selection is not None:  # a scoped report: a later refresh must not build on it
            refresh.remove_state(out_dir)
            return _write_pages(session, env, out_dir, results, None, None)
        stamp = refresh.fingerprint(session, results, dt.datetime.now(dt.UTC).date())
        state = refresh.read_state(out_dir) if campaigns is not None else None
        partial = None
        if state is not None and campaigns is not None and state.fingerprint == stamp:
            partial = _Partial(state, set(campaigns), refresh.reached(results, campaigns))
        return _write_pages(session, env, out_dir, results, partial, stamp)
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class _Partial:
    """A refresh: the state of the last full write, the new campaigns and the runtimes they reached."""

    state: refresh.ReportState
    campaigns: set[int]
    runtimes: set[int]


class _Pages:
    """Writes pages through one Jinja environment and counts them."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.count = 0

    def write(self, template: str, path: Path, context: Mapping[str, Any]) -> None:
        _write(self.env, template, path, context)
        self.count += 1


def _write_pages(
    session: Session, env: Environment, out_dir: Path, results: Results, partial: _Partial | None, stamp: str | None
) -> Written:
    selection = results.selection
    counter = _Pages(env)
    every_runtime = {r.id for r in results.runtimes}
    touched = partial.runtimes if partial else every_runtime
    # A gate reads its runtime and the release before it: both kinds of gate must be judged again.
    judged = {r.id for r in results.runtimes if r.id in touched or
              ((before := previous_release(results.runtimes, r)) is not None and before.id in touched)}  # fmt: skip
    backends = {r.backend for r in results.runtimes if r.id in touched}
    known = _known(session, results)
    comparisons = default_comparisons(results, session, backends if partial else None, known)
    reasons = load_skip_reasons(session, results)
    summaries = campaign_summaries(results, reasons, partial.campaigns if partial else None)
    gates = dict(partial.state.badges) if partial else {}
    gates.update(_write_gates(session, counter, out_dir, results, judged, known))
    campaigns = [c for c in results.campaigns if c.id in summaries or selection is None]
    new_campaigns = partial.campaigns if partial else None

    for runtime in results.runtimes:
        if runtime.id not in touched:
            continue
        cells = results.cells_of_runtime(runtime.id)
        details = load_details_of(session, page_attempt_ids(cells))
        counter.write("runtime.html", out_dir / links.runtime_page(runtime.backend, runtime.version), {
            "runtime": runtime,
            "components": sorted(runtime.components.items()),
            # Names and values are shown apart, so the name decides too: env.HF_TOKEN hides its whole value.
            "provider": [(k, clean(redact_pair(k, str(v)))) for k, v in flatten(runtime.provider)],
            "totals": status_counts(cells),
            "cells": cell_views(cells, details),
            "gates": gates.get(runtime.id, ()),
        })  # fmt: skip
    for campaign in campaigns:
        if new_campaigns is not None and campaign.id not in new_campaigns:
            continue
        summary = summaries.get(campaign.id) or CampaignSummary()
        statuses = [st for st in STATUS_LABELS if summary.counts[st]]
        counter.write("campaign.html", out_dir / links.campaign_page(campaign.id), {
            **_campaign_context(campaign),
            "selection": [(k, clean(redact_pair(k, str(v)))) for k, v in flatten(campaign.selection)
                          if k != "cells" and not k.startswith("bisect.result")],  # the line below shows it
            "totals": [(st, status_label(st), summary.counts[st]) for st in statuses],
            "statuses": [(st, status_label(st)) for st in statuses],
            "by_runtime": [(label, [counts[st] for st in statuses]) for label, counts in summary.by_runtime.items()],
            "attempts": summary.attempts,
            "rows": summary.rows,
            "bisect": bisect_line(campaign.selection),
        })  # fmt: skip
    compare_links = {b: link for b, link in (partial.state.comparisons if partial else {}).items() if b not in backends}
    for comparison in comparisons:
        name = links.compare_page(comparison.a.label, comparison.b.label)
        counter.write("compare.html", out_dir / name, {"comparison": comparison, "holding": None})
        backend = comparison.b.runtimes[0].backend
        compare_links[backend] = {"href": name, "title": comparison.title, "counts": comparison.counts()}
    from matrix.report.skew import load_skew_grid, skew_cases, skew_page

    skews = skew_cases(session)
    for case in skews:  # version-skew grids, one page per case (matrix/report/skew.py)
        if partial is None or not (out_dir / skew_page(case)).is_file() or _skew_touched(session, new_campaigns):
            counter.write("skew.html", out_dir / skew_page(case), {"grid": load_skew_grid(session, case),
                                                                   "anchor": links.slug})  # fmt: skip
    since_last = _write_since_last(session, counter, out_dir, results)
    quarantine = _write_quarantine(session, counter, out_dir)
    evidence = _write_evidence(session, counter, out_dir)
    episodes = _write_episodes(session, counter, out_dir)
    detection = _write_detection(session, counter, out_dir)
    index = out_dir / links.INDEX
    counter.write("index.html", index, {
        "detection": detection,
        "since_last": since_last,
        "quarantine": quarantine,
        "evidence": evidence,
        "episodes": episodes,
        "scope": _scope_text(results),
        "totals": status_counts(results.cells.values()),
        "sections": backend_sections(results, reasons, gates),
        "comparisons": [compare_links[b] for b in sorted(compare_links)],
        "skews": [{"case": case, "href": skew_page(case)} for case in skews],
        "campaigns": [
            {**_campaign_context(c), "href": links.campaign_page(c.id), "attempts": _attempts(summaries, c.id)}
            for c in reversed(campaigns)
        ],
    })  # fmt: skip
    if stamp is not None:
        refresh.write_state(out_dir, refresh.ReportState(stamp, gates, compare_links))
    return Written(index, counter.count, partial is not None)


def _write_since_last(session: Session, pages: _Pages, out_dir: Path, results: Results) -> dict[str, Any] | None:
    """The "since the last campaign" page: the newest campaign against the one before it. Written on every
    write, a refresh's too, since each new campaign changes it; None (and no page) before a second campaign."""
    from matrix.report.diff import diff_campaigns, latest_pair

    pair = latest_pair(c.id for c in results.campaigns)
    path = out_dir / links.SINCE_LAST
    if pair is None:
        path.unlink(missing_ok=True)  # a page left by an older database must not outlive it
        return None
    diff = diff_campaigns(session, *pair)
    pages.write("since-last.html", path, {
        "diff": diff, "href_a": links.campaign_page(diff.a), "href_b": links.campaign_page(diff.b),
        "member_href": _member_href,
    })  # fmt: skip
    return {"href": links.SINCE_LAST, "title": diff.title, "counts": diff.counts()}


def _write_quarantine(session: Session, pages: _Pages, out_dir: Path) -> dict[str, Any] | None:
    """The quarantine page: every muted cell, in force or ended, with its entry and exit. Written on every write
    (a run may enter or end one); None (and no page) while nothing was ever quarantined."""
    from matrix.report.muted import load_quarantines

    found = load_quarantines(session)
    path = out_dir / links.QUARANTINE
    if not found:
        path.unlink(missing_ok=True)
        return None
    today = dt.datetime.now(dt.UTC).date()
    in_force = [q for q in found if q.active(today)]
    ended = [q for q in reversed(found) if not q.active(today)]
    pages.write("quarantine.html", path, {"in_force": in_force, "ended": ended, "today": today})
    return {"href": links.QUARANTINE, "in_force": len(in_force), "ended": len(ended)}


# Closed episodes shown on their page (newest first); every open one is always shown.
CLOSED_EPISODES_SHOWN = 200


def _write_episodes(session: Session, pages: _Pages, out_dir: Path) -> dict[str, Any] | None:
    """The episodes page: every open failure episode, then the newest closed ones. Written on every write (a
    run opens and closes them, and an open one ages); None (and no page) while no cell has failed."""
    from matrix.report.episodes import load_episodes

    found = load_episodes(session)
    path = out_dir / links.EPISODES
    if not found:
        path.unlink(missing_ok=True)
        return None
    now = dt.datetime.now(dt.UTC)
    opened = [e for e in found if e.open]
    closed = [e for e in found if not e.open]
    pages.write("episodes.html", path, {
        "opened": opened, "closed": closed[:CLOSED_EPISODES_SHOWN],
        "older": max(0, len(closed) - CLOSED_EPISODES_SHOWN), "now": now, "campaign_page": links.campaign_page,
    })  # fmt: skip
    return {"href": links.EPISODES, "open": len(opened), "closed": len(closed)}


def _write_evidence(session: Session, pages: _Pages, out_dir: Path) -> list[dict[str, Any]]:
    """The evidence-age page: per gate policy, each required cell's latest evidence and the share newer than
    `evidence.DEFAULT_DAYS` days. Written on every write (time alone ages evidence); the index's lines."""
    from matrix.report.evidence import DEFAULT_DAYS, evidence_age

    found = evidence_age(session, DEFAULT_DAYS)
    path = out_dir / links.EVIDENCE
    if not found:
        path.unlink(missing_ok=True)
        return []
    pages.write("evidence.html", path, {"policies": found, "days": DEFAULT_DAYS, "anchor": links.slug})
    return [{"href": f"{links.EVIDENCE}#{links.slug(p.policy)}", "summary": p.summary()} for p in found]


def _write_detection(session: Session, pages: _Pages, out_dir: Path) -> dict[str, Any] | None:
    """The detection page ([M28]): per KV fault class and runtime, what the checks caught, and the healthy
    twin's false alarms. Written on every write (a run adds cells); None (and no page) without fault cells."""
    from matrix.report.detection import detection_table

    rows = detection_table(session)
    path = out_dir / links.DETECTION
    if not rows:
        path.unlink(missing_ok=True)
        return None
    pages.write("detection.html", path, {"rows": rows})
    faults = [r for r in rows if not r.healthy]
    missed = sum(r.cells - r.flagged for r in faults)
    alarms = sum(r.flagged for r in rows if r.healthy)
    return {"href": links.DETECTION, "classes": len({r.fault for r in faults}), "cells": sum(r.cells for r in rows),
            "missed": missed, "false_alarms": alarms}  # fmt: skip


def _member_href(member: Any) -> str:
    return links.cell_href(member.backend, member.version, member.case)


def _skew_touched(session: Session, campaigns: set[int] | None) -> bool:
    """Whether `campaigns` (None: a full write) ran a version-skew pair, whose grid page must be redrawn."""
    if campaigns is None:
        return True
    from sqlalchemy import select

    from matrix.db.models import CellRun

    found = session.execute(
        select(CellRun.id).where(CellRun.campaign_id.in_(sorted(campaigns)), CellRun.roles_key != "").limit(1)
    )
    return found.first() is not None


def _known(session: Session, results: Results) -> Known:
    """The attempt summaries the report holds, by (case, runtime), and a reader of perf samples that reads
    each set of runtimes once: what the gates and comparisons of one report share."""
    history = None
    if results.selection is None:  # a scoped report holds only its selection's attempts: the gate reads its own
        history = {(c.case.id, c.runtime.id): c.attempts for c in results.cells.values() if c.attempts}
    read: dict[tuple[int, ...], Mapping[tuple[int, int], Samples]] = {}

    def samples(runtime_ids: Sequence[int]) -> Mapping[tuple[int, int], Samples]:
        key = tuple(sorted(set(runtime_ids)))
        if key not in read:
            read[key] = load_samples(session, key)
        return read[key]

    return Known(history, samples)


def _write_gates(
    session: Session, pages: _Pages, out_dir: Path, results: Results, judged: set[int], known: Known
) -> dict[int, tuple[GateBadge, ...]]:
    """Each runtime's (of `judged`) verdict under every gate policy of the catalog, each with its page of reasons.

    The badge shows the verdict the gate gives, whatever it is (GO, NO-GO, INCOMPLETE), so the index needs
    no change when the gate learns a new verdict; only its colour falls back to neutral.
    """
    from sqlalchemy import select

    from matrix.db.models import GatePolicy
    from matrix.errors import MatrixError

    policies = list(
        session.scalars(select(GatePolicy.name).where(GatePolicy.retired.is_(False)).order_by(GatePolicy.name))
    )
    badges: dict[int, tuple[GateBadge, ...]] = {}
    for runtime in results.runtimes:
        if runtime.id not in judged:
            continue
        found = []
        for policy in policies:
            href = links.gate_page(runtime.backend, runtime.version, policy)
            try:
                result = evaluate_gate(session, runtime.backend, runtime.version, policy, known=known)
            except MatrixError as exc:  # a policy the gate refuses (an unknown rule): say so, link nothing
                found.append(GateBadge(policy, "error", "verdict-error", "", clean(str(exc))))
                continue
            pages.write("gate.html", out_dir / href, {"result": result})
            blocking = [r for r in result.reasons if r.blocking]
            title = (
                f"{len(blocking)} blocking reason(s); first: {blocking[0].message}"
                if blocking
                else "no blocking reason"
            )
            if result.explanation:
                title = f"{result.explanation}. {title}"
            found.append(GateBadge(policy, result.verdict_text, _badge_css(result), href, clean(title)))
        badges[runtime.id] = tuple(found)
    return badges


def _attempts(summaries: Mapping[int, CampaignSummary], campaign_id: int) -> int:
    summary = summaries.get(campaign_id)
    return summary.attempts if summary else 0


def render_compare(comparison: Comparison, path: Path, holding: Holding | None = None) -> Path:
    """Write one comparison page (links to cells assume the report's runtime pages sit beside it); a
    `--component` comparison also says what it held equal."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(environment(), "compare.html", path, {"comparison": comparison, "holding": holding})
    return path


def render_gate(result: GateResult, path: Path) -> Path:
    """Write the gate's verdict and reasons as a page."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(environment(), "gate.html", path, {"result": result})
    return path
