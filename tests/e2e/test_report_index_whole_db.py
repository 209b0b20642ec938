"""[M29] item 3: the report `matrix run` refreshes is of the database, not of the run's selection.

Two real campaigns: the first on both reference runtimes (a comparison between them), the second on another
backend only. After the second, the index still links every runtime's page, every campaign and the
reference comparison; it used to list only the second run's selection, leaving the other pages unlinked.
"""

from __future__ import annotations

import pytest

from tests.helpers.cli import DATA, Matrix
from tests.helpers.two_backends import CATALOG

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PAGES = ("runtime-reference-0.1.0.html", "runtime-reference-0.2.0.html", "runtime-synth-1.0.0.html",
         "campaign-1.html", "campaign-2.html", "compare-reference_0.1.0-vs-reference_0.2.0.html")  # fmt: skip


def test_a_narrow_run_refreshes_the_index_of_the_whole_database(matrix: Matrix) -> None:
    path = matrix.home / "catalog.toml"
    path.write_text(CATALOG)
    synced = matrix("catalog", "sync", str(DATA / "backends.toml"), str(DATA / "markers.toml"), str(path))
    assert synced.exit_code == 0, synced.output
    report = matrix.home / "report"
    first = matrix.subprocess("run", "--backend", "reference", "-j", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    index = (report / "index.html").read_text()
    assert 'href="compare-reference_0.1.0-vs-reference_0.2.0.html"' in index
    second = matrix.subprocess("run", "--backend", "synth")
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"report: {report / 'index.html'}" in second.stdout
    index = (report / "index.html").read_text()
    for page in PAGES:
        assert (report / page).is_file(), page
        assert f'href="{page}' in index, f"the index lost its link to {page} after a run of another backend"
    assert "Every planned cell and every cell with results" in index and "Selection backends=synth" not in index
