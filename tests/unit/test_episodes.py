"""[M30] item 1: failure episodes open on a cell's failure, stay open across campaigns and repeats, and close
only on an observed pass of the same cell; skips and interruptions neither open nor close one."""

from __future__ import annotations

import json

from tests.helpers.cli import Matrix
from tests.helpers.reports import attempt, campaign, db, sync


def _history(m: Matrix, case: str, spec: str, statuses: str) -> None:
    """One campaign per letter: P passed, F failed, T timeout, S skipped, I interrupted."""
    words = {"P": "passed", "F": "failed", "T": "timeout", "S": "skipped", "I": "interrupted"}
    with db(m) as s:
        for letter in statuses:
            status = words[letter]
            checks = [{"name": "http_status", "message": "HTTP 503"}] if letter == "F" else []
            kind = {"F": "validation", "T": "request"}.get(letter)
            message = "no answer in 60 s" if letter == "T" else ""
            attempt(s, campaign(s), case, spec, status, checks=checks, failure_kind=kind, message=message)


def _episodes(m: Matrix, *args: str) -> list[dict[str, object]]:
    result = m("episodes", "--json", *args)
    assert result.exit_code == 0, result.output
    found: list[dict[str, object]] = json.loads(result.output)["episodes"]
    return found


def test_the_open_episode_names_its_first_bad_and_last_good(matrix: Matrix) -> None:
    sync(matrix)
    _history(matrix, "vllm_agg_check", "vllm=0.30.0", "PFSFIPTFP")
    _history(matrix, "vllm_disaggregated", "vllm=0.30.0", "PTTS")
    episodes = _episodes(matrix)
    by_case = {(e["case"], e["state"]): e for e in episodes}
    # vllm_agg_check: F S F I P -> one episode of 2 failures closed by the P; T F P -> another, closed.
    agg = [e for e in episodes if e["case"] == "vllm_agg_check"]
    assert [(e["state"], e["failures"]) for e in agg] == [("closed", 2), ("closed", 2)]
    first, second = sorted(agg, key=lambda e: e["first_bad"]["campaign"])  # type: ignore[index]
    assert first["last_good"]["campaign"] == 1 and first["closed_by"]["campaign"] == 6  # type: ignore[index]
    assert second["class"] == "request" and second["signature"] == "no answer in 60 s"
    # vllm_disaggregated: P T T S -> open since its first timeout, the skip changes nothing.
    open_one = by_case[("vllm_disaggregated", "open")]
    assert open_one["failures"] == 2 and open_one["closed_by"] is None
    assert open_one["first_bad"]["status"] == "timeout"  # type: ignore[index]
    assert [e["case"] for e in _episodes(matrix, "--open")] == ["vllm_disaggregated"]
    text = matrix("episodes").output
    assert "3 episode(s), 1 open" in text and "vllm_disaggregated@vllm-0.30.0" in text


def test_no_failure_no_episode(matrix: Matrix) -> None:
    sync(matrix)
    _history(matrix, "vllm_agg_check", "vllm=0.30.0", "PPSI")
    assert _episodes(matrix) == []
    assert "0 episode(s), 0 open: no cell has failed" in matrix("episodes").output
