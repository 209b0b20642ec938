"""[M21] item 17: an interpreter that cannot run (a pyenv shim exiting 127) is never a runtime's Python.

Real interpreters and a real shim: candidates on PATH are asked for their version before one is chosen,
and a path that does not answer is called "this interpreter does not run".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from matrix.launch.providers import Environment, Unavailable, prepare
from matrix.launch.providers.interpreters import find_python
from matrix.launch.providers.venv import ProvisionError, provision_target, python_version_of
from matrix.plan import RuntimeInfo

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MINOR = f"{sys.version_info[0]}.{sys.version_info[1]}"
NAME = f"python{MINOR}"
# The interpreter running the tests, through any venv link: a real one of this version.
REAL = os.path.realpath(sys.executable)


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    """(a directory whose python3.X is a shim for a version that is not installed, one with a real one)."""
    shims, good = tmp_path / "shims", tmp_path / "good"
    shims.mkdir()
    good.mkdir()
    shim = shims / NAME
    shim.write_text(f'#!/bin/sh\necho "pyenv: {NAME}: command not found" >&2\nexit 127\n')
    shim.chmod(0o755)
    (good / NAME).symlink_to(REAL)
    return shims, good


def _host(python: str, path: str | None = None) -> RuntimeInfo:
    env: dict[str, Any] = {"PATH": path} if path else {}
    provider = {"kind": "host", "python": python, "env": env}
    return RuntimeInfo(backend="toy", version="1.0", tag="v1.0", provider=provider, components={})


def test_find_python_passes_over_a_shim_that_exits_127(dirs: tuple[Path, Path]) -> None:
    shims, good = dirs
    found = find_python(NAME, f"{shims}{os.pathsep}{good}", version=MINOR)
    assert found.path == str(good / NAME)
    assert found.why_not() == f"{shims / NAME} does not run (exit 127: pyenv: {NAME}: command not found)"
    assert find_python(NAME, str(shims)).path is None


def test_a_given_interpreter_that_does_not_run_is_called_so(dirs: tuple[Path, Path]) -> None:
    shim = str(dirs[0] / NAME)
    with pytest.raises(ProvisionError, match=r"this interpreter does not run \(exit 127"):
        python_version_of(shim)
    skipped = prepare(_host(shim))
    assert isinstance(skipped, Unavailable) and "this interpreter does not run (exit 127" in skipped.reason


def test_a_host_runtime_named_by_command_takes_the_first_that_runs(dirs: tuple[Path, Path]) -> None:
    shims, good = dirs
    ready = prepare(_host(NAME, f"{shims}{os.pathsep}{good}{os.pathsep}{os.environ['PATH']}"))
    assert isinstance(ready, Environment), ready
    assert ready.python == str(good / NAME)


def test_a_venv_recipe_never_builds_on_a_shim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # python3.99 is a shim (as pyenv's are for a version not selected): it was taken, and the build failed
    # with "`.../python3.99 -m venv ...` failed with exit code 127". Now it is passed over, and named.
    shims = tmp_path / "shims"
    shims.mkdir()
    shim = shims / "python3.99"
    shim.write_text('#!/bin/sh\necho "pyenv: python3.99: command not found" >&2\nexit 127\n')
    shim.chmod(0o755)
    monkeypatch.setenv("MATRIX_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATH", f"{shims}{os.pathsep}{os.environ['PATH']}")
    runtime = RuntimeInfo(backend="toy", version="5.0", tag="v5.0", components={},
                          provider={"kind": "venv", "python": "3.99", "steps": [["six==1.16.0"]]})  # fmt: skip
    with pytest.raises(ProvisionError) as failure:
        provision_target(runtime, echo=lambda _: None)
    assert "no Python 3.99 interpreter on PATH that runs" in str(failure.value)
    assert f"{shim} does not run (exit 127: pyenv: python3.99: command not found)" in str(failure.value)
