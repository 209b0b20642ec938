"""[M33] item 3: after `matrix run`, only the pages its campaigns reach are rewritten, and they are the pages a
full `matrix report` writes.

Real reference campaigns on two backends. The first run writes the whole report (there was none); the second,
on the other backend, must rewrite its runtime's page, its campaign's, the gates that read that runtime and
the index, and leave the first backend's pages as they were (the same bytes, the same modification time). Every
page of the refreshed report must then be what a full report of the same database writes. A change of the
catalog (here, one more runtime) makes the next refresh a full write.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.cli import DATA, Matrix
from tests.helpers.two_backends import CATALOG

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

_GENERATED = re.compile(rb"generated \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ")
_REFRESHED = re.compile(r"report: .*index\.html \((\d+) pages refreshed in [\d.]+ s\)")
_WRITTEN = re.compile(r"report: .*index\.html \((\d+) pages written in [\d.]+ s\)")


def _pages(report: Path) -> dict[str, bytes]:
    return {p.name: _GENERATED.sub(b"generated -", p.read_bytes()) for p in sorted(report.glob("*.html"))}


def test_a_run_rewrites_only_the_pages_it_reaches_and_they_match_a_full_report(matrix: Matrix) -> None:
    path = matrix.home / "catalog.toml"
    path.write_text(CATALOG)
    synced = matrix("catalog", "sync", str(DATA / "backends.toml"), str(DATA / "markers.toml"), str(path))
    assert synced.exit_code == 0, synced.output
    report = matrix.home / "report"

    first = matrix.subprocess("run", "--backend", "reference", "-j", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    assert _WRITTEN.search(first.stdout), first.stdout  # no report yet: every page
    untouched = {p.name: p.stat().st_mtime_ns for p in report.glob("*reference*.html")}
    assert "runtime-reference-0.1.0.html" in untouched
    assert "compare-reference_0.1.0-vs-reference_0.2.0.html" in untouched

    second = matrix.subprocess("run", "--backend", "synth")
    assert second.returncode == 0, second.stdout + second.stderr
    refreshed = _REFRESHED.search(second.stdout)
    assert refreshed, second.stdout
    after = {p.name: p.stat().st_mtime_ns for p in report.glob("*reference*.html")}
    assert after == untouched, "a run of synth rewrote pages of the reference runtimes"
    pages = _pages(report)
    assert "runtime-synth-1.0.0.html" in pages and "campaign-2.html" in pages
    # runtime, campaign, one gate page per policy of synth 1.0.0, the index: far fewer than the report holds
    assert int(refreshed.group(1)) < len(pages)

    full = matrix("report", "--out", str(matrix.home / "full"))
    assert full.exit_code == 0, full.output
    assert _pages(matrix.home / "full") == pages, "the refreshed report differs from a full one"

    path.write_text(CATALOG + '\n[[runtime]]\nbackend = "synth"\nversion = "1.1.0"\nprovider = { kind = "builtin" }\n')
    resynced = matrix("catalog", "sync", str(DATA / "backends.toml"), str(DATA / "markers.toml"), str(path))
    assert resynced.exit_code == 0, resynced.output
    third = matrix.subprocess("run", "--backend", "synth", "--runtime", "synth=1.0.0")
    assert third.returncode == 0, third.stdout + third.stderr
    assert _WRITTEN.search(third.stdout), f"a catalog change must make the refresh a full write:\n{third.stdout}"
    assert (report / "runtime-synth-1.1.0.html").is_file()
