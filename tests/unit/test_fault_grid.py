"""Fault grids ([M28]): which cells share one pair, the plan its engines start from, and how a cell switches
the class in force and gets its own events back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from matrix.cells import CaseInfo, Cell, RuntimeInfo
from matrix.check.faults import EVENTS_FILE, evidence
from matrix.errors import ConfigError
from matrix.executors import fault_grid
from matrix.executors.shared_engines import engine_plan, grid_plans
from matrix.kv_faults import FaultSpec, parse
from matrix.launch.faults import role_env, write_control
from matrix.launch.providers import Environment
from matrix.skew import expand_skew

LAUNCH = {"cpu": True, "max_model_len": 512}


def _case(name: str, **extra: object) -> CaseInfo:
    return CaseInfo(name, "vllm-cpu", "vllm_native", "tiny", (), launch={**LAUNCH, **extra})


def _cell(case: CaseInfo, version: str = "0.32.0") -> Cell:
    return Cell(case, RuntimeInfo(backend="vllm-cpu", version=version, tag=f"v{version}"))


def test_cases_differing_only_in_their_fault_share_one_pair_per_runtime_with_their_healthy_twin() -> None:
    healthy, stale, lost = _case("none"), _case("stale", kv_fault="stale"), _case("lost", kv_fault="lost_notification")
    cells = [_cell(c, v) for c in (healthy, stale, lost) for v in ("0.30.0", "0.32.0")]
    plans = grid_plans(cells + cells)  # --repeat 2
    assert set(plans) == {"faults-lost"}
    grid = plans["faults-lost"]
    assert grid.faults and grid.keys == {c.key for c in cells}
    assert grid.engines == 4 and set(grid.uses.values()) == {6}


def test_a_case_whose_engines_differ_or_a_group_without_a_fault_runs_per_cell() -> None:
    stale, twin = _cell(_case("stale", kv_fault="stale")), _cell(_case("twin"))
    longer = [_cell(_case(name, max_model_len=1024)) for name in ("long", "long2")]
    plans = grid_plans([stale, twin, *longer])
    assert set(plans) == {"faults-stale"}
    assert plans["faults-stale"].keys == {stale.key, twin.key}


def test_a_model_revision_case_shares_a_pair_only_with_its_own_repeats() -> None:
    """`model_revision` is made at launch (another model on one role): no pair of another case can serve it,
    and a single cell starts a pair of its own; its repeats (`--repeat N`) share one pair whose engine is the
    fault, where each would start a pair (about 110 s on a 2-core host)."""
    stale, twin = _cell(_case("stale", kv_fault="stale")), _cell(_case("twin"))
    revision = _cell(_case("rev", kv_fault="model_revision"))
    assert set(grid_plans([stale, twin, revision])) == {"faults-stale"}
    plans = grid_plans([stale, twin, revision, revision, revision])
    assert set(plans) == {"faults-stale", "faults-rev"} and plans["faults-stale"].keys == {stale.key, twin.key}
    grid = plans["faults-rev"]
    assert grid.faults and grid.keys == {revision.key} and set(grid.uses.values()) == {3}


def test_a_model_revision_grid_cell_writes_no_class_and_copies_no_launch_event_twice(tmp_path: Path) -> None:
    """The faulted engine serves every cell with the other weights; the class is no plugin's, so nothing is
    written into a control file, and the engine's launch event (its own directory's) is not copied into the
    cell: the cell's plan of its pair records it there, once, as in a per-cell pair."""
    controls = {role: tmp_path / f"control-{role}" for role in ("prefill", "decode")}
    work = {role: tmp_path / role for role in controls}
    for directory in work.values():
        directory.mkdir()
    launch = {"event": "injected", "class": "model_revision", "role": "decode", "request_id": "decode engine",
              "effective": True}  # fmt: skip
    (work["decode"] / EVENTS_FILE).write_text(json.dumps(launch) + "\n")
    cell_dir = tmp_path / "cell"
    cell_dir.mkdir()
    (cell_dir / EVENTS_FILE).write_text(json.dumps(launch) + "\n")  # what the cell's plan wrote
    switch = fault_grid.arm("model_revision", controls, work)
    assert all(control.read_text() == "" for control in controls.values())
    fault_grid.disarm(switch, cell_dir)
    assert evidence("model_revision", cell_dir) == (1, "model_revision on decode",
                                                    "1 effective injection(s) on 1 request(s)")  # fmt: skip


def test_skew_cells_stay_in_their_skew_grid_and_topologies_own_their_engines() -> None:
    stale = _case("stale", kv_fault="stale")
    skewed = expand_skew([_cell(stale, "0.30.0"), _cell(stale, "0.32.0")], frontend=False)
    topology = _case("topo", kv_fault="stale", topology="2p1d")
    plans = grid_plans([*skewed, _cell(topology)])
    assert set(plans) == {"stale"} and not plans["stale"].faults


