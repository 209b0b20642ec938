"""Reports, comparisons, gates and exports from REAL reference runs, with hostile text planted afterwards.

Two campaigns run real reference pairs through `matrix run`: campaign 1 on reference 0.1.0, campaign 2
on reference 0.2.0 after the catalog turned one healthy case bad (a regression), with waivers, a flaky
start-up (crash-once with retries), a case left out of campaign 2 (not run) and a case whose required
fix reference 0.1.0 lacks. After the runs, hostile text is planted where real engines put arbitrary
bytes: lines appended to a real cell's process log (script tags, quotes, ANSI escapes, secrets, then a
megabyte of the same), and a completion excerpt written into that cell's row with SQL (an engine's
completion is model output, which the runner stores verbatim). Every page and export must show it as
text, never as markup.
"""

from __future__ import annotations

import json
import sqlite3
from html.parser import HTMLParser
from pathlib import Path

import pytest
from lxml import etree

from tests.helpers.cli import DATA, REPO, Matrix

HOSTILE = (
    "<script>alert('pwned')</script> \"double\" 'single' <img src=x onerror=alert(1)> </pre></details>"
    "\x1b[31;1mANSI red\x1b[0m \x1b]0;title\x07 HF_TOKEN=hf_secretvalue OPENAI_API_KEY=sk-secret "
    "postgresql://admin:dbpassw0rd@db.internal/matrix"
)
SECRETS = ("hf_secretvalue", "sk-secret", "dbpassw0rd")

CASES_V1 = {
    "ref_healthy": "",
    "ref_turns_bad": "",
    "ref_same_id": "same-worker-id",
    "ref_crash": "crash-at-start",
    "ref_flaky": "crash-once",
    "ref_only_old": "",
    "ref_needs_fix": "",
}
EXTRA = """
[[runtime]]
backend = "reference"
version = "0.1.0"
provider = { kind = "builtin" }
components = { matrix-reference = "0.1.0" }

[[runtime]]
backend = "reference"
version = "0.2.0"
provider = { kind = "builtin" }
components = { matrix-reference = "0.2.0" }

[[fix]]
key = "reference#2"
component = "matrix-reference"
fixed_in = ["0.2.0"]
link = "https://example.org/reference/pull/2"

[[gate]]
name = "e2e_gate"
expression = "e2e"
rules = { flaky_blocks = false, regressions_block = true }

[[waiver]]
case = "ref_same_id"
runtime_spec = ">=0.2.0"
reason = "aggregated on purpose <b>until</b> the split lands"
link = "https://example.org/issue/7"
expires = 2999-12-31

[[waiver]]
case = "ref_crash"
reason = "crashes at start"
expires = 2020-01-01
"""


def write_catalog(m: Matrix, cases: dict[str, str]) -> list[str]:
    lines = []
    for name, fault in cases.items():
        faults = f'["{fault}"]' if fault else "[]"
        lines += [
            "[[case]]",
            f'name = "{name}"',
            'backend = "reference"\narm = "reference"\nmodel = "tiny"\nmarkers = ["gpu_0", "e2e", "pre_merge"]',
            "startup_timeout_s = 20\nrequest_timeout_s = 10",
            f"launch = {{ faults = {faults} }}",
            'requires_fixes = ["reference#2"]' if name == "ref_needs_fix" else "",
            "",
        ]
    directory = m.home / "catalog"
    directory.mkdir(exist_ok=True)
    (directory / "cases.toml").write_text("\n".join(lines))
    (directory / "extra.toml").write_text(EXTRA)
    return [str(directory / "cases.toml"), str(directory / "extra.toml")] + [
        str(DATA / n) for n in ("backends.toml", "markers.toml", "fixes.toml")
    ]


