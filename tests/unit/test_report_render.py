"""The HTML report from attempts written into the database: pages, escaping, scope and query count.

Real reference runs feed the same pages in tests/e2e/test_report_reference.py; here the rows are
synthetic so that every field (u64 ids, GPU, peaks, hostile text) can be set precisely.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

from sqlalchemy import event

from matrix.db.engine import create_db_engine, session_factory
from matrix.plan import Selection
from matrix.report import write_report
from matrix.report.render import environment
from matrix.resources import resource_dir
from tests.helpers.cli import Matrix
from tests.helpers.reports import attempt, campaign, db, sync

HOSTILE = "<script>alert('x')</script> \"quoted\" 'single' <img src=x onerror=alert(1)> \x1b[31mred\x1b[0m & done"
BIG_ID = "15783270017955876104"

NOTES = """
[[runtime]]
backend = "vllm"
version = "0.31.0"
provider = { kind = "host" }
components = { vllm = "0.31.0", vllm-rs = "0.31.0" }
notes = "<script>alert('notes')</script>"
"""


class TagCounter(HTMLParser):
    """Counts real elements, so an escaped `<script>` (text) is told apart from a script element."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, int] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] = self.tags.get(tag, 0) + 1
        for name, _ in attrs:
            assert not name.startswith("on"), f"event handler attribute {name} on <{tag}>"


def elements(html: str) -> dict[str, int]:
    parser = TagCounter()
    parser.feed(html)
    return parser.tags


def populate(m: Matrix, log_dir: Path | None = None) -> None:
    sync(m, NOTES)
    with db(m) as s:
        c1 = campaign(s, selection={"marker_expression": "vllm and <b>", "cells": ["x"]})
        attempt(s, c1, "vllm_agg_check", "vllm=0.29.0", "passed", prefill_worker_id=BIG_ID, decode_worker_id="7",
                prompt_tokens=91, completion_tokens=64, finish_reason="length", completion_excerpt=HOSTILE,
                ports={"frontend": 31961}, gpu={"cuda_visible_devices": "0", "uuid": "GPU-1"},
                peaks={"rss_bytes": {"prefill": 24498176}, "gpu_bytes": 3_430_000_000},
                components={"vllm": "0.29.0"}, log_dir=str(log_dir or ""))  # fmt: skip
        attempt(s, c1, "vllm_disaggregated", "vllm=0.29.0", "failed", failure_kind="validation",
                message=HOSTILE + " HF_TOKEN=hunter2", expected_failure="lacks vllm#54814",
                checks=[{"name": "worker_ids_distinct", "message": HOSTILE}])  # fmt: skip
        attempt(s, c1, "vllm_long_prompt", "vllm=0.29.0", "failed", failure_kind="startup")
        attempt(s, c1, "vllm_long_prompt", "vllm=0.29.0", "passed", attempt_no=2, flaky=True)
        c2 = campaign(s)
        attempt(s, c2, "vllm_agg_check", "vllm=0.30.0", "timeout", failure_kind="health", ready_s=None)
        attempt(s, c2, "reference_disaggregated", "reference=0.1.0", "passed")


