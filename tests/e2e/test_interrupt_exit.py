"""[M29] item 2: an interrupted `matrix run` gives the prompt back at once.

* Ctrl-C while pairs run: the pairs are torn down and the run exits 3 without writing the report (every
  page of the database took seconds after the pairs were already down); it says `matrix report` refreshes
  it.
* Ctrl-C while an environment is being built: the build's processes are ended and the run exits 3 without
  waiting for the half-built tree to be deleted (seconds for the tens of thousands of files of a real
  environment); the tree is moved aside at once and deleted in the background.

The bounds below are hang guards, not targets: the targets (about a second) belong to benchmarks.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.cli import DATA, Matrix, toml_value
from tests.helpers.processes import stop_gracefully

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SLOW_PAIR = """
[[case]]
name = "slow_pair"
backend = "reference"
arm = "reference"
model = "matrix-reference-tiny"
markers = ["e2e", "gpu_0"]
startup_timeout_s = 120
launch = { faults = ["slow-start"], slow_start_s = 60 }
"""
# A build backend that blocks: the environment build is in progress for as long as the test wants.
BACKEND = """
import os, time

def get_requires_for_build_wheel(config_settings=None):
    with open({marker!r}, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
    return []
"""
PYPROJECT = """
[project]
name = "slowpkg"
version = "1.0"

[build-system]
requires = []
build-backend = "slowbackend"
backend-path = ["."]
"""
HANG_GUARD_S = 5.0


def _sync(m: Matrix, extra: str) -> None:
    path = m.home / "extra.toml"
    path.write_text(extra)
    files = [str(p) for p in sorted(DATA.glob("*.toml"))] + [str(path)]
    synced = m.subprocess("catalog", "sync", *files)
    assert synced.returncode == 0, synced.stdout + synced.stderr


def _start(m: Matrix, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "matrix", *args], env=m.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip


def _interrupt(proc: subprocess.Popen[str]) -> tuple[float, str]:
    """SIGINT, then the seconds until the runner exited and what it printed."""
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        stop_gracefully(proc)
        pytest.fail("matrix run did not stop after SIGINT")
    took = time.monotonic() - sent
    assert proc.stdout is not None
    return took, proc.stdout.read()


def _cell_processes(home: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get("MATRIX_CELL_ID") and env.get("MATRIX_HOME") == str(home) and proc.status() != "zombie":
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_ctrl_c_while_pairs_run_exits_without_writing_the_report(matrix: Matrix) -> None:
    _sync(matrix, SLOW_PAIR)
    runner = _start(matrix, "run", "--case", "slow_pair", "-j", "1")  # the report is on by default
    deadline = time.monotonic() + 60
    while len(_cell_processes(matrix.home)) < 3:
        assert runner.poll() is None and time.monotonic() < deadline, "the slow pair never started"
        time.sleep(0.05)
    took, output = _interrupt(runner)
    print(f"SIGINT to exit while a pair runs: {took:.2f}s")
    assert runner.returncode == 3, output
    assert "report not refreshed (run interrupted): `matrix report` refreshes it" in output, output
    assert "report: " not in output and not (matrix.home / "report").exists()
    assert matrix.sql("SELECT status FROM campaign") == [("interrupted",)]
    assert matrix.sql("SELECT status FROM cell_run") == [("interrupted",)]
    assert _cell_processes(matrix.home) == []
    assert took < HANG_GUARD_S, output
    # The next command writes the report the interrupted run left alone.
    assert matrix.subprocess("report").returncode == 0
    assert (matrix.home / "report" / "index.html").is_file()


def test_ctrl_c_while_building_exits_before_the_half_built_tree_is_deleted(matrix: Matrix, tmp_path: Path) -> None:
    project = tmp_path / "slowpkg"
    project.mkdir()
    marker = tmp_path / "backend.pid"
    (project / "pyproject.toml").write_text(PYPROJECT)
    (project / "slowbackend.py").write_text(BACKEND.format(marker=str(marker)))
    provider = {"kind": "venv", "steps": [["--no-index", str(project)]]}
    _sync(matrix, f"""
[[runtime]]
backend = "reference"
version = "9.0"
provider = {toml_value(provider)}
components = {{}}

[[case]]
name = "slow_build"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0"]
startup_timeout_s = 20
""")
    # The detached `rm` that deletes the trash is made to take 10 s (a real tree takes seconds; the 20,000
    # entries below take a tenth of one, less than the runner's own exit), so "the runner exited before the
    # tree was deleted" is decided by what the runner waits for, not by which process the host ran first.
    slow = tmp_path / "slow-rm"
    slow.mkdir()
    (slow / "rm").write_text(f'#!/bin/sh\nsleep 10\nexec {shutil.which("rm")} "$@"\n')
    (slow / "rm").chmod(0o755)
    runner = subprocess.Popen(
        [sys.executable, "-m", "matrix", "run", "--runtime", "reference=9.0"],
        env={**matrix.env, "PATH": f"{slow}{os.pathsep}{matrix.env.get('PATH', os.environ['PATH'])}"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (marker.exists() and marker.read_text().strip()):
        assert runner.poll() is None and time.monotonic() < deadline, "the build never reached its backend"
        time.sleep(0.05)
    backend = int(marker.read_text())
    envs = matrix.home / "envs"
    (building,) = [p for p in envs.iterdir() if p.name.startswith(".tmp-")]
    try:
        _fill(building / "installed-earlier", 20_000)
    except BaseException:
        stop_gracefully(runner)
        raise  # what earlier steps installed: a real environment has tens of thousands
    took, output = _interrupt(runner)
    left = [p.name for p in envs.iterdir() if p.is_dir()]
    print(f"SIGINT to exit while building: {took:.2f}s")
    assert runner.returncode == 3, output
    assert "campaign 1 interrupted: SIGINT while provisioning" in output, output
    assert not (matrix.home / "report").exists(), output
    assert not psutil.pid_exists(backend) or psutil.Process(backend).status() == psutil.STATUS_ZOMBIE
    # The runner did not wait for the half-built tree to be deleted (seconds for a real one): at its exit the
    # tree is under a trash name, not the build's, and it is deleted after.
    assert len(left) == 1 and left[0].startswith(".trash-"), left
    deadline = time.monotonic() + 60
    while any(p.is_dir() for p in envs.iterdir()):
        assert time.monotonic() < deadline, "the interrupted build's tree was never deleted"
        time.sleep(0.1)
    assert took < HANG_GUARD_S, output


def _fill(directory: Path, entries: int) -> None:
    """`entries` directory entries under `directory` (hard links of one file: quick to make, as slow to delete
    one by one as the files of an installed environment)."""
    directory.mkdir()
    (directory / "module.py").write_text("x = 1\n")
    for d in range(entries // 200):
        package = directory / f"package{d}"
        package.mkdir()
        for f in range(200):
            os.link(directory / "module.py", package / f"module{f}.py")
