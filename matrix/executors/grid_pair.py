"""One pair of a shared-engine skew grid: its own proxy in front of the grid's prefill and decode engines.

The pair's plan is the arm's own plan for the cell (the same request, KV-transfer metrics checks, lifecycle
checks and oracle a per-cell run has), on the shared engines' ports; only its proxy is started for it. The
row it yields is a per-cell row of the same cell key: what the request, the decode engine's metrics deltas
(pairs run one at a time, so the deltas are this pair's), the checks and the teardown of the proxy say, plus
what the pair's engines did: each engine's log lines written during the pair are copied into the pair's log
directory under the role's name (`prefill.log`, `decode.log`), an engine that died under the pair puts its
exit code in the row (a crash, as in a per-cell run), and an engine stopped after its last pair has its
teardown judged on that pair's row. The message says which engines the pair started, reused or restarted.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from matrix.cells import Cell
from matrix.check import faults
from matrix.check.specs import CheckFailure, EngineGauges
from matrix.errors import MatrixError
from matrix.executors import fault_grid
from matrix.executors.handshake_retry import serve_retrying_handshake_timeout
from matrix.executors.shared_engines import Acquired, Engine, EngineKey, SharedEngines, engine_keys
from matrix.hardware.ports import PortAllocator, PortRequest
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import LaunchContext
from matrix.launch.caches import cache_env
from matrix.launch.listeners import listening_sockets
from matrix.launch.providers import Environment, Unavailable, prepare, wrap_plan
from matrix.launch.supervisor import ReadyResult, TeardownReport, find_cell_processes
from matrix.model_files import resolve_model_dir
from matrix.outcome import (
    FAILED,
    PASSED,
    REQUEST,
    TIMEOUT,
    CellOutcome,
    after_teardown,
    error,
    failure,
    judge_control,
    judge_expectation,
    judge_fault,
    not_ready,
)

# The per-cell runner's own steps, shared so a pair's row is judged exactly as a per-cell row is.
from matrix.runner import (
    LiveCells,
    Resources,
    run_cell,
    serve_and_judge,
    teardown_checks,
    unready,
    with_refusal_evidence,
)


def run_pair(
    cell: Cell, cell_id: str, log_dir: Path, allocator: PortAllocator, resources: Resources, live: LiveCells,
    engines: SharedEngines,
) -> CellOutcome:  # fmt: skip
    """One attempt of a grid cell on the grid's shared engines, one pair at a time."""
    started = time.monotonic()
    with engines.lock:
        queued = time.monotonic() - started
        outcome = _pair(cell, cell_id, log_dir, allocator, resources, live, engines)
    total = time.monotonic() - started - queued
    outcome = replace(outcome, queued_s=queued, total_s=total, log_dir=str(log_dir))
    outcome = judge_control(outcome, cell.case.launch.expect_failed_checks or ())
    # [M28]: a fault grid's cell is judged as a per-cell one with a fault: whether it fired and was caught.
    if (fault := faults.evidence(cell.case.launch.kv_fault, log_dir)) is not None:
        outcome = judge_fault(outcome, *fault)
    return judge_expectation(outcome, cell.expected_failure if cell.missing_fixes else "")


