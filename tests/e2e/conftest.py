"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from matrix.hardware.ports import PortAllocator, PortRequest
from matrix.paths import port_registry_path


@pytest.fixture
def ports() -> Iterator[list[int]]:
    """Three ports held through the host's registry (as a runner holds them) and released after."""
    allocator = PortAllocator(port_registry_path())
    owner = uuid.uuid4().hex
    chosen = allocator.allocate(owner, [PortRequest(f"p{i}") for i in range(3)])
    yield list(chosen.values())
    allocator.release(owner)
