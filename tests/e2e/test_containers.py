"""Cells in containers on a real Docker engine: the reference pair in an image `matrix runtime image` made
from a base image `matrix runtime base-image` made from Debian packages; a runner killed with SIGKILL
leaves no running container; docker's errors are one line and a skipped or config cell; `matrix doctor`
lists stray labelled containers.

The engine is the one `DOCKER_HOST` names (`.ci/run` starts one); without one these tests skip, and fail
under CI=true.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.catalogs import HANGING
from tests.helpers.cli import DATA, Matrix
from tests.helpers.docker import base_image, cell_containers, docker, docker_engine, no_containers_left
from tests.helpers.processes import assert_nothing_left

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
__all__ = ["base_image", "docker_engine", "no_containers_left"]  # fixtures, used by name

CONTAINER_VERSION = "0.1.0+container"

ERRORS = """
[[runtime]]
backend = "reference"
version = "0.1.0+absent"
provider = {{ kind = "container", image = "matrix-test/absent:never" }}
components = {{ matrix-reference = "0.1.0" }}

[[runtime]]
backend = "reference"
version = "0.1.0+skew"
provider = {{ kind = "container", image = "{image}", python = "python3", env = {{ PYTHONPATH = "{path}" }} }}
components = {{ matrix-reference = "0.0.9" }}
"""


@pytest.fixture(scope="module")
def reference_image(base_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Matrix, str]]:
    """A data directory whose catalog has `reference 0.1.0+container`, made by `matrix runtime image`."""
    home = tmp_path_factory.mktemp("containers")
    m = Matrix(home=home, db_path=home / "matrix.db")
    tag = f"matrix-test/reference:{uuid.uuid4().hex[:8]}"
    assert m.subprocess("catalog", "sync").returncode == 0
    made = m.subprocess("runtime", "image", "reference=0.1.0", "--base", base_image, "--tag", tag)
    assert made.returncode == 0, made.stdout + made.stderr
    assert "checked inside: matrix-reference 0.1.0" in made.stdout
    yield m, tag
    docker("rmi", "--force", tag)


def _row(m: Matrix, case: str, version: str) -> dict[str, object]:
    columns = ("uid", "status", "failure_kind", "message", "components", "log_dir")
    rows = m.sql(
        f"SELECT {', '.join('r.' + c for c in columns)} FROM cell_run r JOIN \"case\" c ON c.id = r.case_id "
        "JOIN runtime t ON t.id = r.runtime_id WHERE c.name = ? AND t.version = ? ORDER BY r.id DESC",
        case, version,
    )  # fmt: skip
    return dict(zip(columns, rows[0], strict=True))


def test_the_image_is_labelled_with_its_runtime_and_what_was_checked_inside(
    reference_image: tuple[Matrix, str],
) -> None:
    _, tag = reference_image
    inspected = docker("image", "inspect", "--format", "{{json .Config.Labels}}", tag)
    labels = json.loads(inspected.stdout)
    assert labels["matrix.runtime"] == "reference-0.1.0"
    assert json.loads(labels["matrix.components"]) == {"matrix-reference": "0.1.0"}
    assert labels["matrix.recipe"].startswith("builtin-matrix-")


def test_the_reference_pair_runs_in_containers(reference_image: tuple[Matrix, str], no_containers_left: None) -> None:
    m, tag = reference_image
    result = m.subprocess("run", "--runtime", f"reference={CONTAINER_VERSION}", "--case", "reference_disaggregated",
                          "--no-report")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    row = _row(m, "reference_disaggregated", CONTAINER_VERSION)
    assert row["status"] == "passed", row["message"]
    assert json.loads(str(row["components"])) == {"matrix-reference": "0.1.0"}  # found inside the image
    log = (Path(str(row["log_dir"])) / "prefill.log").read_text()
    assert f"docker run --rm --init --network host --name matrix-{row['uid']}-prefill" in log
    assert f" {tag} python3 -m matrix.reference worker --role prefill" in log
    # The worker's own pid is the container's: 1 is docker's init, so the worker is a small number.
    assert "prefill[" in log and "prefill[1]" not in log
    assert_nothing_left(m, str(row["uid"]))
    assert cell_containers(str(row["uid"])) == []


def test_docker_errors_are_one_line_and_a_skipped_or_config_cell(
    reference_image: tuple[Matrix, str], no_containers_left: None
) -> None:
    m, tag = reference_image
    extra = m.home / "errors.toml"
    extra.write_text(ERRORS.format(image=tag, path="/opt/matrix-reference"))
    assert m.subprocess("catalog", "sync", *map(str, sorted(DATA.glob("*.toml"))), str(extra)).returncode == 0
    result = m.subprocess("run", "--runtime", "reference=0.1.0+absent", "--runtime", "reference=0.1.0+skew",
                          "--case", "reference_disaggregated", "--no-report")  # fmt: skip
    assert "Traceback" not in result.stdout + result.stderr
    absent = _row(m, "reference_disaggregated", "0.1.0+absent")
    assert absent["status"] == "skipped", absent
    message = str(absent["message"])
    assert message.startswith("image matrix-test/absent:never is not on this host and `docker pull")
    assert "\n" not in message
    skew = _row(m, "reference_disaggregated", "0.1.0+skew")
    assert (skew["status"], skew["failure_kind"]) == ("failed", "config"), skew
    assert skew["message"] == "runtime says matrix-reference 0.0.9, image has 0.1.0"
    # No daemon: the cell is skipped with the engine's reason, in one line.
    gone = {**m.env, "DOCKER_HOST": f"unix://{m.home}/no-such-docker.sock"}
    down = subprocess.run(
        [sys.executable, "-m", "matrix", "run", "--runtime", f"reference={CONTAINER_VERSION}", "--case",
         "reference_disaggregated", "--no-report"], env=gone, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert "Traceback" not in down.stdout + down.stderr
    row = _row(m, "reference_disaggregated", CONTAINER_VERSION)
    assert row["status"] == "skipped" and str(row["message"]).startswith("container engine docker is not running")
    assert "\n" not in str(row["message"])
    # `matrix runtime image` without the engine, or without its base: one line, exit 2.
    cases = ((gone, "matrix-base:bookworm", "error: container engine docker is not running"),
             (m.env, "matrix-test/no-base:never", "error: base image matrix-test/no-base:never is not on this host"))
    for env, base, expected in cases:
        made = subprocess.run([sys.executable, "-m", "matrix", "runtime", "image", "reference=0.1.0", "--base", base,
                               "--tag", "matrix-test/never:x"], env=env, capture_output=True, text=True, timeout=120,
                              check=False)  # fmt: skip
        assert made.returncode == 2 and made.stderr.startswith(expected), made.stderr
        assert len(made.stderr.strip().splitlines()) == 1, made.stderr


def test_a_sigkilled_runner_leaves_no_running_container(
    reference_image: tuple[Matrix, str], no_containers_left: None
) -> None:
    m, _ = reference_image
    extra = m.home / "hanging.toml"
    extra.write_text(HANGING)
    assert m.subprocess("catalog", "sync", *map(str, sorted(DATA.glob("*.toml"))), str(extra)).returncode == 0
    runner = m.popen("run", "--case", "hanging_pair", "--runtime", f"reference={CONTAINER_VERSION}", "--no-report")
    try:
        deadline = time.monotonic() + 90
        while len(running := cell_containers(running_only=True)) < 3:  # frontend, prefill, decode: hanging
            assert runner.poll() is None and time.monotonic() < deadline, "the pair's containers never started"
            time.sleep(0.2)
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait()
        time.sleep(2.0)  # the bound: nothing of the cell runs 2 s after the runner's SIGKILL
        still = set(cell_containers(running_only=True)) & set(running)
        assert still == set(), f"{len(still)} of {len(running)} containers still run 2 s after the SIGKILL"
        limit = time.monotonic() + 30
        while set(cell_containers()) & set(running) and time.monotonic() < limit:
            time.sleep(0.2)
        assert set(cell_containers()) & set(running) == set(), "the watchdog did not remove the containers"
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()


def test_doctor_lists_stray_labelled_containers(base_image: str, matrix: Matrix) -> None:
    created = docker("create", "--label", "matrix.cell=stray0000test", base_image, "true")
    assert created.returncode == 0, created.stderr
    try:
        doctor = matrix.subprocess("doctor", "--json")
        assert doctor.returncode == 0, doctor.stderr
        labelled = json.loads(doctor.stdout)["host"]["labelled_containers"]
        assert any("cell=stray0000test" in line for line in labelled), labelled
    finally:
        docker("rm", "--force", created.stdout.strip())


def test_making_the_image_again_updates_its_runtime(reference_image: tuple[Matrix, str], base_image: str) -> None:
    m, tag = reference_image
    again = m.subprocess("runtime", "image", "reference=0.1.0", "--base", base_image, "--tag", tag)
    assert again.returncode == 0, again.stdout + again.stderr
    rows = m.sql("SELECT t.provider, t.source FROM runtime t WHERE t.version = ?", CONTAINER_VERSION)
    assert len(rows) == 1 and rows[0][1] == "cli"
    assert json.loads(str(rows[0][0]))["image"] == tag
    # A catalog runtime's version is never taken over.
    taken = m.subprocess("runtime", "image", "reference=0.1.0", "--base", base_image, "--tag", tag,
                         "--as-version", "0.1.0")  # fmt: skip
    assert taken.returncode == 2 and "is the runtime's own version" in taken.stderr, taken.stderr