def _pair(
    cell: Cell, cell_id: str, log_dir: Path, allocator: PortAllocator, resources: Resources, live: LiveCells,
    engines: SharedEngines,
) -> CellOutcome:  # fmt: skip
    keys = engine_keys(cell)
    environments: dict[str, Environment] = {}
    for role, _label in keys:
        environment = prepare(cell.runtime_of(role))
        if isinstance(environment, Unavailable):
            engines.release(keys)
            why = unready(environment)
            return replace(why, message=f"{role} runtime {cell.runtime_of(role).label}: {why.message}")
        if environment.container is not None:  # engines in containers are not shared: the per-cell path
            engines.release(keys)
            return run_cell(cell, cell_id, log_dir, allocator, resources, live)
        environments[role] = environment
    log_dir.mkdir(parents=True, exist_ok=True)
    # The generated model first, once: the engines starting side by side would each build it otherwise.
    with contextlib.suppress(Exception):  # its error is recorded by the engines' start-up and `_serve`
        resolve_model_dir(cell.case.launch.model_dir, cell.case.source_dir, environments["decode"].python)
    engines.start_ahead(_grid_environments(engines), cell.case, cell.key)
    # Both engines start side by side when both are needed, as a per-cell pair's do.
    acquiring = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(keys), thread_name_prefix="grid-engine") as pool:
        futures = {key[0]: pool.submit(engines.acquire, key, cell.runtime_of(key[0]), environments[key[0]],
                                       cell.case, cell.key) for key in keys}  # fmt: skip
    got = {role: future.result() for role, future in futures.items()}
    acquire_s = time.monotonic() - acquiring
    acquired = {role: a for role, a in got.items() if isinstance(a, Acquired)}
    failed = [(role, r) for role, r in got.items() if isinstance(r, ReadyResult)]
    if failed:
        reports = engines.release(keys)
        role, ready = failed[0]
        outcome = not_ready(ready.kind, f"shared {role} engine: {ready.message}{_ready_details(ready)}")
        notes = [a.note for a in acquired.values()]
        notes += [f"{r} {cell.runtime_of(r).version} did not start for this pair" for r, _ready in failed]
        return _with_engines(outcome, acquired, {}, reports, notes, log_dir)
    offsets = {role: _size(a.engine.log_path) for role, a in acquired.items()}
    switch = _arm_fault(cell, engines, acquired)
    gauges: list[EngineGauges] = []  # the engines' gauges, as the cell's plan names them
    try:
        # A request whose KV handshake timed out (a loaded host, other engines starting) is sent once more.
        outcome = serve_retrying_handshake_timeout(
            lambda: _serve(cell, cell_id, log_dir, allocator, resources, live, acquired, environments["decode"],
                           gauges),
            {role: (a.engine.log_path, offsets[role]) for role, a in acquired.items()},
        )
        # The pair's ready time counts from its start: the start-up of the engines started for it included.
        if outcome.ready_s is not None:
            outcome = replace(outcome, ready_s=outcome.ready_s + acquire_s)
    except BaseException:
        if switch is not None:
            fault_grid.disarm(switch, log_dir)
        engines.release(keys)
        raise
    restarts: list[tuple[Engine, TeardownReport]] = []
    if switch is not None:
        fault_grid.disarm(switch, log_dir)
        if outcome.status == TIMEOUT:
            # A request was cut: the engine still waits on it (vLLM's own limit for KV that never comes is
            # minutes), so waiting for rest would only delay the restart.
            restarts = engines.stop_now(keys)
            note = "fault grid: a request of this cell was cut; the pair's engines are restarted for the next cell"
        else:
            waited, held = fault_grid.settle(tuple(gauges))
            if held:
                restarts = engines.stop_now(keys)
            note = (f"fault grid: the pair still held work {waited:.1f} s after this cell ({'; '.join(held)}); its "
                    "engines are restarted for the next cell" if held else
                    f"fault grid: the pair was at rest {waited:.1f} s after this cell")  # fmt: skip
        outcome = replace(outcome, message=f"{outcome.message}\n{note}" if outcome.message else note)
    # What the engines listen on, as a per-cell row lists its engines' sockets (`--loopback-only` reads them).
    listeners = [
        sock for used in acquired.values() if used.engine.supervisor is not None and used.engine.plan is not None
        for sock in listening_sockets(find_cell_processes(used.engine.plan.cell_id), used.engine.supervisor.pids())
    ]  # fmt: skip
    outcome = replace(outcome, listeners=(*outcome.listeners, *listeners))
    notes = [a.note for a in acquired.values()]
    died: dict[str, int] = {}
    for role, used in acquired.items():
        code = used.engine.exit_code()
        if code is not None:
            died[role] = code
            notes.append(f"{used.engine.name} exited with code {code} during this pair")
    if died and outcome.status == PASSED:
        # The pair answered, but an engine died under it: a worker died, as a per-cell teardown would show.
        who = ", ".join(f"{acquired[role].engine.name} exited with code {code}" for role, code in died.items())
        outcome = replace(outcome, status=FAILED, failure_kind=REQUEST, message=f"{who} during the pair",
                          checks=(*outcome.checks, CheckFailure("engine_alive", who)))  # fmt: skip
    _copy_logs(acquired, offsets, log_dir)
    # A refused request's evidence is in the engines' logs, which the proxy's supervisor does not own: the
    # pair's slices of them give the row the error lines a per-cell row gets from its own engines.
    outcome = with_refusal_evidence(outcome, {role: log_dir / f"{role}.log" for role in acquired})
    reports = engines.release(keys)
    return _with_engines(outcome, acquired, died, reports, notes, log_dir, restarts)


def _arm_fault(cell: Cell, engines: SharedEngines, acquired: dict[str, Acquired]) -> fault_grid.FaultSwitch | None:
    """In a fault grid, the cell's KV fault (or none, for its healthy twin) put in force on the pair."""
    if not engines.grid.faults:
        return None
    controls = {role: control for role in acquired if (control := engines.fault_control(role)) is not None}
    work_dirs = {role: a.engine.work_dir for role, a in acquired.items() if a.engine.work_dir is not None}
    return fault_grid.arm(cell.case.launch.kv_fault, controls, work_dirs)


def _grid_environments(engines: SharedEngines) -> list[tuple[EngineKey, Environment]]:
    """Every engine of the grid with its runtime's environment, in the order the pairs first need them; an
    engine whose environment cannot run here is left to its pairs (each records why)."""
    out = []
    for key, runtime in engines.grid.runtimes.items():
        environment = prepare(runtime)
        if isinstance(environment, Environment) and environment.container is None:
            out.append((key, environment))
    return out


