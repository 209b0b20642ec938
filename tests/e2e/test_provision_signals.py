"""Provisioning under signals, with a real environment build that blocks without any index: a pip step
installs a local project whose in-tree build backend sleeps (no build requirements, `--no-index`).

* SIGTERM or SIGINT to `matrix run` during the build: exit 3, the campaign `interrupted` (its cells pending
  for `--resume`), the build's processes ended and the half-built environment removed.
* SIGKILL: the runner's build watchdog kills the build's processes at once, as a cell's watchdog kills the
  cell's processes; should the watchdog be gone too, the next `matrix run` kills them (tagged with the dead
  runner's pid).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from matrix.launch.providers.buildprocs import OWNER_ENV
from tests.helpers.cli import DATA, Matrix, toml_value
from tests.helpers.processes import stop_gracefully

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

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


def _catalog(home: Path, project: Path) -> Path:
    provider = {"kind": "venv", "steps": [["--no-index", str(project)]]}
    path = home / "slow.toml"
    path.write_text(f"""
[[runtime]]
backend = "reference"
version = "0.1.0"
provider = {{ kind = "builtin" }}
components = {{ matrix-reference = "0.1.0" }}

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
    return path


@pytest.fixture
def slow(matrix: Matrix, tmp_path: Path) -> Iterator[tuple[Matrix, Path]]:
    """A catalog whose only runtime blocks in its build; yields the file the build backend writes its pid to."""
    project = tmp_path / "slowpkg"
    project.mkdir()
    marker = tmp_path / "backend.pid"
    (project / "pyproject.toml").write_text(PYPROJECT)
    (project / "slowbackend.py").write_text(BACKEND.format(marker=str(marker)))
    files = [str(_catalog(matrix.home, project))] + [str(DATA / n) for n in ("backends.toml", "markers.toml")]
    synced = matrix("catalog", "sync", *files)
    assert synced.exit_code == 0, synced.output
    yield matrix, marker
    for proc in _tagged(matrix):  # whatever a failed test left
        proc.kill()


def _tagged(m: Matrix) -> list[psutil.Process]:
    """This test's build processes: tagged, and of its data directory. Builds of other runs on the host
    (a bisect, another CI job) are none of its business: it must neither count nor kill them."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if OWNER_ENV in env and env.get("MATRIX_HOME") == str(m.home):
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def _start(m: Matrix, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "matrix", *args], env=m.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip


def _wait_for_build(proc: subprocess.Popen[str], marker: Path) -> int:
    deadline = time.monotonic() + 120
    while not (marker.exists() and marker.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_gracefully(proc)
            pytest.fail(f"the build never reached its backend: {proc.communicate()[0]}")
        time.sleep(0.05)
    return int(marker.read_text())


def _temps(m: Matrix) -> list[str]:
    envs = m.home / "envs"
    return [p.name for p in envs.iterdir() if p.is_dir()] if envs.exists() else []


def _temps_gone(m: Matrix) -> bool:
    """The interrupted build's tree is deleted in the background (the runner does not wait for it): soon."""
    deadline = time.monotonic() + 30
    while _temps(m) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _temps(m) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_a_build_interrupts_the_campaign_and_removes_the_build(
    slow: tuple[Matrix, Path], sig: signal.Signals
) -> None:
    m, marker = slow
    runner = _start(m, "run", "--runtime", "reference=9.0", "--no-report")
    backend = _wait_for_build(runner, marker)
    assert any(name.startswith(".tmp-") for name in _temps(m))
    runner.send_signal(sig)
    try:
        output = runner.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        stop_gracefully(runner)
        pytest.fail("matrix run did not stop")
    assert runner.returncode == 3, output
    assert f"campaign 1 interrupted: {sig.name} while provisioning" in output
    assert m.sql("SELECT status FROM campaign") == [("interrupted",)]
    assert m.sql("SELECT status FROM cell_run") == [("pending",)]  # `--resume 1` runs it
    assert not psutil.pid_exists(backend) or psutil.Process(backend).status() == psutil.STATUS_ZOMBIE
    assert _tagged(m) == []
    assert _temps_gone(m)  # the half-built environment is gone


def test_runtime_provision_is_interrupted_the_same_way(slow: tuple[Matrix, Path]) -> None:
    m, marker = slow
    provisioner = _start(m, "runtime", "provision", "--runtime", "reference=9.0")
    _wait_for_build(provisioner, marker)
    provisioner.send_signal(signal.SIGTERM)
    output = provisioner.communicate(timeout=60)[0]
    assert provisioner.returncode == 3, output
    assert "interrupted by SIGTERM: the build in progress was removed" in output
    assert _tagged(m) == [] and _temps_gone(m)


def _live(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:
            continue
    return alive


def test_a_killed_runners_build_processes_are_killed_at_once_by_its_watchdog(slow: tuple[Matrix, Path]) -> None:
    """[M29] item 16: not left for the next provision on the host, however long that takes to come."""
    m, marker = slow
    runner = _start(m, "run", "--runtime", "reference=9.0", "--no-report")
    _wait_for_build(runner, marker)
    build = _tagged(m)  # the build command (uv or pip) and its build backend
    assert build and all(p.environ()[OWNER_ENV].endswith(f":{runner.pid}") for p in build)
    runner.kill()  # kill -9: no chance to clean up
    runner.communicate(timeout=30)
    # Within moments: the watchdog needs only the pipe's end-of-file and one scan of the processes. (Another
    # `matrix run` on this host sweeps a dead runner's builds too, but only when it starts one.)
    deadline = time.monotonic() + 3
    while _live(build) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _live(build), f"{[p.cmdline()[:3] for p in _live(build)]} outlived their runner by 3 s"


def _build_watchdog(runner_pid: int) -> psutil.Process:
    """The runner's build watchdog: the script with the runner's owner tag in its argv."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(a.endswith("watchdog.py") for a in cmdline) and OWNER_ENV in cmdline and any(
            a.endswith(f":{runner_pid}") for a in cmdline
        ):
            return proc
    raise AssertionError(f"no build watchdog of runner {runner_pid}")


def test_a_killed_runners_build_processes_are_swept_by_the_next_run(slow: tuple[Matrix, Path]) -> None:
    """The fallback: with the watchdog killed first (kill -9 of both), the next run on the host sweeps."""
    m, marker = slow
    runner = _start(m, "run", "--runtime", "reference=9.0", "--no-report")
    backend = _wait_for_build(runner, marker)
    _build_watchdog(runner.pid).kill()
    runner.kill()  # kill -9: no chance to clean up
    runner.communicate(timeout=30)
    orphan = psutil.Process(backend)
    assert orphan.is_running()
    assert orphan.environ()[OWNER_ENV].endswith(f":{runner.pid}")  # tagged with the dead runner

    # The next run (of something else entirely) finds and kills them before it starts. (Any matrix run on this
    # host sweeps a dead runner's build processes, so the message may come from another one running now.)
    result = m.subprocess("run", "--runtime", "reference=0.1.0", "--no-report", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not orphan.is_running() or orphan.status() == psutil.STATUS_ZOMBIE, f"{orphan.cmdline()} survived"
    assert _tagged(m) == []
    assert m.sql("SELECT status FROM campaign WHERE id = 1") == [("interrupted",)]
