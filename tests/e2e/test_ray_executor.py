"""`matrix run --executor ray` on a real local Ray cluster with two declared (fake) GPUs.

The cluster is a real `ray start --head --num-gpus 2` in its own session; cells are real reference pairs.
The GPU cases run their pair on the CPU (`device = "cpu"`) but carry `gpu_1`, so each is a Ray task
asking for one GPU and both workers must be pinned, through Ray's assignment, to that one device.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from matrix.launch.supervisor import find_cell_processes
from tests.helpers.cli import DATA, Matrix
from tests.helpers.ports import free_port
from tests.helpers.processes import port_still_held
from tests.helpers.reference_cells import SHORT_GRACE

pytest.importorskip("ray", reason="the Ray executor needs the ray extra (pip install -e '.[dev]' has it)")

GPU_CASES = ("ray_gpu_a", "ray_gpu_b", "ray_gpu_c", "ray_gpu_d")
# fault -> what both executors must record (status, failure kind, failed check)
FAULT_CASES = {
    "same-worker-id": ("failed", "validation", "worker_ids_distinct"),
    "crash-at-start": ("failed", "startup", None),
    "escaped-child": ("failed", "teardown", "no_escaped_processes"),
}


def _case(name: str, markers: str, launch: str, startup: float = 30) -> str:
    return (
        f'[[case]]\nname = "{name}"\nbackend = "reference"\narm = "reference"\nmodel = "tiny"\n'
        f"markers = [{markers}]\nstartup_timeout_s = {startup}\nrequest_timeout_s = 20\nlaunch = {launch}\n"
    )


def catalog(directory: Path) -> list[str]:
    cases = [_case(name, '"gpu_1", "ray_suite"', '{ device = "cpu", token_delay_ms = 20 }') for name in GPU_CASES]
    cases.append(_case("ray_cpu", '"gpu_0", "ray_suite"', '{ device = "cpu" }'))
    for fault in FAULT_CASES:
        name = "ray_fault_" + fault.replace("-", "_")
        cases.append(_case(name, '"gpu_0", "ray_suite"', f'{{ faults = ["{fault}"]{SHORT_GRACE.get(fault, "")} }}'))
    slow = '{ device = "cpu", faults = ["slow-start"], slow_start_s = %d }'
    cases.append(_case("ray_slow", '"gpu_1", "slow"', slow % 120, startup=180))
    cases.append(_case("ray_slow_once", '"gpu_1", "slow"', slow % 3, startup=60))
    markers = [f'[[marker]]\nname = "{name}"\ndescription = "test group"\n' for name in ("ray_suite",)]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ray.toml").write_text("\n".join(markers + cases))
    files = [directory / "ray.toml"] + [DATA / f"{n}.toml" for n in ("backends", "markers", "fixes", "runtimes")]
    return [str(f) for f in files]


def _session_processes(sid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


@pytest.fixture(scope="module", autouse=True)
def _no_ray_token_auth() -> Iterator[None]:
    """Ray 2.5x turns token auth on for a new local cluster and writes ~/.ray/auth_token, which later heads
    then require: keep these tests off the user's home and independent of their order."""
    previous = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    yield
    if previous is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = previous


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory, _no_ray_token_auth: None) -> Iterator[str]:
    """A local Ray head with 2 fake GPUs and 4 CPUs, in its own session so teardown can prove it is gone."""
    ray_cli = Path(sys.executable).with_name("ray")
    port = free_port()
    log = tmp_path_factory.mktemp("ray-head") / "head.log"
    argv = [
        str(ray_cli), "start", "--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1",
        "--num-gpus", "2", "--num-cpus", "4", "--include-dashboard", "false", "--disable-usage-stats",
        "--object-store-memory", str(100 * 2**20),
    ]  # fmt: skip
    with log.open("w") as out:
        head = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"Ray head did not start:\n{log.read_text()}"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` drains and stops what it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        leftovers = _session_processes(head.pid)
        for proc in leftovers:
            proc.kill()
        psutil.wait_procs(leftovers, timeout=10)
        assert _session_processes(head.pid) == [], "the Ray head left processes behind"


@pytest.fixture(scope="module")
def ray_home(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    home = tmp_path_factory.mktemp("ray-home")
    m = Matrix(home=home, db_path=home / "matrix.db")
    result = m.subprocess("catalog", "sync", *catalog(home / "catalog"))
    assert result.returncode == 0, result.stderr
    return m


def _rows(m: Matrix, campaign: int) -> dict[str, dict[str, object]]:
    columns = ("name", "uid", "attempt", "status", "failure_kind", "checks", "message", "gpu", "log_dir", "ports")
    rows = m.sql(
        f'SELECT {", ".join(columns)} FROM cell_run JOIN "case" ON case_id = "case".id '
        "WHERE campaign_id = ? ORDER BY cell_run.id",
        campaign,
    )
    out = {}
    for values in rows:
        row = dict(zip(columns, values, strict=True))
        for key in ("checks", "gpu", "ports"):
            row[key] = json.loads(str(row[key]))
        out[f"{row['name']}#{row['attempt']}"] = row
    return out


def _latest_campaign(m: Matrix) -> int:
    return int(str(m.sql("SELECT max(id) FROM campaign")[0][0]))


def _summary(row: dict[str, object]) -> tuple[object, object, frozenset[str]]:
    checks = frozenset(str(c["name"]) for c in row["checks"])  # type: ignore[attr-defined]
    return row["status"], row["failure_kind"], checks


def _assert_nothing_left(row: dict[str, object]) -> None:
    uid = str(row["uid"])
    assert find_cell_processes(uid) == [], f"processes of {uid} survived"
    for port in row["ports"].values():  # type: ignore[attr-defined]
        assert not port_still_held(int(port), uid), f"port {port} of {uid} still in use"


def _visible_devices(log_dir: Path, role: str) -> str:
    for line in (log_dir / f"{role}.log").read_text().splitlines():
        if "starting role=" in line:
            return line.split("CUDA_VISIBLE_DEVICES=", 1)[1].split(" ", 1)[0]
    raise AssertionError(f"{role}.log in {log_dir} has no start line")


def test_ray_campaign_has_the_local_outcomes_and_pins_each_pair(ray_cluster: str, ray_home: Matrix) -> None:
    local = ray_home.subprocess("run", "-m", "ray_suite", "--no-report", timeout=300)
    assert local.returncode == 1, local.stdout + local.stderr  # the fault cases fail on purpose
    local_rows = _rows(ray_home, _latest_campaign(ray_home))

    remote = ray_home.subprocess(
        "run", "-m", "ray_suite", "--executor", "ray", "--ray-address", ray_cluster, "--no-report", timeout=300
    )
    assert remote.returncode == 1, remote.stdout + remote.stderr
    campaign = _latest_campaign(ray_home)
    assert ray_home.sql("SELECT executor FROM campaign WHERE id = ?", campaign) == [("ray",)]
    ray_rows = _rows(ray_home, campaign)

    assert {k: _summary(r) for k, r in ray_rows.items()} == {k: _summary(r) for k, r in local_rows.items()}
    for fault, (status, kind, check) in FAULT_CASES.items():
        row = ray_rows["ray_fault_" + fault.replace("-", "_") + "#1"]
        assert (row["status"], row["failure_kind"]) == (status, kind), row["message"]
        if check:
            assert check in _summary(row)[2]

    seen = set()
    for name in GPU_CASES:
        row = ray_rows[f"{name}#1"]
        assert row["status"] == "passed", row["message"]
        gpu = row["gpu"]
        assert isinstance(gpu, dict)
        (device,) = gpu["ray_gpu_ids"]
        assert device in ("0", "1") and gpu["cuda_visible_devices"] == device
        log_dir = Path(str(row["log_dir"]))  # the logs came back to the driver's host with the outcome
        assert _visible_devices(log_dir, "prefill") == _visible_devices(log_dir, "decode") == device
        seen.add(device)
    assert seen == {"0", "1"}, "two GPU cells start at once on two GPUs, so Ray must have used both"
    cpu_row = ray_rows["ray_cpu#1"]
    assert cpu_row["status"] == "passed"
    assert _visible_devices(Path(str(cpu_row["log_dir"])), "prefill") == "", "a CPU cell sees no GPU"
    for row in ray_rows.values():
        _assert_nothing_left(row)


def _wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _running_uids(m: Matrix) -> list[str]:
    return [str(uid) for (uid,) in m.sql("SELECT uid FROM cell_run WHERE status = 'running'")]


@contextlib.contextmanager
def _runner_with_a_live_pair(m: Matrix, *args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A `matrix run` whose one cell's pair is up: (the runner, the cell's uid); killed if still running."""
    runner = m.popen("run", *args, "--no-report")
    try:
        _wait_for(lambda: any(find_cell_processes(uid) for uid in _running_uids(m)), 60, "the pair")
        (uid,) = _running_uids(m)
        yield runner, uid
    finally:
        if runner.poll() is None:
            runner.kill()


def test_ctrl_c_cancels_remote_cells_and_leaves_no_process(ray_cluster: str, ray_home: Matrix) -> None:
    args = ("--case", "ray_slow", "--executor", "ray", "--ray-address", ray_cluster)
    with _runner_with_a_live_pair(ray_home, *args) as (runner, uid):
        runner.send_signal(signal.SIGINT)
        output, _ = runner.communicate(timeout=60)
    assert runner.returncode == 3, output
    rows = _rows(ray_home, _latest_campaign(ray_home))
    (row,) = rows.values()
    assert (row["uid"], row["status"]) == (uid, "interrupted"), row["message"]
    _assert_nothing_left(row)


def test_a_lost_worker_interrupts_the_cell_and_the_retry_runs_it(ray_cluster: str, ray_home: Matrix) -> None:
    args = ("--case", "ray_slow_once", "--executor", "ray", "--ray-address", ray_cluster, "--max-attempts", "2")
    with _runner_with_a_live_pair(ray_home, *args) as (runner, uid):
        # The pair's processes are children of the Ray worker running the task: kill that worker outright.
        worker = find_cell_processes(uid)[0].parent()
        assert worker is not None and "ray" in " ".join(worker.cmdline()).lower()
        worker.kill()
        output, _ = runner.communicate(timeout=120)
    assert runner.returncode == 0, output
    rows = _rows(ray_home, _latest_campaign(ray_home))
    first, second = rows["ray_slow_once#1"], rows["ray_slow_once#2"]
    assert (first["status"], first["failure_kind"]) == ("interrupted", "infra")
    assert "Ray lost the cell's worker" in str(first["message"])
    assert second["status"] == "passed", second["message"]
    for row in (first, second):
        _assert_nothing_left(row)
    # The killed worker never removed its scratch directory; the retry's task on the node swept it.
    assert not list(Path(tempfile.gettempdir()).glob(f"matrix-{first['uid']}-*")), first["uid"]


def test_bad_ray_options_exit_2_and_change_nothing(ray_home: Matrix) -> None:
    before = ray_home.dump()
    for args, needle in (
        (("--executor", "ray", "--ray-address", f"127.0.0.1:{free_port()}"), "cannot reach the Ray cluster"),
        (("--executor", "ray", "--ray-address", "no-port-here"), "is not auto, HOST:PORT"),
        (("--executor", "ray", "--pack"), "--pack is for the local executor"),
        (("--ray-address", "auto"), "--ray-address needs --executor ray"),
    ):
        result = ray_home.subprocess("run", "-m", "ray_suite", *args, "--no-report", timeout=60)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert needle in result.stderr, result.stderr
    assert ray_home.dump() == before


def test_without_an_address_the_run_starts_and_stops_its_own_cluster(ray_home: Matrix) -> None:
    def ray_daemons() -> set[int]:
        names = ("raylet", "gcs_server")
        return {p.pid for p in psutil.process_iter(["name"]) if (p.info.get("name") or "") in names}

    before = ray_daemons()
    result = ray_home.subprocess("run", "--case", "ray_cpu", "--executor", "ray", "--no-report", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _rows(ray_home, _latest_campaign(ray_home))
    assert [r["status"] for r in rows.values()] == ["passed"]
    _wait_for(lambda: ray_daemons() <= before, 30, "the run's own Ray cluster to stop")


def test_ray_cli_is_installed_next_to_the_interpreter() -> None:
    assert shutil.which("ray", path=str(Path(sys.executable).parent)), "the dev extra installs ray"


def test_ray_tasks_run_each_skew_role_in_its_own_runtime(ray_cluster: str, tmp_path: Path) -> None:
    """[M20] A skew cell travels to its Ray task whole: each role's runtime provisioned and launched there.
    The grid of test_skew_fanout (0.2.0's prefill drops the KV transfer) must come out the same as locally."""
    from tests.helpers.skew import SKEW_CASE, skew_catalog, skew_classes

    m = Matrix(home=tmp_path, db_path=tmp_path / "matrix.db")
    assert m.subprocess("catalog", "sync", *skew_catalog(tmp_path / "catalog")).returncode == 0
    result = m.subprocess("run", "--case", SKEW_CASE, "--skew", "--executor", "ray", "--ray-address", ray_cluster,
                          "--no-report", "-q", timeout=300)  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr  # the pairs with prefill 0.2.0 fail
    classes = skew_classes(m)
    assert classes[("0.1.0", "0.2.0")] == "works" and classes[("0.1.0", "0.1.0")] == "works"
    # 502 "KV transfer failed" from decode, every process up: an error answer, not a silent wrong one.
    assert classes[("0.2.0", "0.1.0")] == classes[("0.2.0", "0.2.0")] == "error-answer"
    rows = sorted(m.sql("SELECT roles_key, status FROM cell_run"))
    assert rows == [("", "failed"), ("", "passed"), ("prefill=0.1.0,decode=0.2.0", "passed"),
                    ("prefill=0.2.0,decode=0.1.0", "failed")]  # fmt: skip
    logs = [p for p in (tmp_path / "runs").rglob("decode.log") if "prefill_0.2.0" in str(p.parent)]
    assert logs and "KV transfer" in "".join(p.read_text() for p in logs)  # the logs came back from the node
