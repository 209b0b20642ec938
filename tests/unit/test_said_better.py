"""[M29] item 16: small things said better (each failed before its fix)."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrix.errors import ConfigError
from matrix.fanout.shard_results import parse_results
from matrix.report.data import AttemptRow


def test_a_cut_short_results_file_is_one_clean_sentence(tmp_path: Path) -> None:
    path = tmp_path / "shard.json"
    with pytest.raises(ConfigError) as caught:
        parse_results(path, '{"format": "matrix-shard-results", "cells": [')
    message = str(caught.value)
    assert "\n" not in message and "?." not in message, message
    assert message.startswith(f"{path}: not valid JSON, perhaps cut short (Expecting value at line 1, column ")
    assert "). Nothing was imported;" in message


def _row(checks: list[dict[str, str]]) -> AttemptRow:
    return AttemptRow(1, 1, 1, 1, 1, "failed", "validation", False, "", False, None, None, None, checks)


def test_a_check_failed_by_the_streaming_request_says_so() -> None:
    row = _row([
        {"name": "completion_tokens", "message": "usage.completion_tokens is 0; expected at least 1"},
        {"name": "completion_tokens", "message": "stream: usage.completion_tokens is 0; expected at least 1"},
        {"name": "stream", "message": "stream: protocol: broken event stream"},
    ])  # fmt: skip
    assert row.check_names == ["completion_tokens", "completion_tokens (stream request)", "stream"]
