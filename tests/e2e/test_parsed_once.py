"""[M18] A cell parses neither its case's launch table nor its runtime's provider entry: both are parsed once,
where the case is read (`CaseInfo.launch`, typed per arm) and where the campaign takes its cells
(`RuntimeInfo.spec`, by `LocalHooks.with_specs`), and carried by the cell. One real reference cell on a
`host` runtime runs through the real runner while every parse is counted."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import matrix.arm_table
import matrix.cells
from matrix.cells import CaseInfo, Cell, RuntimeInfo
from matrix.executors.hooks import LocalHooks
from matrix.hardware.ports import PortAllocator
from matrix.kv_bound import KvBound
from matrix.launch.providers import prepare, recipe
from matrix.paths import port_registry_path
from matrix.runner import run_cell


def _counting(monkeypatch: pytest.MonkeyPatch, calls: Counter[str], module: Any, name: str) -> None:
    real: Callable[..., Any] = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every parse of a provider entry goes through `recipe.check_keys`; every launch table through
    `parse_launch` (looked up in `matrix.cells` and in `matrix.arm_table`)."""
    counted: Counter[str] = Counter()
    _counting(monkeypatch, counted, recipe, "check_keys")
    _counting(monkeypatch, counted, matrix.cells, "parse_launch")
    _counting(monkeypatch, counted, matrix.arm_table, "parse_launch")
    return counted


def test_a_cell_parses_neither_its_launch_table_nor_its_provider(
    calls: Counter[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MATRIX_HOME", str(tmp_path / "home"))
    case = CaseInfo(name="ref", backend="reference", arm="reference", model="reference-model", markers=(),
                    kv_bound=KvBound(bytes=1 << 20), startup_timeout_s=120.0, launch={"token_delay_ms": 1})  # fmt: skip
    runtime = RuntimeInfo(backend="reference", version="0.1.0", tag="v0.1.0", provider={"kind": "host"})
    assert calls == Counter({"parse_launch": 1})  # the case's table: once, where the case was made
    # The counter sees a cell's parse: without a carried spec, preparing the runtime parses its entry.
    prepare(runtime)
    assert calls["check_keys"] == 1
    (cell,) = LocalHooks().with_specs([Cell(case=case, runtime=runtime)])
    assert isinstance(cell.runtime.spec, recipe.HostConfig) and calls["check_keys"] == 2  # parsed once, here
    calls.clear()
    outcome = run_cell(cell, "parsed-once", tmp_path / "cell", PortAllocator(port_registry_path()))
    assert outcome.status == "passed", outcome.message
    assert calls == Counter(), f"the cell parsed again: {dict(calls)}"