def test_a_fault_grids_engine_loads_the_plugin_for_every_class_reading_its_control_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MATRIX_HOME", str(tmp_path / "home"))
    runtime = RuntimeInfo(backend="vllm-cpu", version="0.32.0", tag="v0.32.0")
    environment = Environment(python="/envs/0.32.0/bin/python", env={"PATH": "/envs/0.32.0/bin"})
    control = tmp_path / "kv-fault-control-decode"
    ports = {"decode_http": 21001, "decode_side_channel": 21002}
    case = _case("stale", kv_fault="stale")
    (process,) = engine_plan(("decode", runtime.label), runtime, environment, case, "g", ports, tmp_path / "e",
                             control).processes  # fmt: skip
    assert process.env["MATRIX_KV_FAULT_CONTROL"] == str(control)
    assert "MATRIX_KV_FAULT" not in process.env  # not the first case's class for good
    assert process.env["MATRIX_KV_FAULT_EVENTS"] == str(tmp_path / "e" / EVENTS_FILE)
    assert (Path(process.env["PYTHONPATH"].split(":")[0]) / "matrix_vllm_kv_faults.py").is_file()
    # A fault made at launch stays the engine's own in a grid: decode loads the other revision from its
    # own directory (the plugin loaded beside it, no class in force).
    models = []
    for suffix in ("", "-r1"):  # both revisions as if generated before: a unit test runs no generator
        model = tmp_path / "home" / "models" / f"tiny-qwen3-v4096-random-w3{suffix}"
        model.mkdir(parents=True)
        (model / "tokenizer.json").write_text("{}")
        (model / "model.safetensors").write_bytes(f"weights{suffix}".encode())
        models.append(model)
    revision = _case("rev", kv_fault="model_revision", model_dir="tiny-random")
    (faulted,) = engine_plan(("decode", runtime.label), runtime, environment, revision, "g", ports,
                             tmp_path / "r", control).processes  # fmt: skip
    assert (Path(str(faulted.cwd)) / models[0].name).resolve() == models[1].resolve()
    assert faulted.env["MATRIX_KV_FAULT_CONTROL"] == str(control)
    # Without a control file (a skew grid), the case's own fault, on its own role, as a per-cell run.
    (plain,) = engine_plan(("decode", runtime.label), runtime, environment, case, "g", ports, tmp_path / "p").processes
    assert plain.env["MATRIX_KV_FAULT"] == "stale" and "MATRIX_KV_FAULT_CONTROL" not in plain.env


def test_a_cell_puts_its_class_on_its_role_and_gets_back_only_the_events_of_its_own_turn(tmp_path: Path) -> None:
    controls = {role: tmp_path / f"control-{role}" for role in ("prefill", "decode")}
    work = {role: tmp_path / role for role in controls}
    for directory in work.values():
        directory.mkdir()
    earlier = {"event": "injected", "class": "lost_notification", "effective": True, "request_id": "old"}
    (work["prefill"] / EVENTS_FILE).write_text(json.dumps(earlier) + "\n")

    switch = fault_grid.arm("lost_notification", controls, work)
    assert controls["prefill"].read_text() == "lost_notification" and controls["decode"].read_text() == ""
    mine = {**earlier, "request_id": "mine"}
    with (work["prefill"] / EVENTS_FILE).open("a") as f:
        f.write(json.dumps(mine) + "\n")
    cell_dir = tmp_path / "cell"
    cell_dir.mkdir()
    fault_grid.disarm(switch, cell_dir)
    assert all(control.read_text() == "" for control in controls.values())
    assert evidence("lost_notification", cell_dir) == (1, "lost_notification on prefill",
                                                      "1 effective injection(s) on 1 request(s)")  # fmt: skip

    healthy_dir = tmp_path / "healthy"
    healthy_dir.mkdir()
    fault_grid.disarm(fault_grid.arm(None, controls, work), healthy_dir)
    assert not (healthy_dir / EVENTS_FILE).exists()  # nothing injected in its turn: no events file


def test_the_declared_healthy_twin_has_no_fault_anywhere_and_alone_still_shares_one_pair(tmp_path: Path) -> None:
    assert parse("none") == FaultSpec("none", "")
    assert evidence("none", tmp_path) is None  # never judged as a fault cell
    assert role_env("none", "decode", tmp_path, {}) == {} and role_env("none", "prefill", tmp_path, {}) == {}
    with pytest.raises(ConfigError, match="'none' \\(the healthy twin\\)"):
        parse("nonesuch")
    twin = _cell(_case("aa", kv_fault="none"))
    assert grid_plans([twin] * 200)["faults-aa"].uses == {("prefill", twin.runtime.label): 200,
                                                         ("decode", twin.runtime.label): 200}  # fmt: skip


def test_lost_notification_stops_dropping_the_moment_its_control_file_is_cleared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM may ask NIXL's agent for notifications outside the wrapped method; once the grid switched the
    class off, a late "done reading" notification must reach the prefill (it was dropped, and counted in the
    next cell's events, before)."""
    from matrix.tools.vllm_kv_faults import matrix_vllm_kv_faults as plugin

    control, events = tmp_path / "control", tmp_path / EVENTS_FILE
    monkeypatch.setenv("MATRIX_KV_FAULT_CONTROL", str(control))
    monkeypatch.setenv("MATRIX_KV_FAULT_EVENTS", str(events))

    class Agent:
        def get_new_notifs(self) -> dict[str, list[bytes]]:
            return {"decode": [b"req-1:1", b"HB:x"]}

    deaf = plugin._Deaf(Agent())
    write_control(control, "lost_notification")
    assert deaf.get_new_notifs() == {"decode": [b"HB:x"]}
    write_control(control, None)
    assert deaf.get_new_notifs() == {"decode": [b"req-1:1", b"HB:x"]}
    assert len(events.read_text().splitlines()) == 1
