"""The supervisor against real processes: readiness, startup failures, teardown of stubborn processes."""

from __future__ import annotations

import re
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest

from matrix.errors import MatrixError
from matrix.launch import supervisor as supervisor_module
from matrix.launch.launch_plan import HealthProbe, ProcessSpec
from matrix.launch.supervisor import Supervisor, find_cell_processes
from tests.helpers.supervisor import FAKE_ENGINE, engine, make_plan, models_probe

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

TIMESTAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00 ")


def python(role: str, code: str) -> ProcessSpec:
    return ProcessSpec(role=role, argv=(sys.executable, "-c", code))


def test_readiness_is_noticed_after_the_engine_is_ready(tmp_path: Path, ports: list[int]) -> None:
    ready_file = tmp_path / "ready"
    # The delay lets the poll interval grow to its cap, so this measures the worst case.
    plan = make_plan(
        (
            engine("prefill", ports[0], "--delay", "0.3", "--ready-file", str(ready_file)),
            engine("decode", ports[1]),
        ),
        ports,
        ready_probes=(models_probe(ports[0]),),
    )
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        result = sup.wait_ready()
        noticed = time.time()
        # Never ready before the engine said so: it writes the file before it serves its first request.
        engine_ready = ready_file.exists()
    latency = noticed - float(ready_file.read_text())
    # Printed, not asserted: how fast is a benchmark's question (tests/bench/bench_cell_overhead.py); on a
    # loaded CI host any bound here would fail for reasons that are not the supervisor's.
    print(f"ready_s={result.ready_s:.3f} detection latency={latency * 1000:.1f} ms")
    assert result.ok and result.kind is None, result.message
    assert engine_ready
    report = sup.teardown()
    print(f"teardown {report.duration_s * 1000:.1f} ms")
    assert report.clean and not report.needed_sigkill and not report.escaped_pids
    assert {exit_.role: exit_.returncode for exit_ in report.exits} == {"prefill": -15, "decode": -15}
    assert not any(exit_.killed for exit_ in report.exits)


def test_process_exiting_before_ready_is_a_startup_failure(tmp_path: Path, ports: list[int]) -> None:
    crash = python("prefill", "import sys; print('loading weights'); print('CUDA out of memory'); sys.exit(1)")
    plan = make_plan((crash, engine("decode", ports[1])), ports, ready_probes=(models_probe(ports[1]),))
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        result = sup.wait_ready()
    assert not result.ok
    assert result.kind == "startup"
    assert result.message == "prefill exited with code 1 before it was ready"
    assert result.log_tail.splitlines()[-1].endswith("CUDA out of memory")
    assert sup.teardown().clean


