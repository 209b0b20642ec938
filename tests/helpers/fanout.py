"""Assertions on the fan-out's GitHub Actions include matrix, shared by the unit and end-to-end tests."""

from __future__ import annotations

from typing import Any

from matrix.fanout.shards import (
    GITHUB_MAX_JOBS,
)


def assert_github_include_matrix(data: Any, *, max_jobs: int = GITHUB_MAX_JOBS) -> list[dict[str, Any]]:
    """Valid as `strategy.matrix: ${{ fromJSON(...) }}` with one job per entry; returns the entries."""
    assert isinstance(data, dict), "the matrix must be a JSON object"
    assert list(data) == ["include"], f"only `include` makes one job per entry, got keys {list(data)}"
    include = data["include"]
    assert isinstance(include, list)
    assert len(include) <= min(max_jobs, GITHUB_MAX_JOBS), "GitHub generates at most 256 jobs per matrix"
    for entry in include:
        assert isinstance(entry, dict) and entry, "each include entry is a non-empty object"
        for key, value in entry.items():
            assert isinstance(key, str) and key, "matrix keys are non-empty strings"
            assert isinstance(value, str | int | float) and not isinstance(value, bool), (key, value)
    names = [entry["name"] for entry in include]
    assert len(set(names)) == len(names), "job names must be unique"
    shards = [entry["shard"] for entry in include]
    assert len(set(shards)) == len(shards), "shard ids must be unique"
    return include
