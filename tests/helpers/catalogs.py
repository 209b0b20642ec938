"""Catalog builders and the catalog texts several test modules share (cases, arms, discovery templates)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matrix.cells import CaseInfo, RuntimeInfo
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import LaunchContext
from matrix.markers import parse_marker_use
from tests.helpers.cli import DATA, Matrix

# A reference pair that never becomes ready (the kill tests stop its runner while it waits).
HANGING = """
[[case]]
name = "hanging_pair"
backend = "reference"
arm = "reference"
model = "matrix-reference-tiny"
markers = ["e2e", "gpu_0"]
startup_timeout_s = 60
request_timeout_s = 30
launch = { faults = ["hang-at-start"] }
"""


def assert_refused(m: Matrix, args: list[str], *needles: str) -> None:
    """The command exits 2 naming each needle, and the database is unchanged."""
    before = m.dump()
    result = m(*args)
    assert result.exit_code == 2, result.output
    for needle in needles:
        assert needle in result.output, result.output
    assert m.dump() == before


def catalog_with(tmp_path: Path, name: str, text: str) -> list[str]:
    """The seed catalog with one file replaced (or added)."""
    out = tmp_path / "bad"
    out.mkdir(exist_ok=True)
    for path in DATA.glob("*.toml"):
        (out / path.name).write_text(path.read_text())
    (out / name).write_text(text)
    return sorted(str(p) for p in out.glob("*.toml"))


def arm_ctx(case: CaseInfo, tmp_path: Path, gpu_ids: tuple[str, ...] = ()) -> LaunchContext:
    """A launch context for `case` with fixed ports from 20000 (plans only: nothing listens on them)."""
    arm = get_arm(case.arm)
    ports = {req.name: 20000 + i for i, req in enumerate(arm.port_requests(case))}
    runtime = RuntimeInfo(backend=case.backend, version="0.30.0", tag="v0.30.0")
    return LaunchContext("cell1", case, runtime, ports, tmp_path, python="/py", gpu_ids=gpu_ids, model_dir=tmp_path)


def arm_case(arm: str, launch: dict[str, object], **kw: object) -> CaseInfo:
    """A vLLM case `c` on one GPU for `arm` with the given launch table."""
    markers = ("gpu_1",)
    return CaseInfo(
        name="c", backend="vllm", arm=arm, model="Qwen/Qwen3-0.6B", markers=tuple(map(parse_marker_use, markers)),
        launch=launch, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def discovered(m: Matrix, backend: str) -> dict[str, tuple[dict[str, Any], dict[str, str]]]:
    """The runtimes `matrix discover` added for `backend`: version -> (provider, components)."""
    rows = m.sql(
        "SELECT runtime.id, runtime.version, runtime.provider FROM runtime JOIN backend ON backend.id = "
        "runtime.backend_id WHERE backend.name = ? AND runtime.source = 'discovered'",
        backend,
    )
    found = {}
    for runtime_id, version, provider in rows:
        components = m.sql("SELECT name, version FROM runtime_component WHERE runtime_id = ?", runtime_id)
        found[str(version)] = (json.loads(str(provider)), {str(n): str(v) for n, v in components})
    return found


def host_platform() -> str:
    """A platform tag pip accepts here: the index's wheels must fit this host for discover to take them."""
    from packaging.tags import platform_tags

    tags = list(platform_tags())
    return next((t for t in tags if t.startswith("manylinux_")), tags[0])


# The seed files the discovery-template tests sync (the `catalogued` fixture).
TEMPLATE_CATALOG_FILES = ("backends", "markers", "fixes", "gates", "runtimes", "cases")


# A backend versioned like a package on an index, for the discover tests.
DISCOVER_CATALOG = """
[[backend]]
name = "refpkg"
description = "the reference server, versioned like a package on an index"
runtime_template = { package = "ref-pkg", provider = { kind = "builtin", env = { REF_PKG = "{version}" } }, \
components = { ref-pkg = "{version}" } }

[[backend]]
name = "plain"

[[runtime]]
backend = "refpkg"
version = "1.0.0"
provider = { kind = "builtin" }
components = { ref-pkg = "1.0.0" }

[[case]]
name = "refpkg_pair"
backend = "refpkg"
arm = "reference"
model = "tiny"
markers = ["gpu_0"]
startup_timeout_s = 20
request_timeout_s = 10
"""
