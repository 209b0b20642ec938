"""Small things said better ([M29] item 16), through the real `matrix` command: an empty catalog file warns,
a control character in a marker expression is shown as its escape so the error stays on one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli import Matrix

pytestmark = pytest.mark.e2e


def test_an_empty_catalog_file_gets_a_warning(matrix: Matrix, tmp_path: Path) -> None:
    empty, comments = tmp_path / "empty.toml", tmp_path / "comments.toml"
    empty.write_bytes(b"")
    comments.write_text("# nothing here yet\n\n")
    result = matrix.subprocess("catalog", "sync", str(empty), str(comments))
    assert result.returncode == 0, result.stderr
    assert f"warning: catalog file {empty} is empty (0 bytes): nothing is read from it" in result.stderr
    assert f"warning: catalog file {comments} defines no entries" in result.stderr


@pytest.mark.parametrize(("control", "shown"), [("\r", "\\r"), ("\n", "\\n"), ("\x1b", "\\x1b"), ("\u202e", "\\u202e")])
def test_a_control_character_in_a_marker_expression_stays_on_one_line(
    seeded: Matrix, control: str, shown: str
) -> None:
    result = seeded.subprocess("plan", "-m", f"gpu_0 and{control}foo")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].endswith(f'at column 10: unexpected character "{shown}"'), lines[0]