def cell_row(m: Matrix, case: str, version: str) -> tuple[int, str]:
    rows = m.sql(
        'SELECT cell_run.id, cell_run.log_dir FROM cell_run JOIN "case" ON case_id = "case".id '
        "JOIN runtime ON runtime_id = runtime.id WHERE name = ? AND version = ? ORDER BY cell_run.id DESC",
        case,
        version,
    )
    assert rows, (case, version)
    return int(str(rows[0][0])), str(rows[0][1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    home = tmp_path_factory.mktemp("report-runs")
    m = Matrix(home=home, db_path=home / "matrix.db")
    assert m.subprocess("catalog", "sync", *write_catalog(m, CASES_V1)).returncode == 0
    first = m.subprocess("run", "--runtime", "reference=0.1.0", "--max-attempts", "2", "--jobs", "2", timeout=240)
    assert first.returncode == 1, first.stdout + first.stderr
    # The catalog changes between releases: a case that passed on 0.1.0 now hits a planted fault.
    synced = m.subprocess("catalog", "sync", *write_catalog(m, {**CASES_V1, "ref_turns_bad": "same-worker-id"}))
    assert synced.returncode == 0, synced.stdout + synced.stderr
    wanted = [arg for case in CASES_V1 if case != "ref_only_old" for arg in ("--case", case)]
    second = m.subprocess(
        "run", "--runtime", "reference=0.2.0", "--max-attempts", "2", "--jobs", "2", *wanted, timeout=240
    )
    assert second.returncode == 1, second.stdout + second.stderr
    # Plant hostile text where real engines put arbitrary bytes (see the module docstring).
    row_id, log_dir = cell_row(m, "ref_healthy", "0.2.0")
    with (Path(log_dir) / "prefill.log").open("a", encoding="utf-8") as log:
        log.write(HOSTILE + "\n")
        block = (HOSTILE + "\n") * 64
        while log.tell() < 1_100_000:
            log.write(block)
        log.write("last line: " + HOSTILE + "\n")

    with sqlite3.connect(m.db_path) as conn:
        conn.execute("UPDATE cell_run SET completion_excerpt = ? WHERE id = ?", (HOSTILE, row_id))
    return m


class Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.handlers: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.handlers += [name for name, _ in attrs if name.startswith("on")]


def test_statuses_recorded_by_the_real_runs(runs: Matrix) -> None:
    statuses = dict(
        runs.sql(
            'SELECT name || "@" || version, status FROM cell_run JOIN "case" ON case_id = "case".id '
            "JOIN runtime ON runtime_id = runtime.id ORDER BY cell_run.id"
        )
    )
    assert statuses["ref_turns_bad@0.1.0"] == "passed" and statuses["ref_turns_bad@0.2.0"] == "failed"
    assert statuses["ref_flaky@0.2.0"] == "passed" and statuses["ref_crash@0.2.0"] == "failed"
    assert "ref_only_old@0.2.0" not in statuses


def test_report_pages_from_real_runs(runs: Matrix, tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = runs("report", "--out", str(out))
    assert result.exit_code == 0, result.output
    names = {p.name for p in out.iterdir()}
    assert {"index.html", "runtime-reference-0.1.0.html", "runtime-reference-0.2.0.html", "campaign-1.html",
            "campaign-2.html", "compare-reference_0.1.0-vs-reference_0.2.0.html"} <= names  # fmt: skip
    index = (out / "index.html").read_text()
    for text in ('href="runtime-reference-0.2.0.html#cell-ref_turns_bad">FAIL</a>', "flaky", "lacks fix",
                 "unexpected pass", 'href="compare-reference_0.1.0-vs-reference_0.2.0.html"', "<svg"):  # fmt: skip
        assert text in index, text
    page = (out / "runtime-reference-0.2.0.html").read_text()
    assert "worker_ids_distinct" in page and "failure kind validation" in page
    assert "exited with code 1 before it was ready" in page  # the crash's message with its log tail
    prefill, decode = runs.sql(
        "SELECT prefill_worker_id, decode_worker_id FROM cell_run WHERE id = ?",
        cell_row(runs, "ref_healthy", "0.2.0")[0],
    )[0]
    assert str(prefill) in page and str(decode) in page
    old = (out / "runtime-reference-0.1.0.html").read_text()
    assert '<a href="https://example.org/reference/pull/2">reference#2</a>' in old
    assert "campaign 2" in (out / "campaign-2.html").read_text().lower()


def test_hostile_text_shows_as_text_on_every_page(runs: Matrix, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert runs("report", "--out", str(out)).exit_code == 0
    for page in out.glob("*.html"):
        html = page.read_text()
        parser = Elements()
        parser.feed(html)
        assert not parser.tags & {"script", "img", "iframe", "object", "embed", "link"}, page.name
        assert not parser.handlers, page.name
        assert "<script" not in html.lower() and "\x1b" not in html, page.name
        for secret in SECRETS:
            assert secret not in html, (page.name, secret)
    page = (out / "runtime-reference-0.2.0.html").read_text()
    escaped = "&lt;script&gt;alert(&#39;pwned&#39;)&lt;/script&gt; &#34;double&#34; &#39;single&#39;"
    assert page.count(escaped) >= 3  # the completion excerpt and the log tail
    assert "&lt;/pre&gt;&lt;/details&gt;" in page and "ANSI red" in page
    assert "HF_TOKEN=***" in page and "postgresql://admin:***@db.internal" in page
    assert "last line: &lt;script&gt;" in page  # the tail is the end of the 1 MB log
    assert len(page.encode()) < 400_000  # ... and only its capped tail


def test_compare_real_runs(runs: Matrix, tmp_path: Path) -> None:
    result = runs("compare", "reference=0.1.0", "reference=0.2.0", "--json")
    assert result.exit_code == 0, result.output
    verdicts = {c["case"]: c["verdict"] for c in json.loads(result.output)["cases"]}
    # One passed attempt a side cannot show a metric within the threshold: insufficient data, never unchanged.
    assert verdicts == {
        "ref_healthy": "insufficient data",
        "ref_turns_bad": "regressed",
        "ref_same_id": "still failing",
        "ref_crash": "still failing",
        "ref_flaky": "insufficient data",
        "ref_only_old": "missing",
        "ref_needs_fix": "insufficient data",
    }
    by_component = runs("compare", "--component", "matrix-reference", "0.1.0", "0.2.0")
    assert by_component.exit_code == 0 and "regressed" in by_component.output


def test_gate_on_real_runs(runs: Matrix, tmp_path: Path) -> None:
    page = tmp_path / "gate.html"
    result = runs("gate", "reference", "0.2.0", "--policy", "e2e_gate", "--json", "--html", str(page))
    assert result.exit_code == 1, result.output
    data = json.loads(result.output)
    assert data["verdict"] == "NO-GO" and data["previous_release"] == "0.1.0"
    found = {(r["kind"], r["case"], r["blocking"]) for r in data["reasons"]}
    assert found == {
        ("failed", "ref_turns_bad", True),
        ("regression", "ref_turns_bad", True),
        ("waived", "ref_same_id", False),
        ("failed", "ref_crash", True),
        ("waiver-expired", "ref_crash", False),
        ("flaky", "ref_flaky", False),
        ("not-run", "ref_only_old", True),
    }
    html = page.read_text()
    assert "NO-GO" in html and "&lt;b&gt;until&lt;/b&gt;" in html
    old = runs("gate", "reference", "0.1.0", "--policy", "e2e_gate")
    assert old.exit_code == 1
    assert "missing-fix" in old.output and "reference#2" in old.output and "unexpected-pass" in old.output


def test_junit_from_real_runs_validates(runs: Matrix, tmp_path: Path) -> None:
    out = tmp_path / "junit.xml"
    assert runs("export", "junit", "--out", str(out)).exit_code == 0
    schema = etree.XMLSchema(etree.parse(str(REPO / "tests" / "schemas" / "junit-10.xsd")))
    root = etree.parse(str(out)).getroot()
    schema.assertValid(root)
    suite = next(s for s in root.iter("testsuite") if s.get("name") == "reference-0.2.0")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases["ref_flaky"].find("flakyFailure") is not None
    assert "worker_ids_distinct" in (cases["ref_turns_bad"].find("failure").get("message") or "")  # type: ignore[union-attr]
    system_out = cases["ref_healthy"].findtext("system-out") or ""
    assert "<script>alert('pwned')</script>" in system_out and "prefill.log" in system_out
    raw = out.read_text()
    assert "&lt;script&gt;" in raw and "\x1b" not in raw and not any(s in raw for s in SECRETS)
    assert len(raw) < 2_000_000
    one = runs("export", "junit", "--campaign", "1")
    schema.assertValid(etree.fromstring(one.output.encode()))


def test_markdown_and_json_from_real_runs(runs: Matrix) -> None:
    markdown = runs("export", "markdown", "--backend", "reference")
    assert markdown.exit_code == 0
    assert "### Failures" in markdown.output and "ref\\_turns\\_bad@reference-0.2.0" in markdown.output
    assert "<script" not in markdown.output
    data = json.loads(runs("export", "json", "--backend", "reference").output)
    healthy = next(c for c in data["cells"] if c["cell"] == "ref_healthy@reference-0.2.0")
    assert "&lt;" not in healthy["latest"]["completion_excerpt"]  # JSON keeps text as text
    assert "<script>" in healthy["latest"]["completion_excerpt"] and "hf_secretvalue" not in json.dumps(data)
