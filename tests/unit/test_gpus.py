"""GPU inventory, --gpus parsing and CUDA_VISIBLE_DEVICES semantics, without needing a GPU."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest

from matrix.errors import ConfigError
from matrix.hardware import gpus as gpus_mod
from matrix.hardware.gpus import (
    CHILD_ENV,
    GIB,
    INVENTORY_COLUMNS,
    Gpu,
    format_inventory,
    gpu_processes,
    inventory,
    memory_used,
    parse_gpu_list,
    restrict_gpus,
    visible_devices_mapping,
)

UUIDS = (
    "GPU-8c3e1f2a-0000-0000-0000-000000000000",
    "GPU-8c3f9b00-0000-0000-0000-000000000001",
    "GPU-1234abcd-0000-0000-0000-000000000002",
    "GPU-ffee0011-0000-0000-0000-000000000003",
)
FAKE = tuple(Gpu(i, uuid, "Fake H100", 80 * GIB, i * GIB) for i, uuid in enumerate(UUIDS))


# --- inventory on this host and through a fake NVML --------------------------------------------------


def test_inventory_without_gpu_is_empty_and_does_not_raise() -> None:
    # Holds on a CPU-only host (no driver) and on a host without the library alike.
    if gpus_mod.inventory():
        pytest.skip("this host has GPUs")
    assert inventory() == ()
    assert memory_used(0) is None
    assert gpu_processes(0) == {}


def test_inventory_restrict_on_host_without_gpu_names_entry() -> None:
    if inventory():
        pytest.skip("this host has GPUs")
    with pytest.raises(ConfigError, match=r"'0'.*no GPUs"):
        inventory(restrict=["0"])


def test_inventory_without_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    assert inventory() == ()
    assert memory_used(0) is None
    assert gpu_processes(0) == {}


class _NVMLError(Exception):
    pass


@dataclass
class _Memory:
    total: int
    used: int


@dataclass
class _Process:
    pid: int
    usedGpuMemory: int | None  # NVML spells it so


def _fake_nvml(
    *, init_fails: bool = False, lost: frozenset[int] = frozenset(), count: int = 3
) -> tuple[types.ModuleType, list[str]]:
    calls: list[str] = []
    nvml = types.ModuleType("pynvml")

    def init() -> None:
        calls.append("init")
        if init_fails:
            raise _NVMLError("Driver Not Loaded")

    def handle(index: int) -> int:
        if index in lost or index >= count:
            raise _NVMLError("GPU is lost")
        return index

    nvml.NVMLError = _NVMLError  # type: ignore[attr-defined]
    nvml.nvmlInit = init  # type: ignore[attr-defined]
    nvml.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetCount = lambda: count  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = handle  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetMemoryInfo = lambda h: _Memory(80 * GIB, (h + 1) * GIB)  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetName = lambda h: b"Fake H100"  # type: ignore[attr-defined]  # old bindings: bytes
    nvml.nvmlDeviceGetUUID = lambda h: UUIDS[h]  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: [  # type: ignore[attr-defined]
        _Process(100, GIB),
        _Process(100, GIB),
        _Process(200, None),
    ]
    return nvml, calls


def test_inventory_reads_fake_nvml_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml, calls = _fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    found = inventory()
    assert [g.index for g in found] == [0, 1, 2]
    assert found[1] == Gpu(1, UUIDS[1], "Fake H100", 80 * GIB, 2 * GIB)
    assert calls == ["init", "shutdown"]
    assert memory_used(2) == 3 * GIB
    assert memory_used(7) is None
    assert gpu_processes(0) == {100: 2 * GIB, 200: 0}
    assert calls.count("init") == calls.count("shutdown") == 4


def test_inventory_skips_lost_gpu_and_restricts(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml, _ = _fake_nvml(lost=frozenset({1}))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert [g.index for g in inventory()] == [0, 2]
    assert [g.index for g in inventory(restrict=["2"])] == [2]
    with pytest.raises(ConfigError, match="'1'"):
        inventory(restrict=["1"])


def test_inventory_init_failure_is_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml, calls = _fake_nvml(init_fails=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert inventory() == ()
    assert memory_used(0) is None
    assert "shutdown" not in calls


def test_inventory_zero_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml, _ = _fake_nvml(count=0)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert inventory() == ()


# --- --gpus -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "entries"),
    [("0,2", ["0", "2"]), ("GPU-abc,1", ["GPU-abc", "1"]), (" 3 ", ["3"]), ("0, 1", ["0", "1"])],
)
def test_parse_gpu_list(text: str, entries: list[str]) -> None:
    assert parse_gpu_list(text) == entries


@pytest.mark.parametrize("text", ["", "  ", "0,,2", "0,"])
def test_parse_gpu_list_rejects_empty(text: str) -> None:
    with pytest.raises(ConfigError, match="--gpus"):
        parse_gpu_list(text)


def test_restrict_by_index_uuid_and_prefix_keeps_nvml_order() -> None:
    assert restrict_gpus(FAKE, ["2", "0"]) == (FAKE[0], FAKE[2])
    assert restrict_gpus(FAKE, [UUIDS[3]]) == (FAKE[3],)
    assert restrict_gpus(FAKE, ["GPU-1234"]) == (FAKE[2],)
    assert restrict_gpus(FAKE, ["gpu-FFEE"]) == (FAKE[3],)  # case does not matter
    assert restrict_gpus(FAKE, ["1234ab"]) == (FAKE[2],)  # "GPU-" may be left out
    assert restrict_gpus(FAKE, ["1", "GPU-8c3f"]) == (FAKE[1],)  # same GPU twice counts once


def test_restrict_unknown_entry_names_it_and_lists_gpus() -> None:
    with pytest.raises(ConfigError) as err:
        restrict_gpus(FAKE, ["0", "7"])
    message = str(err.value)
    assert "'7'" in message
    assert all(uuid in message for uuid in UUIDS)
    with pytest.raises(ConfigError, match="'GPU-0000'"):
        restrict_gpus(FAKE, ["GPU-0000"])


def test_restrict_ambiguous_prefix() -> None:
    with pytest.raises(ConfigError, match=r"'GPU-8c3'.*matches 2 GPUs"):
        restrict_gpus(FAKE, ["GPU-8c3"])


# --- CUDA_VISIBLE_DEVICES ---------------------------------------------------------------------------


def test_child_env_orders_cuda_like_nvml() -> None:
    assert CHILD_ENV == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [0, 1, 2, 3]),
        ("", []),
        ("-1", []),
        ("2", [2]),
        ("2,0", [2, 0]),
        ("0, 3", [0, 3]),
        (UUIDS[3] + ",1", [3, 1]),
        ("GPU-1234,GPU-ffee", [2, 3]),
        # The first invalid entry hides itself and everything after it.
        ("0,2,-1,1", [0, 2]),
        ("1,9,0", [1]),
        ("3,GPU-dead,0", [3]),
        ("1,GPU-8c3,0", [1]),  # ambiguous prefix
        ("0,0,1", [0]),  # a device named twice
        ("1,MIG-GPU-8c3e1f2a/1/0", [1]),  # MIG identifiers are not modelled
        ("1,8c3e1f2a", [1]),  # a UUID without "GPU-" is not one CUDA accepts
        ("9", []),
    ],
)
def test_visible_devices_mapping(value: str | None, expected: list[int]) -> None:
    assert [g.index for g in visible_devices_mapping(value, FAKE)] == expected


def test_visible_devices_mapping_without_gpus() -> None:
    assert visible_devices_mapping(None, ()) == []
    assert visible_devices_mapping("0", ()) == []


def test_format_inventory() -> None:
    rows = format_inventory([Gpu(0, UUIDS[0], "H100", 80 * GIB, 3 * GIB // 2), Gpu(1, UUIDS[1], "H100", GIB, 2 * GIB)])
    assert len(INVENTORY_COLUMNS) == len(rows[0])
    assert rows[0] == (0, UUIDS[0], "H100", 80.0, 1.5, 78.5)
    assert rows[1][-1] == 0.0  # used beyond total (reserved memory) never shows negative free