def test_report_writes_every_page_type(matrix: Matrix, tmp_path: Path) -> None:
    populate(matrix)
    out = tmp_path / "report"
    result = matrix("report", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"report: {out / 'index.html'}"
    names = {p.name for p in out.iterdir()}
    assert {"index.html", "campaign-1.html", "campaign-2.html", "runtime-vllm-0.29.0.html",
            "runtime-vllm-0.29.1rc1.dev347_gdee37d891.html", "runtime-reference-0.1.0.html",
            "compare-vllm_0.29.0-vs-vllm_0.30.0.html"} <= names  # fmt: skip
    assert not [n for n in names if n.endswith(".tmp")]


def test_grid_has_text_labels_links_marks_and_sparklines(matrix: Matrix, tmp_path: Path) -> None:
    populate(matrix)
    index = (tmp_path / "r" / "index.html").parent
    with db(matrix) as s:
        index = write_report(s, tmp_path / "r")
    html = index.read_text()
    assert re.search(
        r'class="cell st-passed"[^>]*><a href="runtime-vllm-0.29.0.html#cell-vllm_agg_check">PASS</a>', html
    )
    assert ">TIMEOUT</a>" in html and ">FAIL</a>" in html and ">NO RESULT</a>" in html
    assert '<span class="note">flaky</span>' in html and '<span class="note">attempt 2</span>' in html
    assert '<span class="note">lacks fix</span>' in html
    assert "version 0.29.0 outside the case&#39;s constraint &gt;=0.30.0" in html  # n/a cells say why
    assert "<polyline" in html and "<svg" in html
    # versions in PEP 440 order, the dev build between the rc and 0.30.0
    order = [m.group(1) for m in re.finditer(r'<a href="runtime-vllm-([^"]+)\.html">', html)]
    assert order[:6] == ["0.28.0", "0.29.0", "0.29.1rc0", "0.29.1rc1.dev347_gdee37d891", "0.30.0", "0.31.0"]


def test_hostile_text_is_shown_as_text_never_as_markup(matrix: Matrix, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "prefill.log").write_text(("A" * 200 + "\n") * 6000 + HOSTILE + " --api-key sk-live\n")
    populate(matrix, logs)
    with db(matrix) as s:
        write_report(s, tmp_path / "r")
    for page in (tmp_path / "r").glob("*.html"):
        html = page.read_text()
        tags = elements(html)
        assert "script" not in tags and "img" not in tags, page.name
        assert "<script" not in html.lower(), page.name
        assert "\x1b" not in html and "hunter2" not in html and "sk-live" not in html, page.name
    runtime = (tmp_path / "r" / "runtime-vllm-0.29.0.html").read_text()
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &#34;quoted&#34;" in runtime
    assert "HF_TOKEN=***" in runtime and "--api-key ***" in runtime
    assert "red" in runtime and "[31m" not in runtime
    assert '<details class="log"><summary>prefill.log: last 200 line(s)' in runtime
    assert len(runtime) < 200_000  # a 1.2 MB log contributes its capped tail only
    notes = (tmp_path / "r" / "runtime-vllm-0.31.0.html").read_text()
    assert "&lt;script&gt;alert(&#39;notes&#39;)&lt;/script&gt;" in notes
    campaign_page = (tmp_path / "r" / "campaign-1.html").read_text()
    assert "vllm and &lt;b&gt;" in campaign_page


def test_runtime_page_shows_the_whole_outcome(matrix: Matrix, tmp_path: Path) -> None:
    populate(matrix)
    with db(matrix) as s:
        write_report(s, tmp_path / "r")
    html = (tmp_path / "r" / "runtime-vllm-0.29.0.html").read_text()
    assert BIG_ID in html  # u64 worker ids, lossless
    assert "worker_ids_distinct" in html and "failure kind validation" in html
    assert '<a href="https://github.com/vllm-project/vllm/pull/54814">vllm#54814</a>' in html
    assert "vllm-rs 0.29.0 predates the fix" in html
    for text in ("cuda visible devices", "GPU-1", "memory (RSS): prefill 24.5 MB", "GPU memory 3.4 GB", "31961",
                 "91", "64", "length", "ready", "1.000 s", "campaign-1.html", "FLAKY", "provider", "host"):  # fmt: skip
        assert text in html, text
    # Words, not recorded keys: no `rss_bytes.prefill` or `cpu_s.decode` on the page.
    for raw in ("rss_bytes", "gpu_bytes", "cpu_s."):
        assert raw not in html, raw


def test_selection_scopes_the_report(matrix: Matrix, tmp_path: Path) -> None:
    populate(matrix)
    with db(matrix) as s:
        write_report(s, tmp_path / "r", Selection(backends=("reference",)))
    names = {p.name for p in (tmp_path / "r").iterdir()}
    assert "runtime-reference-0.1.0.html" in names
    assert not [n for n in names if n.startswith("runtime-vllm")]
    assert "campaign-2.html" in names and "campaign-1.html" not in names
    index = (tmp_path / "r" / "index.html").read_text()
    assert "Selection backends=reference" in index and "[&#39;" not in index  # words, not a Python list
    assert matrix("report", "--out", str(tmp_path / "x"), "--backend", "nosuch").exit_code == 2


def _count_queries(m: Matrix, out: Path) -> int:
    engine = create_db_engine(f"sqlite:///{m.db_path}")
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    with session_factory(engine)() as session:
        write_report(session, out)
    engine.dispose()
    return len(statements)


def test_report_queries_do_not_grow_with_attempts(matrix: Matrix, tmp_path: Path) -> None:
    populate(matrix)
    before = _count_queries(matrix, tmp_path / "a")
    with db(matrix) as s:
        for _ in range(30):
            camp = campaign(s)
            for case in ("vllm_agg_check", "vllm_long_prompt", "vllm_disaggregated"):
                attempt(s, camp, case, "vllm=0.29.0", "failed", checks=[{"name": "c", "message": "m"}])
    assert _count_queries(matrix, tmp_path / "b") == before


def test_templates_autoescape_and_never_mark_data_safe() -> None:
    assert environment().autoescape is True
    for template in resource_dir("templates").glob("*.html"):
        text = template.read_text()
        assert not re.search(r"\|\s*safe\b|autoescape\s+false|Markup", text), template.name
        assert "<script" not in text and "http://" not in text and "https://" not in text, template.name
