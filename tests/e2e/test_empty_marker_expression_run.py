"""[M11] item 7: `matrix run -m ""` runs the selection (a real reference pair; moved from the unit tests,
which start no serving processes)."""

from __future__ import annotations

import json

from tests.helpers.cli import Matrix


def test_run_with_an_empty_expression_runs_the_selection(seeded: Matrix) -> None:
    """An empty CI variable (`-m "$MARKERS"`) used to select nothing and exit 0 having run nothing."""
    result = seeded.subprocess(
        "run", "-m", "", "--case", "reference_disaggregated", "--runtime", "reference=0.1.0", "--no-report"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert seeded.sql("SELECT status FROM cell_run") == [("passed",)]
    selection = json.loads(str(seeded.sql("SELECT selection FROM campaign")[0][0]))
    assert selection["marker_expression"] is None