def test_process_killed_by_a_signal_says_so(tmp_path: Path, ports: list[int]) -> None:
    segfault = ProcessSpec(
        role="decode",
        argv=(sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"),
        health=(HealthProbe(f"http://127.0.0.1:{ports[1]}/health"),),  # never answers
    )
    plan = make_plan((segfault,), ports)
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        result = sup.wait_ready()
    assert result.kind == "startup"
    assert result.message == "decode was killed by SIGSEGV before it was ready"


def test_never_healthy_times_out_within_the_budget(tmp_path: Path, ports: list[int]) -> None:
    # Healthy, but the model list stays empty: the plan-level probe never passes.
    plan = make_plan(
        (engine("frontend", ports[0], "--no-models"),),
        ports,
        ready_probes=(models_probe(ports[0]),),
        startup_timeout_s=0.5,
    )
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        result = sup.wait_ready()
    assert result.kind == "timeout" and not result.ok
    assert result.message.startswith("not ready after 0.5 s: ")  # the plan's budget, not another
    assert f"http://127.0.0.1:{ports[0]}/v1/models" in result.message
    assert "without models" in result.message
    assert "listening on" in result.log_tail


def test_process_that_never_listens_times_out_with_its_log(tmp_path: Path, ports: list[int]) -> None:
    hang = ProcessSpec(
        role="decode",
        argv=(sys.executable, "-c", "import time; print('stuck in NCCL init'); time.sleep(60)"),
        health=(HealthProbe(f"http://127.0.0.1:{ports[1]}/health"),),
    )
    plan = make_plan((hang,), ports, startup_timeout_s=0.4)
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        result = sup.wait_ready()
    assert result.kind == "timeout"
    assert "decode probe" in result.message and "ConnectError" in result.message
    assert "stuck in NCCL init" in result.log_tail
    assert sup.teardown().clean


def test_process_ignoring_sigterm_is_killed(tmp_path: Path, ports: list[int]) -> None:
    plan = make_plan(
        (engine("prefill", ports[0]), engine("decode", ports[1], "--ignore-term")),
        ports,
        teardown_grace_s=0.3,
    )
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        assert sup.wait_ready().ok
    report = sup.teardown()
    print(f"teardown with SIGKILL {report.duration_s * 1000:.1f} ms")
    assert report.needed_sigkill == ("decode",)
    assert {exit_.role: (exit_.returncode, exit_.killed) for exit_ in report.exits} == {
        "prefill": (-15, False),
        "decode": (-9, True),
    }
    assert report.clean
    assert find_cell_processes(plan.cell_id) == []
    # SIGTERM first: the engine lived to log that it ignored it, and only then was it killed.
    assert "ignoring SIGTERM" in sup.log_paths()["decode"].read_text()


def test_setsid_grandchild_is_found_by_the_sweep(tmp_path: Path, ports: list[int]) -> None:
    plan = make_plan((engine("prefill", ports[0], "--orphan"),), ports, teardown_grace_s=0.5)
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        assert sup.wait_ready().ok
    report = sup.teardown()
    log = sup.log_paths()["prefill"].read_text()
    orphan_pid = int(re.search(r"orphan pid (\d+)", log).group(1))  # type: ignore[union-attr]
    print(f"teardown with sweep {report.duration_s * 1000:.1f} ms")
    assert orphan_pid in report.escaped_pids
    assert not report.needed_sigkill  # the engine itself stopped on SIGTERM; only its orphan escaped
    assert report.clean
    assert find_cell_processes(plan.cell_id) == []
    assert not psutil.pid_exists(orphan_pid) or psutil.Process(orphan_pid).status() == psutil.STATUS_ZOMBIE
    # The orphan shared the engine's stdout, so its output reached the log before teardown.
    assert "orphan up" in log


def test_a_grandchild_ending_by_itself_within_the_grace_has_not_escaped(tmp_path: Path, ports: list[int]) -> None:
    # vllm-rs runs its Python engine in a group of its own, whose resource tracker outlives the engine by a
    # second or two while it cleans up: it ends by itself, so the sweep must not kill it and call it escaped.
    plan = make_plan((engine("prefill", ports[0], "--orphan", "--orphan-linger", "0.3"),), ports, teardown_grace_s=3)
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        assert sup.wait_ready().ok
    report = sup.teardown()
    orphan_pid = int(re.search(r"orphan pid (\d+)", sup.log_paths()["prefill"].read_text()).group(1))  # type: ignore[union-attr]
    assert report.escaped_pids == () and report.clean, report
    assert not psutil.pid_exists(orphan_pid) or psutil.Process(orphan_pid).status() == psutil.STATUS_ZOMBIE


def test_logs_are_timestamped_and_carry_the_environment(tmp_path: Path, ports: list[int]) -> None:
    code = "import os; print(os.environ['MATRIX_CELL_ID'], os.environ['FROM_BASE'], os.environ['FROM_SPEC'])"
    spec = ProcessSpec(role="decode", argv=(sys.executable, "-c", code), env={"FROM_SPEC": "spec"})
    plan = make_plan((spec,), ports)
    with Supervisor(plan, tmp_path / "logs", base_env={"FROM_BASE": "base", "FROM_SPEC": "base"}) as sup:
        sup.start()
        sup.wait_ready()
        # Teardown would kill a child still starting up (a loaded host can take seconds to start Python):
        # let it print first, since this test is about what the log holds, not about teardown.
        deadline = time.monotonic() + 60
        while plan.cell_id not in sup.log_paths()["decode"].read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
    lines = sup.log_paths()["decode"].read_text().splitlines()
    assert lines and all(TIMESTAMPED.match(line) for line in lines), lines
    assert any(line.endswith(f"{plan.cell_id} base spec") for line in lines)
    assert sup.log_paths() == {"decode": tmp_path / "logs" / "decode.log"}


def test_teardown_is_idempotent_and_runs_on_errors(tmp_path: Path, ports: list[int]) -> None:
    plan = make_plan((engine("decode", ports[1]),), ports)
    sup = Supervisor(plan, tmp_path / "logs")
    with pytest.raises(RuntimeError, match="boom"), sup:
        sup.start()
        assert sup.wait_ready().ok
        raise RuntimeError("boom")
    first = sup.teardown()
    assert sup.teardown() is first
    assert first.clean and first.exits[0].returncode == -15


def test_port_still_listening_is_reported(tmp_path: Path, ports: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor_module, "_PORT_RELEASE_S", 0.2)
    plan = make_plan((python("decode", "import time; time.sleep(60)"),), ports)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", ports[2]))
        squatter.listen()
        with Supervisor(plan, tmp_path / "logs") as sup:
            sup.start()
        report = sup.teardown()
    assert report.busy_ports == (ports[2],)
    assert not report.clean


def test_unstartable_process_raises_and_earlier_ones_are_stopped(tmp_path: Path, ports: list[int]) -> None:
    missing = ProcessSpec(role="decode", argv=(str(tmp_path / "no-such-engine"),))
    plan = make_plan((engine("prefill", ports[0], probe=False), missing), ports)
    with pytest.raises(MatrixError, match="cannot start decode"), Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
    report = sup.teardown()
    assert [exit_.role for exit_ in report.exits] == ["prefill"]
    assert report.clean
    assert "cannot start decode" in sup.log_paths()["decode"].read_text()


def test_a_process_that_starts_after_another_waits_for_its_probes(tmp_path: Path, ports: list[int]) -> None:
    engine_ready = tmp_path / "engine-ready"
    sidecar_started = tmp_path / "sidecar-started"
    sidecar = ProcessSpec(
        role="sidecar",
        argv=(sys.executable, FAKE_ENGINE, "--port", str(ports[1]), "--ready-file", str(sidecar_started)),
        health=(HealthProbe(f"http://127.0.0.1:{ports[1]}/health"),),
        start_after=("engine",),
    )
    plan = make_plan(
        (engine("engine", ports[0], "--delay", "0.5", "--ready-file", str(engine_ready)), sidecar),
        ports,
        ready_probes=(models_probe(ports[1]),),
    )
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        assert set(sup.pids()) == {"engine"}  # the sidecar waits
        result = sup.wait_ready()
        assert result.ok, result.message
        assert set(sup.pids()) == {"engine", "sidecar"}
        assert float(sidecar_started.read_text()) >= float(engine_ready.read_text())
    report = sup.teardown()
    assert report.clean and {exit_.role for exit_ in report.exits} == {"engine", "sidecar"}


def test_a_process_that_dies_before_its_dependents_start_fails_the_cell_without_them(
    tmp_path: Path, ports: list[int]
) -> None:
    sidecar = ProcessSpec(role="sidecar", argv=(sys.executable, FAKE_ENGINE, "--port", str(ports[1])),
                          start_after=("engine",))  # fmt: skip
    crash = ProcessSpec(role="engine", argv=(sys.executable, "-c", "import sys; sys.exit(3)"),
                        health=(HealthProbe(f"http://127.0.0.1:{ports[0]}/health"),))  # fmt: skip
    with Supervisor(make_plan((crash, sidecar), ports), tmp_path / "logs") as sup:
        sup.start()
        result = sup.wait_ready()
    assert not result.ok and result.kind == "startup" and "engine exited with code 3" in result.message
    assert {exit_.role for exit_ in sup.teardown().exits} == {"engine"}


def test_start_after_must_name_an_earlier_role(tmp_path: Path, ports: list[int]) -> None:
    late = ProcessSpec(role="a", argv=(sys.executable, "-c", "pass"), start_after=("b",))
    with pytest.raises(ValueError, match="not earlier roles"):
        Supervisor(make_plan((late, python("b", "pass")), ports), tmp_path / "logs")


def test_dependents_are_stopped_before_what_they_depend_on(tmp_path: Path, ports: list[int]) -> None:
    # The sidecar, on SIGTERM, checks that its engine still answers (as Dynamo's sidecar drains against
    # its engine) and says so in its log before exiting.
    engine_url = f"http://127.0.0.1:{ports[0]}/health"
    drain = (
        "import signal, sys, time, urllib.request\n"
        "def stop(*_):\n"
        f"    with urllib.request.urlopen({engine_url!r}, timeout=2) as r: print('engine' + ' answered', r.status)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('sidecar' + ' up', flush=True)\n"  # split: the log's first line repeats the argv
        "while True: time.sleep(0.05)\n"
    )
    sidecar = ProcessSpec(role="sidecar", argv=(sys.executable, "-c", drain), start_after=("engine",))
    plan = make_plan((engine("engine", ports[0]), sidecar), ports)
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        assert sup.wait_ready().ok
        deadline = time.monotonic() + 10
        while "sidecar up" not in (tmp_path / "logs" / "sidecar.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
    report = sup.teardown()
    assert report.clean and not report.needed_sigkill
    assert "engine answered 200" in (tmp_path / "logs" / "sidecar.log").read_text()
