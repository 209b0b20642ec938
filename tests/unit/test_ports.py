"""Port allocation: distinct, bounded, shared between processes by the registry, stale entries reclaimed."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

from matrix.errors import MatrixError
from matrix.hardware.ports import PortAllocator, PortRequest, port_is_free
from matrix.paths import port_registry_path
from tests.helpers.ports import free_block


def test_ports_in_one_allocation_are_distinct_and_bindable(registry: Path) -> None:
    ports = PortAllocator(registry).allocate("cell", [PortRequest(f"p{i}") for i in range(50)])
    assert len(set(ports.values())) == 50
    assert all(20000 <= port <= 65535 and port_is_free(port) for port in ports.values())


def test_upper_bound_is_respected(registry: Path) -> None:
    ports = PortAllocator(registry).allocate("cell", [PortRequest(f"p{i}", max_port=32767) for i in range(50)])
    assert all(20000 <= port <= 32767 for port in ports.values())


def test_max_port_below_min_port_searches_below_max_port(registry: Path) -> None:
    ports = PortAllocator(registry, min_port=40000).allocate("cell", [PortRequest("system", max_port=32767)])
    assert 22767 <= ports["system"] <= 32767


def test_duplicate_names_are_rejected(registry: Path) -> None:
    with pytest.raises(ValueError, match="unique"):
        PortAllocator(registry).allocate("cell", [PortRequest("a"), PortRequest("a")])


def test_two_allocators_on_one_registry_never_share_a_port(registry: Path) -> None:
    first, second = PortAllocator(registry), PortAllocator(registry)
    taken: list[int] = []
    for i in range(20):
        for allocator in (first, second):
            taken += allocator.allocate(f"cell{i}", [PortRequest("a", 32767), PortRequest("b")]).values()
    assert len(taken) == len(set(taken)) == 80


def test_expired_entries_are_reclaimed(registry: Path) -> None:
    low = free_block(2)
    short = PortAllocator(registry, ttl_s=0.05, min_port=low)
    short.allocate("old", [PortRequest("a", low + 1), PortRequest("b", low + 1)])
    other = PortAllocator(registry, min_port=low)
    with pytest.raises(MatrixError):
        other.allocate("new", [PortRequest("a", low + 1)])
    time.sleep(0.1)
    assert other.allocate("new", [PortRequest("a", low + 1)])["a"] in (low, low + 1)


def test_release_frees_the_ports(registry: Path) -> None:
    low = free_block(1)
    first, second = PortAllocator(registry, min_port=low), PortAllocator(registry, min_port=low)
    assert first.allocate("cell-a", [PortRequest("a", low)]) == {"a": low}
    with pytest.raises(MatrixError):
        second.allocate("cell-b", [PortRequest("a", low)])
    first.release("cell-a")
    assert second.allocate("cell-b", [PortRequest("a", low)]) == {"a": low}
    # Releasing again, or an unknown owner, is harmless.
    first.release("cell-a")
    first.release("nobody")


def test_allocator_remembers_its_ports_without_the_registry(registry: Path) -> None:
    low = free_block(1)
    allocator = PortAllocator(registry, min_port=low)
    allocator.allocate("cell-a", [PortRequest("a", low)])
    registry.unlink()  # even without the file, the allocator remembers what it handed out
    with pytest.raises(MatrixError):
        allocator.allocate("cell-b", [PortRequest("a", low)])


def test_port_bound_by_someone_else_is_skipped(registry: Path) -> None:
    low = free_block(2)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", low))
        squatter.listen()
        allocator = PortAllocator(registry, min_port=low)
        assert allocator.allocate("cell", [PortRequest("a", low + 1)]) == {"a": low + 1}
        with pytest.raises(MatrixError, match=rf"in {low}\.\.{low + 1}"):
            allocator.allocate("cell2", [PortRequest("a", low + 1)])


def test_unreadable_registry_is_started_over(registry: Path) -> None:
    registry.write_text("{not json")
    ports = PortAllocator(registry).allocate("cell", [PortRequest("a")])
    assert json.loads(registry.read_text())[str(ports["a"])]["owner"] == "cell"


def test_invalid_max_port_is_rejected() -> None:
    with pytest.raises(ValueError):
        PortRequest("a", max_port=70000)


def test_runners_with_different_data_directories_share_the_hosts_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two runners, each with its own data directory: the first reserves the range's only port before its
    # server binds it; the second must not be handed it too (each used to check only its own registry).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this test's own "host-wide" directory
    monkeypatch.delenv("MATRIX_PORT_REGISTRY", raising=False)
    port = free_block(1)
    monkeypatch.setenv("MATRIX_HOME", str(tmp_path / "first"))
    first = PortAllocator(port_registry_path(), min_port=port)
    assert first.allocate("cell-a", [PortRequest("http", max_port=port)]) == {"http": port}
    monkeypatch.setenv("MATRIX_HOME", str(tmp_path / "second"))
    assert port_registry_path() == tmp_path / f"matrix-ports-{os.getuid()}" / "ports.json"
    with pytest.raises(MatrixError, match="no free port"):
        PortAllocator(port_registry_path(), min_port=port).allocate("cell-b", [PortRequest("http", max_port=port)])
    first.release("cell-a")
    assert PortAllocator(port_registry_path(), min_port=port).allocate("cell-b", [PortRequest("http", max_port=port)])


def test_a_registry_directory_of_someone_else_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("MATRIX_PORT_REGISTRY", raising=False)
    monkeypatch.setenv("MATRIX_HOME", str(tmp_path / "home"))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / f"matrix-ports-{os.getuid()}").symlink_to(tmp_path / "elsewhere")  # planted by another user
    assert port_registry_path() == tmp_path / "home" / "ports.json"
    monkeypatch.setenv("MATRIX_PORT_REGISTRY", str(tmp_path / "chosen.json"))
    assert port_registry_path() == tmp_path / "chosen.json"
