"""`matrix gate` under `skew_both_ways`: the candidate against the previous release, prefill=candidate/decode=
previous and the reverse, must be works or clean-reject; a missing direction is INCOMPLETE, never GO.

Attempts are written straight into a real SQLite database (tests/helpers/reports.py), skew rows with each role's
version as `matrix run --skew` records them; the verdicts come from `matrix gate` itself.
"""

from __future__ import annotations

import json
from typing import Any

from matrix.cells import roles_key
from tests.helpers.cli import Matrix
from tests.helpers.gates import SKEW_CASES, SKEW_GATES, diagonal_passes
from tests.helpers.reports import attempt, campaign, db, sync

NIXL = "NIXL compatibility hash mismatch: Prefill and decode instances have incompatible KV layouts"
def _pair(m: Matrix, prefill: str, decode: str, status: str, **fields: Any) -> None:
    roles = {"prefill": prefill, "decode": decode}
    with db(m) as s:
        attempt(s, campaign(s), "vllm_disaggregated", f"vllm={decode}", status, roles=roles,
                roles_key=roles_key(roles), **fields)  # fmt: skip


def _gate(m: Matrix, policy: str = "upgrade") -> tuple[int, str]:
    result = m("gate", "vllm", "0.30.0", "--policy", policy)
    return result.exit_code, result.output


def test_both_directions_safe_is_go_and_says_each_class(matrix: Matrix) -> None:
    sync(matrix, SKEW_GATES)
    diagonal_passes(matrix)
    _pair(matrix, "0.30.0", "0.29.0", "passed")
    _pair(matrix, "0.29.0", "0.30.0", "failed", failure_kind="startup", message=f"decode exited with 1\n{NIXL}")
    code, out = _gate(matrix)
    assert code == 0, out
    assert out.startswith("GO")
    assert "skew-safe" in out and "prefill 0.30.0 / decode 0.29.0 is works" in out
    assert "prefill 0.29.0 / decode 0.30.0 is clean-reject" in out  # an honest refusal ships
    assert "skew_both_ways cases sidecar" in out


def test_a_hang_in_one_direction_is_no_go_naming_the_pair_and_its_class(matrix: Matrix) -> None:
    sync(matrix, SKEW_GATES)
    diagonal_passes(matrix)
    _pair(matrix, "0.30.0", "0.29.0", "passed")
    _pair(matrix, "0.29.0", "0.30.0", "timeout", failure_kind="request",
          message="no answer within 120 s: decode waited on prefill's KV (WAITING_FOR_REMOTE_KVS)")  # fmt: skip
    code, out = _gate(matrix)
    assert code == 1, out
    first, second = out.splitlines()[:2]
    assert first.startswith("NO-GO: vllm 0.30.0 under policy upgrade")
    assert second.strip() == ("version skew with the previous release 0.29.0: vllm_disaggregated: "
                              "prefill 0.29.0 / decode 0.30.0 is hang")  # fmt: skip
    assert "WAITING_FOR_REMOTE_KVS" in out  # the evidence, on the reason's line


def test_a_missing_direction_is_incomplete_not_go_with_the_command_to_run_it(matrix: Matrix) -> None:
    sync(matrix, SKEW_GATES)
    diagonal_passes(matrix)
    _pair(matrix, "0.30.0", "0.29.0", "passed")
    code, out = _gate(matrix)
    assert code == 3, out
    assert out.startswith("INCOMPLETE")
    assert "prefill 0.29.0 / decode 0.30.0 not run" in out.splitlines()[1]
    assert ("matrix run --case vllm_disaggregated --prefill-runtime vllm=0.29.0 --decode-runtime vllm=0.30.0"
            in out)  # fmt: skip
    # A skipped pair is no evidence either.
    _pair(matrix, "0.29.0", "0.30.0", "skipped", message="needs 1 GPU, host has 0")
    assert _gate(matrix)[0] == 3


