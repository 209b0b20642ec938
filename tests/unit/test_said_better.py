"""[M29] item 16: small things said better (each failed before its fix)."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrix.errors import ConfigError
from matrix.fanout.shard_results import parse_results
from matrix.report.data import AttemptRow
from tests.helpers.cli import Matrix


def test_an_empty_catalog_file_gets_a_warning(matrix: Matrix, tmp_path: Path) -> None:
    empty, comments = tmp_path / "empty.toml", tmp_path / "comments.toml"
    empty.write_bytes(b"")
    comments.write_text("# nothing here yet\n\n")
    result = matrix.subprocess("catalog", "sync", str(empty), str(comments))
    assert result.returncode == 0, result.stderr
    assert f"warning: catalog file {empty} is empty (0 bytes): nothing is read from it" in result.stderr
    assert f"warning: catalog file {comments} defines no entries" in result.stderr


def test_a_cut_short_results_file_is_one_clean_sentence(tmp_path: Path) -> None:
    path = tmp_path / "shard.json"
    with pytest.raises(ConfigError) as caught:
        parse_results(path, '{"format": "matrix-shard-results", "cells": [')
    message = str(caught.value)
    assert "\n" not in message and "?." not in message, message
    assert message.startswith(f"{path}: not valid JSON, perhaps cut short (Expecting value at line 1, column ")
    assert "). Nothing was imported;" in message


@pytest.mark.parametrize(("control", "shown"), [("\r", "\\r"), ("\n", "\\n"), ("\x1b", "\\x1b"), ("\u202e", "\\u202e")])
def test_a_control_character_in_a_marker_expression_stays_on_one_line(
    seeded: Matrix, control: str, shown: str
) -> None:
    result = seeded.subprocess("plan", "-m", f"gpu_0 and{control}foo")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].endswith(f'at column 10: unexpected character "{shown}"'), lines[0]


def _row(checks: list[dict[str, str]]) -> AttemptRow:
    return AttemptRow(1, 1, 1, 1, 1, "failed", "validation", False, "", False, None, None, None, checks)


def test_a_check_failed_by_the_streaming_request_says_so() -> None:
    row = _row([
        {"name": "completion_tokens", "message": "usage.completion_tokens is 0; expected at least 1"},
        {"name": "completion_tokens", "message": "stream: usage.completion_tokens is 0; expected at least 1"},
        {"name": "stream", "message": "stream: protocol: broken event stream"},
    ])  # fmt: skip
    assert row.check_names == ["completion_tokens", "completion_tokens (stream request)", "stream"]
