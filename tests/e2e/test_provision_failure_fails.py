"""[M21] item 2: a runtime whose recipe fails to build is a failure of that release, not a green skip.

Two venv runtimes through a real `matrix run` (a real environment and installer, uv or pip, offline): one
whose recipe asks for a distribution that does not exist (the build fails), one that asks for a Python this
host does not have (the host cannot build it). The first's cell fails with kind `provision` and the
installer's own error line (pip's `ERROR: ...`, uv's `error: ...` with its cause), and the run exits 1; the
second's is skipped, as before.
"""

from __future__ import annotations

import pytest

from matrix.launch.providers.venv import choose_installer
from tests.helpers.cli import DATA, Matrix

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CATALOG = """
[[backend]]
name = "toyrt"

[[runtime]]
backend = "toyrt"
version = "1.0"
provider = { kind = "venv", steps = [["--no-index", "matrix-no-such-distribution==1.0"]] }

[[runtime]]
backend = "toyrt"
version = "2.0"
provider = { kind = "venv", python = "3.99", steps = [["six==1.16.0"]] }

[[case]]
name = "toy_pair"
backend = "toyrt"
arm = "reference"
model = "tiny"
markers = ["gpu_0", "e2e"]
startup_timeout_s = 20
"""


def test_a_recipe_that_fails_to_build_fails_the_run_and_a_missing_python_skips(matrix: Matrix) -> None:
    (matrix.home / "toy.toml").write_text(CATALOG)
    assert matrix("catalog", "sync", str(matrix.home / "toy.toml"), str(DATA / "markers.toml")).exit_code == 0
    run = matrix.subprocess("run", "--backend", "toyrt", "--no-report", timeout=200)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    error = "ERROR: " if choose_installer().name == "pip" else "error: "  # the installer's own error line
    assert f"toyrt-1.0: not provisioned, its cells will fail (kind provision): {error}" in out, out
    assert "toyrt-2.0: not provisioned, its cells will be skipped: this host cannot build it" in out, out
    rows = dict(
        (version, (status, kind, message))
        for version, status, kind, message in matrix.sql(
            "SELECT runtime.version, status, failure_kind, message FROM cell_run "
            "JOIN runtime ON runtime.id = cell_run.runtime_id"
        )
    )
    status, kind, message = rows["1.0"]
    assert (status, kind) == ("failed", "provision"), rows["1.0"]
    first = str(message).splitlines()[0]
    assert first.startswith("runtime toyrt 1.0 failed to build") and error in first, first
    assert "matrix-no-such-distribution" in first
    status, kind, message = rows["2.0"]
    assert (status, kind) == ("skipped", None), rows["2.0"]
    assert "cannot be built on this host" in str(message) and "3.99" in str(message)