def test_a_healthy_but_wrong_pair_blocks_even_when_every_diagonal_cell_passes(matrix: Matrix) -> None:
    sync(matrix, SKEW_GATES)
    diagonal_passes(matrix)
    _pair(matrix, "0.29.0", "0.30.0", "passed")
    _pair(matrix, "0.30.0", "0.29.0", "failed", failure_kind="validation", message="failed checks: kv_transfer",
          checks=[{"name": "kv_transfer", "message": "decode recomputed the prompt: 0 KV blocks pulled"}])  # fmt: skip
    result = matrix("gate", "vllm", "0.30.0", "--policy", "upgrade", "--json")
    assert result.exit_code == 1, result.output
    verdict = json.loads(result.output)
    assert verdict["verdict"] == "NO-GO" and verdict["passed"] == 3  # every required cell passed
    (skew,) = [r for r in verdict["reasons"] if r["kind"] == "skew"]
    assert skew["blocking"] and skew["case"] == "vllm_disaggregated"
    assert skew["message"].startswith("prefill 0.30.0 / decode 0.29.0 is healthy-but-wrong: answered, but "
                                      "kv_transfer failed: decode recomputed the prompt")  # fmt: skip
    assert verdict["policy"]["skew_both_ways"] == "sidecar"


def test_an_error_answer_naming_no_incompatibility_blocks_too(matrix: Matrix) -> None:
    """A 500 whose logs name no incompatibility (vLLM's own handshake timeout reads so) is no honest refusal."""
    sync(matrix, SKEW_GATES)
    diagonal_passes(matrix)
    _pair(matrix, "0.29.0", "0.30.0", "passed")
    _pair(matrix, "0.30.0", "0.29.0", "failed", failure_kind="validation", message="failed checks: http_status",
          checks=[{"name": "http_status", "message": "HTTP status is 500; expected 200; body 'failed'"}])  # fmt: skip
    result = matrix("gate", "vllm", "0.30.0", "--policy", "upgrade", "--json")
    assert result.exit_code == 1, result.output
    (skew,) = [r for r in json.loads(result.output)["reasons"] if r["kind"] == "skew"]
    assert skew["blocking"] and skew["message"].startswith(
        "prefill 0.30.0 / decode 0.29.0 is error-answer: no 200 answer, and nothing names an incompatibility: "
        "HTTP status is 500"
    ), skew


def test_the_latest_attempt_of_a_pair_decides(matrix: Matrix) -> None:
    sync(matrix, SKEW_GATES)
    diagonal_passes(matrix)
    _pair(matrix, "0.29.0", "0.30.0", "passed")
    _pair(matrix, "0.30.0", "0.29.0", "failed", failure_kind="request", message="decode died (exit code 139)",
          exit_codes={"decode": 139})  # fmt: skip
    assert _gate(matrix)[0] == 1
    _pair(matrix, "0.30.0", "0.29.0", "passed")  # fixed and run again
    assert _gate(matrix)[0] == 0


def test_true_judges_every_required_case_and_without_the_rule_skew_is_ignored(matrix: Matrix) -> None:
    sync(matrix, SKEW_GATES)
    diagonal_passes(matrix)
    _pair(matrix, "0.30.0", "0.29.0", "passed")
    _pair(matrix, "0.29.0", "0.30.0", "passed")
    code, out = _gate(matrix, "upgrade_all")
    assert code == 3, out  # vllm_agg_check and vllm_long_prompt have no skew attempts
    assert "vllm_agg_check: prefill 0.30.0 / decode 0.29.0 not run" in out
    sync(matrix, SKEW_GATES.replace('skew_both_ways = "sidecar"', "skew_both_ways = false"))
    code, out = _gate(matrix)
    assert code == 0 and "skew" not in out, out


def test_a_bad_rule_value_is_one_clear_line_and_exit_2(matrix: Matrix) -> None:
    sync(matrix, SKEW_GATES)
    diagonal_passes(matrix)
    for policy, words in (("bad_expression", "marker expression"), ("bad_type", "true or false, got 3")):
        code, out = _gate(matrix, policy)
        assert code == 2, out
        assert f"gate policy {policy!r}: rule skew_both_ways must be" in out and words in out


def test_the_first_release_has_no_previous_to_pair_with(matrix: Matrix) -> None:
    sync(matrix, SKEW_GATES)
    with db(matrix) as s:
        camp = campaign(s)
        for case in SKEW_CASES:
            attempt(s, camp, case, "vllm=0.28.0", "passed")
    result = matrix("gate", "vllm", "0.28.0", "--policy", "upgrade")
    assert "skew-no-previous" in result.output and "has no previous release to pair with" in result.output
