"""`SharedEngines` on real processes (the reference workers, a second each to start): an engine starts once
and is reused, one that died is restarted and the pair that finds it says so, the last use stops it, and
nothing is left. The vLLM grids that use it end to end are in `test_vllm_skew.py`."""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import pytest

from matrix.cells import CaseInfo, RuntimeInfo
from matrix.executors.shared_engines import Acquired, GridPlan, SharedEngines
from matrix.hardware.ports import PortAllocator
from matrix.launch.providers import Environment
from matrix.launch.supervisor import find_cell_processes
from matrix.paths import port_registry_path
from matrix.runner import LiveCells
from tests.helpers.processes import port_still_held

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CASE = CaseInfo("ref", "reference", "reference", "tiny", (), launch={}, startup_timeout_s=60)
RUNTIME = RuntimeInfo(backend="reference", version="0.1.0", tag="v0.1.0")
PREFILL = ("prefill", RUNTIME.label)
DECODE = ("decode", RUNTIME.label)


def _grid(tmp_path: Path, uses: int) -> SharedEngines:
    plan = GridPlan("ref", frozenset(), Counter({PREFILL: uses, DECODE: uses}), {PREFILL: RUNTIME, DECODE: RUNTIME})
    return SharedEngines(plan, tmp_path / "engines", PortAllocator(port_registry_path()), LiveCells())


def test_an_engine_is_reused_restarted_after_death_and_stopped_after_its_last_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MATRIX_HOME", str(tmp_path / "home"))
    engines = _grid(tmp_path, uses=3)
    environment = Environment()
    first = engines.acquire(PREFILL, RUNTIME, environment, CASE, "pair-1")
    assert isinstance(first, Acquired) and first.started_now, first
    assert engines.release([PREFILL]) == []  # two uses left: still running
    second = engines.acquire(PREFILL, RUNTIME, environment, CASE, "pair-2")
    assert isinstance(second, Acquired) and not second.started_now
    assert second.engine.supervisor is first.engine.supervisor and "shared, started for pair-1" in second.note
    engines.release([PREFILL])
    # The engine dies between pairs: the next pair restarts it and its row says how the old one ended.
    assert first.engine.supervisor is not None
    old_id = first.engine.plan.cell_id if first.engine.plan else ""
    os.killpg(first.engine.supervisor.pids()["prefill"], signal.SIGKILL)
    first.engine.supervisor._children[0].popen.wait(timeout=10)  # reaped: its exit code is known
    third = engines.acquire(PREFILL, RUNTIME, environment, CASE, "pair-3")
    assert isinstance(third, Acquired) and third.started_now
    assert "restarted (start 2)" in third.note and "exited with code -9 after serving pair-1, pair-2" in third.note
    assert find_cell_processes(old_id) == []
    ports = dict(third.engine.ports)
    new_id = third.engine.plan.cell_id if third.engine.plan else ""
    (stopped,) = engines.release([PREFILL])  # the last use: stopped now, its teardown for that pair's row
    assert stopped[1].clean and engines.running() == []
    assert find_cell_processes(new_id) == []
    assert not any(port_still_held(port, new_id) for port in ports.values())
    engines.close()


def test_close_stops_engines_whose_pairs_never_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MATRIX_HOME", str(tmp_path / "home"))
    engines = _grid(tmp_path, uses=2)
    engines.start_ahead([(PREFILL, Environment()), (DECODE, Environment())], CASE, "pair-1")
    got = engines.acquire(DECODE, RUNTIME, Environment(), CASE, "pair-1")
    assert isinstance(got, Acquired) and "started ahead of this pair" in got.note
    ids = [e.plan.cell_id for e in engines.running() if e.plan]
    engines.close()  # e.g. fail-fast: the remaining pairs never came
    assert engines.running() == []
    assert all(find_cell_processes(cell_id) == [] for cell_id in ids)