def _serve(
    cell: Cell, cell_id: str, log_dir: Path, allocator: PortAllocator, resources: Resources, live: LiveCells,
    acquired: dict[str, Acquired], environment: Environment, gauges: list[EngineGauges],
) -> CellOutcome:  # fmt: skip
    """The pair's proxy started, the request sent and checked, the proxy torn down (`serve_and_judge`, as a
    per-cell attempt). The engines' gauges, as the plan names them, go to `gauges`."""
    case = cell.case
    arm = get_arm(case.arm)
    try:
        ports = allocator.allocate(cell_id, (PortRequest("proxy"),))
    except MatrixError as exc:
        return error("infra", f"port allocation failed: {exc}")
    try:
        engine_ports = {name: port for got in acquired.values() for name, port in got.engine.ports.items()}
        caches = cache_env(cell.runtime) if environment.container is None else {}
        caches = {name: path for name, path in caches.items() if name not in environment.env}
        try:
            model_dir = resolve_model_dir(case.launch.model_dir, case.source_dir, environment.python)
        except MatrixError as exc:
            return failure("config", str(exc), ports=ports)
        context = LaunchContext(
            cell_id=cell_id, case=case, runtime=cell.runtime, ports={**engine_ports, **ports}, work_dir=log_dir,
            python=environment.python, env={**environment.env, **caches}, caches=caches, model_dir=model_dir,
            workspace=resources.workspace,
        )  # fmt: skip
        try:
            full = wrap_plan(environment, arm.plan(context), case=case, runtime=cell.runtime, workspace=log_dir,
                             model_dir=model_dir)  # fmt: skip
        except MatrixError as exc:
            return error("config", str(exc), ports=ports)
        if full.lifecycle is not None:
            gauges[:] = full.lifecycle.engines
        # Only the proxy is the pair's own process; its teardown checks cover its port alone.
        proxy = tuple(p for p in full.processes if p.role == "proxy")
        plan = replace(full, processes=proxy, ports=dict(ports), scratch_dirs=())
        if case.launch.lifecycle is False:
            plan = replace(plan, lifecycle=None)
        # A hang's evidence covers the pair's own process (the proxy); the shared engines' logs are in its
        # log directory's slices.
        outcome = serve_and_judge(plan, arm, context, environment, allocator, resources, live)
        return replace(outcome, ports={**engine_ports, **ports, **outcome.ports},
                       components=dict(environment.components))  # fmt: skip
    finally:
        allocator.release(cell_id)


def _with_engines(
    outcome: CellOutcome, acquired: dict[str, Acquired], died: dict[str, int],
    reports: list[tuple[Engine, TeardownReport]], notes: list[str], log_dir: Path,
    restarts: list[tuple[Engine, TeardownReport]] | None = None,
) -> CellOutcome:  # fmt: skip
    """The engines' part of the row: exit codes of engines that died or were stopped after this pair (its
    last, or `restarts`: stopped to start afresh for the next), the teardown checks of those stopped, and the
    note saying what the pair ran on."""
    exit_codes: dict[str, Any] = {**outcome.exit_codes, **died}
    checks: list[CheckFailure] = []
    stopped = [(e, r, "stopped to start afresh for the next pair") for e, r in restarts or ()]
    for engine, report, why in [*stopped, *((e, r, "stopped after its last pair") for e, r in reports)]:
        exit_codes.update({e.role: e.returncode for e in report.exits})
        checks += [replace(c, message=f"{engine.name}: {c.message}") for c in teardown_checks(report)]
        notes.append(f"{engine.name} {why}")
    outcome = after_teardown(replace(outcome, exit_codes=exit_codes), checks)
    note = "shared engines: " + "; ".join(notes) if notes else ""
    if not note:
        return outcome
    message = f"{outcome.message}\n{note}" if outcome.message else note
    return replace(outcome, message=message)


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def _copy_logs(acquired: dict[str, Acquired], offsets: dict[str, int], log_dir: Path) -> None:
    """Each engine's log lines of this pair into the pair's directory, under the role's name, after a line
    naming the whole log (which also holds the engine's start-up and the other pairs it served)."""
    for role, used in acquired.items():
        source = used.engine.log_path
        if source is None:
            continue
        start = 0 if used.started_now else offsets.get(role, 0)
        with (log_dir / f"{role}.log").open("wb") as sink:
            sink.write(f"[matrix] shared engine {used.engine.name}: its lines from this pair; whole log: "
                       f"{source}\n".encode())  # fmt: skip
            try:
                with source.open("rb") as handle:
                    handle.seek(start)
                    sink.write(handle.read())
            except OSError as exc:
                sink.write(f"[matrix] cannot read {source}: {exc}\n".encode())


def _ready_details(ready: ReadyResult) -> str:
    return (f"\n--- error lines (whole log) ---\n{ready.error_lines}" if ready.error_lines else "") + (
        f"\n--- last log lines ---\n{ready.log_tail}" if ready.log_tail else ""
    )
