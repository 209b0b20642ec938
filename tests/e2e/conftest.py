"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from matrix.hardware.ports import PortAllocator, PortRequest


@pytest.fixture
def ports(tmp_path: Path) -> Iterator[list[int]]:
    """Three ports held by the test's own allocator (its registry under tmp_path) and released after."""
    allocator = PortAllocator(tmp_path / "ports.json")
    owner = uuid.uuid4().hex
    chosen = allocator.allocate(owner, [PortRequest(f"p{i}") for i in range(3)])
    yield list(chosen.values())
    allocator.release(owner)
