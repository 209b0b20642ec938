"""A real container engine for the tests that run cells in containers.

`docker_engine` answers the engine's name when `docker info` answers (the engine `DOCKER_HOST` names, as
`.ci/run` exports it); otherwise the test is skipped with the reason, or fails under `CI=true`, where the
engine is part of the test set-up. `base_image` is the image `matrix runtime base-image` makes; CI makes it
once before the tests, a developer's first run makes it here (about two minutes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from matrix.launch.providers.container import CELL_LABEL, engine_problem

BASE_IMAGE = "matrix-base:bookworm"


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI needs a container engine: {reason} (.ci/run starts one)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def docker_engine() -> str:
    problem = engine_problem("docker", use_cache=False)
    if problem is not None:
        _unavailable(problem)
    return "docker"


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="session")
def base_image(docker_engine: str) -> str:
    if docker("image", "inspect", BASE_IMAGE).returncode != 0:
        made = subprocess.run(
            [sys.executable, "-m", "matrix", "runtime", "base-image", "--tag", BASE_IMAGE],
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        if made.returncode != 0:
            _unavailable(f"cannot make {BASE_IMAGE}: {(made.stderr or made.stdout).strip()[-500:]}")
    return BASE_IMAGE


def cell_containers(cell_id: str | None = None, *, running_only: bool = False) -> list[str]:
    """Ids of containers carrying the cell label (of one cell, or of any)."""
    label = f"{CELL_LABEL}={cell_id}" if cell_id else CELL_LABEL
    listed = docker("ps", *([] if running_only else ["--all"]), "--quiet", "--filter", f"label={label}")
    assert listed.returncode == 0, listed.stderr
    return listed.stdout.split()


@pytest.fixture
def no_containers_left(docker_engine: str) -> Iterator[None]:
    """The test leaves no labelled container behind (those present before are not its own)."""
    before = set(cell_containers())
    yield
    left = set(cell_containers()) - before
    if left:
        docker("rm", "--force", *left)
    assert not left, f"containers left behind: {sorted(left)}"
