"""CI fan-out planning: stable cell ids, shards balanced by expected duration, the GitHub matrix JSON.

`assert_github_include_matrix` checks the JSON against GitHub's documented `strategy.matrix` semantics
for a matrix made only of `include`: every entry becomes exactly one job, so the top level must be an
object with `include` alone, a list of at most 256 objects whose values are scalars, and no two
entries may be equal (GitHub would still run both, but under one name, and our shards must differ).
"""

from __future__ import annotations

import json
import random

import pytest

from matrix.cells import CaseInfo, Cell, RuntimeInfo
from matrix.errors import ConfigError
from matrix.fanout.shards import (
    cell_id,
    default_campaign_key,
    expected_seconds,
    github_matrix,
    pick_cells,
    shard_cells,
    split_cell_args,
)
from matrix.markers import parse_marker_use
from matrix.plan import Selection, make_plan
from tests.helpers.cli import Matrix
from tests.helpers.fanout import assert_github_include_matrix


def _cell(case: str, version: str = "1.0.0", *, timeout: float = 60.0, case_id: int = 1, gpus: int = 0) -> Cell:
    markers = (parse_marker_use(f"gpu_{gpus}"),)
    return Cell(
        CaseInfo(name=case, backend="b", arm="reference", model="m", markers=markers, marker_texts=(f"gpu_{gpus}",),
                 startup_timeout_s=timeout, request_timeout_s=0.0, id=case_id),
        RuntimeInfo(backend="b", version=version, tag=f"v{version}", id=case_id * 1000),
    )  # fmt: skip


def _cells(n: int, seed: int = 7) -> list[Cell]:
    rng = random.Random(seed)
    return [_cell(f"case_{i:04d}", timeout=float(rng.choice([30, 60, 120, 300, 600])), case_id=i) for i in range(n)]


def _expected(cells: list[Cell]) -> dict[str, float]:
    return {c.key: expected_seconds(c, {}) for c in cells}


# --- stable ids ------------------------------------------------------------------------------------------


def test_cell_id_is_a_hash_of_the_key_only() -> None:
    # Pinned: a plan made by one matrix version must be runnable by the next.
    assert cell_id("reference_disaggregated@reference-0.1.0") == "c3d2319a1ba3"
    a, b = _cell("x", case_id=1), _cell("x", case_id=99)  # other database ids, same key
    assert cell_id(a.key) == cell_id(b.key)
    assert cell_id("x@b-1.0.0") != cell_id("x@b-1.0.1")


def test_split_cell_args_accepts_commas_and_repeats() -> None:
    assert split_cell_args(["a,b", " c ", "a", ",,"]) == ("a", "b", "c")


def test_pick_cells_by_id_or_key_and_names_unknown_ones() -> None:
    cases = [CaseInfo(name=n, backend="b", arm="reference", model="m", markers=(), id=i)
             for i, n in enumerate(["one", "two"], 1)]  # fmt: skip
    runtimes = [RuntimeInfo(backend="b", version="1.0", tag="v1.0", id=1),
                RuntimeInfo(backend="b", version="2.0", tag="v2.0", id=2, enabled=False)]  # fmt: skip
    plan = make_plan(cases, runtimes, Selection(), known_markers=set(), known_backends={"b"})
    assert [c.key for c in plan.cells] == ["one@b-1.0", "two@b-1.0"]
    picked = pick_cells(plan, [cell_id("two@b-1.0"), "one@b-1.0"])
    assert [c.key for c in picked] == ["one@b-1.0", "two@b-1.0"]  # plan order
    with pytest.raises(ConfigError, match=r"nope is not a cell of this catalog.*matrix plan --json"):
        pick_cells(plan, ["one@b-1.0", "nope"])
    with pytest.raises(ConfigError, match=r"one@b-2.0\) is excluded: runtime is disabled"):
        pick_cells(plan, [cell_id("one@b-2.0")])


# --- sharding ------------------------------------------------------------------------------------------------


def test_few_cells_get_one_shard_each_longest_first() -> None:
    cells = [_cell("short", timeout=10, case_id=1), _cell("long", timeout=500, case_id=2),
             _cell("mid", timeout=100, case_id=3)]  # fmt: skip
    shards = shard_cells(cells, _expected(cells), 256)
    assert [s.name for s in shards] == ["long@b-1.0.0", "mid@b-1.0.0", "short@b-1.0.0"]
    assert [s.expected_s for s in shards] == [500, 100, 10]
    entries = assert_github_include_matrix(github_matrix(shards))
    assert entries[0] == {
        "shard": shards[0].id, "name": "long@b-1.0.0", "cells": cell_id("long@b-1.0.0"), "count": 1,
        "expected_s": 500, "gpus": 0,
    }  # fmt: skip
    assert all(e["shard"].startswith(f"s{i:03d}-") for i, e in enumerate(entries, 1))


@pytest.mark.parametrize(("n", "max_jobs"), [(10_000, 256), (1000, 256), (257, 256), (50, 7), (5, 1)])
def test_every_cell_lands_in_exactly_one_shard_and_shards_are_balanced(n: int, max_jobs: int) -> None:
    cells = _cells(n)
    expected = _expected(cells)
    shards = shard_cells(cells, expected, max_jobs)
    assert len(shards) == min(n, max_jobs)
    keys = [c.key for s in shards for c in s.cells]
    assert sorted(keys) == sorted(c.key for c in cells), "every cell exactly once"
    for shard in shards:
        assert shard.expected_s == pytest.approx(sum(expected[c.key] for c in shard.cells))
    loads = [s.expected_s for s in shards]
    mean, longest = sum(loads) / len(loads), max(expected.values())
    # LPT's guarantees: within 4/3 of the optimum (which is at least the mean and the longest cell), and
    # the longest shard exceeds the mean by less than one cell (the last one placed on it).
    assert max(loads) <= 4 / 3 * max(mean, longest)
    assert max(loads) <= mean + longest
    if n / max_jobs >= 30:
        assert max(loads) / mean < 1.02, "many cells per shard pack almost perfectly"
    assert_github_include_matrix(github_matrix(shards), max_jobs=max_jobs)


