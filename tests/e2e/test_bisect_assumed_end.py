"""`matrix bisect` says that it took the good end as given without running it ([M29] item 14), on real pairs:
only the bad end and versions between are probed, so a result that rests on an unrun end must say so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import Matrix
from tests.helpers.synth import campaign_rows, sync_synth, synthetic_catalog

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_the_result_says_the_good_end_was_assumed_and_how_to_check_it(matrix: Matrix, tmp_path: Path) -> None:
    sync_synth(matrix, synthetic_catalog(tmp_path / "synth.toml", 4, 2))
    result = matrix.subprocess("bisect", "synth_pair", "--between", "1.0.0", "1.3.0", "--json", timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert data["first"] == "1.2.0" and data["assumed_good"] == "1.0.0", data
    assert "1.0.0" not in [version for version, _status in campaign_rows(matrix, data["campaign"])]
    assert "the good end 1.0.0 was assumed to pass without running it here" in data["note"], data["note"]
    assert "`matrix run --case synth_pair --runtime synth=1.0.0` checks it" in data["note"], data["note"]
    # The text result says it too (the same command again reuses the finished bisect's probes).
    text = matrix.subprocess("bisect", "synth_pair", "--between", "1.0.0", "1.3.0", timeout=240)
    assert "the good end 1.0.0 was assumed to pass without running it here" in text.stdout, text.stdout