def test_lpt_assignment_step_by_step() -> None:
    # Longest first onto the least loaded shard (lowest index on a tie):
    # 70->A, 60->B, 50->C, 40->C (90), 30->B (90), 30->A (100), 20->B (110). Longest shard first.
    durations = [70, 60, 50, 40, 30, 30, 20]
    cells = [_cell(f"c{i}", timeout=d, case_id=i) for i, d in enumerate(durations)]
    shards = shard_cells(cells, _expected(cells), 3)
    assert [(s.expected_s, sorted(int(c.case.startup_timeout_s) for c in s.cells)) for s in shards] == [
        (110, [20, 30, 60]),
        (100, [30, 70]),
        (90, [40, 50]),
    ]
    assert [s.name for s in shards] == ["shard 1/3 (3 cells)", "shard 2/3 (2 cells)", "shard 3/3 (2 cells)"]


def test_sharding_is_deterministic_whatever_the_input_order() -> None:
    cells = _cells(600)
    first = json.dumps(github_matrix(shard_cells(cells, _expected(cells), 256)))
    shuffled = cells[:]
    random.Random(1).shuffle(shuffled)
    assert json.dumps(github_matrix(shard_cells(shuffled, _expected(shuffled), 256))) == first


def test_history_replaces_timeouts_as_the_expected_duration() -> None:
    slow_on_paper = _cell("paper", timeout=600, case_id=1)
    slow_in_fact = _cell("fact", timeout=10, case_id=2)
    history = {1: 5.0, 2: 900.0}
    assert expected_seconds(slow_on_paper, history) == 5.0
    assert expected_seconds(_cell("new", timeout=42, case_id=3), history) == 42
    cells = [slow_on_paper, slow_in_fact]
    shards = shard_cells(cells, {c.key: expected_seconds(c, history) for c in cells}, 256)
    assert [s.name for s in shards] == ["fact@b-1.0.0", "paper@b-1.0.0"]


def test_a_shard_says_how_many_gpus_its_cells_need() -> None:
    cells = [_cell("cpu", case_id=1, gpus=0), _cell("two", case_id=2, gpus=2)]
    (shard,) = shard_cells(cells, _expected(cells), 1)
    assert shard.gpus == 2 and shard.matrix_entry()["count"] == 2


@pytest.mark.parametrize("bad", [0, -1, 257])
def test_max_jobs_outside_github_limits_is_an_error(bad: int) -> None:
    with pytest.raises(ConfigError, match="between 1 and 256"):
        shard_cells(_cells(3), _expected(_cells(3)), bad)


def test_campaign_key_defaults_to_the_github_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GITHUB_RUN_ID", "123456")
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/repo")
    assert default_campaign_key() == "github:org/repo/123456"
    monkeypatch.delenv("GITHUB_RUN_ID")
    one, two = default_campaign_key(), default_campaign_key()
    assert one.startswith("run:") and one != two


# --- the command ---------------------------------------------------------------------------------------------


def test_plan_github_matrix_covers_the_plan_once(seeded: Matrix) -> None:
    result = seeded("plan", "--format", "github-matrix")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("\n") == 1, "one line, for $GITHUB_OUTPUT"
    entries = assert_github_include_matrix(json.loads(result.stdout))
    planned = json.loads(seeded("plan", "--json").stdout)["cells"]
    ids = [i for e in entries for i in e["cells"].split(",")]
    assert sorted(ids) == sorted(c["id"] for c in planned)
    assert f"{len(planned)} cells in {len(entries)} shards" in result.stderr
    again = seeded("plan", "--format", "github-matrix")
    assert again.stdout == result.stdout


def test_plan_github_matrix_packs_into_max_jobs(seeded: Matrix) -> None:
    result = seeded("plan", "--format", "github-matrix", "--max-jobs", "4", "-m", "not gpu_2")
    assert result.exit_code == 0, result.output
    entries = assert_github_include_matrix(json.loads(result.stdout), max_jobs=4)
    assert len(entries) == 4
    planned = json.loads(seeded("plan", "--json", "-m", "not gpu_2").stdout)["cells"]
    assert sum(e["count"] for e in entries) == len(planned)


@pytest.mark.parametrize("bad", ["0", "257"])
def test_plan_max_jobs_out_of_range_exits_2(seeded: Matrix, bad: str) -> None:
    result = seeded("plan", "--format", "github-matrix", "--max-jobs", bad)
    assert result.exit_code == 2
    assert "between 1 and 256" in result.output


def test_plan_max_jobs_needs_github_matrix(seeded: Matrix) -> None:
    result = seeded("plan", "--max-jobs", "3")
    assert result.exit_code == 2 and "--max-jobs applies to --format github-matrix" in result.output


def test_empty_plan_prints_an_empty_include_and_says_how_to_guard(seeded: Matrix) -> None:
    result = seeded("plan", "--format", "github-matrix", "--case", "reference_disaggregated", "--backend", "vllm")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"include": []}
    assert "include[0]" in result.stderr
