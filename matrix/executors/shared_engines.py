"""A skew grid's engines, each (role, runtime) started once and shared by every pair that names it.

A vLLM NIXL pair is a routing choice: the decode instance pulls KV from whichever prefill instance a
request's `kv_transfer_params` name, so a prefill x decode grid of N runtimes needs 2N engines, not 2N^2.
`grid_plans` says which cells of a campaign can share (their arm serves any peer, see `SHARED_ENGINE_ARMS`)
and how many pairs will use each engine; `SharedEngines` starts an engine on its first use, restarts one
that died (the pair that finds it dead is told, and so is the row of the pair it died under), and stops it
as soon as the last pair that names it is done, so at most one prefill and every decode are alive at once
when the pairs come prefill-major, as `matrix.skew` plans them.

Every engine is supervised like a cell's process: its own session, its own `MATRIX_CELL_ID` (the engine's
id) and its own watchdog, so a runner killed outright leaves no engine behind; `LiveCells` holds each
engine's supervisor beside the pairs', so Ctrl-C tears engines down too.
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from matrix.arm_table import SHARED_ENGINE_ARMS
from matrix.case_launch import peer_loss_options, topology_counts
from matrix.cells import CaseInfo, Cell, RuntimeInfo
from matrix.errors import ConfigError, MatrixError
from matrix.hardware.ports import PortAllocator, PortRequest
from matrix.kv_faults import LAUNCH_CLASSES, parse
from matrix.launch import faults
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import LaunchContext
from matrix.launch.caches import cache_env
from matrix.launch.launch_plan import LaunchPlan
from matrix.launch.providers import Environment, wrap_plan
from matrix.launch.supervisor import ReadyResult, Supervisor, TeardownReport
from matrix.model_files import resolve_model_dir
from matrix.runner import LiveCells

# Arms whose decode instance serves any prefill peer the request names (vLLM's NixlConnector: the request's
# kv_transfer_params carry the prefill's engine id, host and side-channel port) and whose pair is two engine
# processes plus matrix's proxy. Other arms run their grid one cell at a time (a Dynamo frontend discovers
# every worker it sees, an SGLang pair shares a bootstrap room only with its own peer as matrix plans it).
# The arm table's `shared_engines` column.
ENGINE_ROLES = ("prefill", "decode")
EngineKey = tuple[str, str]  # (role, runtime label)


def engine_keys(cell: Cell) -> tuple[EngineKey, EngineKey]:
    """The (role, runtime label) of the prefill and the decode engine a cell's pair runs on."""
    return (("prefill", cell.runtime_of("prefill").label), ("decode", cell.runtime_of("decode").label))


@dataclass(frozen=True)
class GridPlan:
    """One case's shared-engine grid in a campaign: the cells (by key) it runs and each engine's planned uses."""

    case: str
    keys: frozenset[str]
    uses: Counter[EngineKey]
    # Each engine's runtime, in the order the grid's pairs first need them (the order they start in).
    runtimes: dict[EngineKey, RuntimeInfo] = field(default_factory=dict)
    # A fault grid ([M28]): cases that differ only in `kv_fault` share a pair whose engines load the fault
    # plugin armed for every class; each cell puts its own class in force (`fault_control`).
    faults: bool = False

    @property
    def engines(self) -> int:
        return len(self.uses)


def grid_plans(cells: Sequence[Cell]) -> dict[str, GridPlan]:
    """grid name -> its grid (one entry per attempt in `cells`: a repeat uses the engines again):

    * a skew grid, named by its case: each case of a sharing arm with at least one skew cell;
    * a fault grid ([M28]), named `faults-` and its first case: the unskewed cells of cases that differ only
      in `kv_fault`, when one of them has a fault: one pair per runtime serves every class and the healthy
      twin (A/A), where each would start a pair of its own.

    Every other cell runs on engines of its own."""
    plans: dict[str, GridPlan] = {}
    by_case = sorted(cells, key=lambda c: c.case.name)
    for name, group in itertools.groupby(by_case, key=lambda c: c.case.name):
        members = list(group)
        case = members[0].case
        if case.arm not in SHARED_ENGINE_ARMS or not any(c.skewed for c in members) or owns_its_engines(case):
            continue
        plans[name] = _plan(name, members)
    in_skew_grid = {key for plan in plans.values() for key in plan.keys}
    for members in _fault_groups([c for c in by_case if c.key not in in_skew_grid]):
        name = f"faults-{members[0].case.name}"
        plans[name] = replace(_plan(name, members), faults=True)
    return plans


def _plan(name: str, members: Sequence[Cell]) -> GridPlan:
    uses: Counter[EngineKey] = Counter(key for cell in members for key in engine_keys(cell))
    runtimes: dict[EngineKey, RuntimeInfo] = {}
    for cell in members:
        for key in engine_keys(cell):
            runtimes.setdefault(key, cell.runtime_of(key[0]))
    return GridPlan(name, frozenset(c.key for c in members), uses, runtimes)


def engine_identity(case: CaseInfo) -> CaseInfo:
    """What of `case` its engines are made of: the case without its name, markers and a plugin's `kv_fault`.
    Two cases with equal identities start equal engines (the fault plugin aside, which a fault grid's engines
    load for every class); a fault matrix injects at launch (`model_revision`) makes engines of their own."""
    kv_fault = case.launch.kv_fault if _launch_fault(case) else None
    return replace(case, name="", id=None, markers=(), marker_texts=(), launch=replace(case.launch, kv_fault=kv_fault))


def _launch_fault(case: CaseInfo) -> bool:
    """Whether `case`'s fault is made at launch, not by the plugin (a bad value: left to the arm to refuse)."""
    spec = case.launch.kv_fault
    if not spec:
        return False
    try:
        return parse(spec).fault in LAUNCH_CLASSES
    except ConfigError:
        return False


def _fault_groups(cells: Sequence[Cell]) -> list[list[Cell]]:
    """The cells of a sharing arm, unskewed and not owning their engines, grouped by engine identity; only
    groups with a `kv_fault` cell (their fault plugin is what lets one pair serve different cases) or the
    repeats of a launch-made fault."""
    groups: list[tuple[CaseInfo, list[Cell]]] = []
    for cell in cells:
        case = cell.case
        if case.arm not in SHARED_ENGINE_ARMS or cell.skewed or owns_its_engines(case):
            continue
        identity = engine_identity(case)  # not hashable (launch tables hold dicts): compared one by one
        group = next((members for known, members in groups if known == identity), None)
        if group is None:
            groups.append((identity, [cell]))
        else:
            group.append(cell)
    return [members for _identity, members in groups if _shares_a_faulted_pair(members)]


def _shares_a_faulted_pair(members: Sequence[Cell]) -> bool:
    """Whether a group of cells with one engine identity is a fault grid: one of them has a plugin's fault
    (the plugin switches classes per cell), or the group repeats a fault made at launch (`model_revision`:
    its engines ARE the fault, so every cell of the case can be served by one such pair)."""
    if any(c.case.launch.kv_fault and not _launch_fault(c.case) for c in members):
        return True
    return len(members) > 1 and _launch_fault(members[0].case)


def owns_its_engines(case: CaseInfo) -> bool:
    """Whether each cell of `case` needs engines of its own: several workers of a role (an xPyD topology, whose
    `prefill_2` a shared grid has no engine for) or a peer-loss check (it kills and restarts the pair's engines,
    which other pairs of the grid would be using). Such a case's skew cells run one at a time, each composing
    its roles' plans (`launch.roles`)."""
    launch = case.launch
    peer_loss = peer_loss_options(getattr(launch, "peer_loss", None))
    return topology_counts(getattr(launch, "topology", None)) != (1, 1) or peer_loss is not None


@dataclass
class Engine:
    """One shared engine: its current instance (if any), how often it was started, and why it last ended."""

    key: EngineKey
    runtime: RuntimeInfo
    starts: int = 0
    supervisor: Supervisor | None = None
    plan: LaunchPlan | None = None
    log_path: Path | None = None
    work_dir: Path | None = None  # the current instance's directory (a fault grid's events file is there)
    ports: dict[str, int] = field(default_factory=dict)
    ready_s: float = 0.0
    ready_warning: str = ""  # ready only just, near its start-up timeout (with the host's load)
    started_for: str = ""
    # The pairs this instance served so far, in order (a row names what the engine had seen before it).
    served: list[str] = field(default_factory=list)
    # A start-up that failed: (ReadyResult kind, message); a process that died starting is not started again
    # for the grid's later pairs (they get its failure), one that was not ready in time is.
    failed: tuple[str | None, str] | None = None
    failed_for: str = ""
    # How the previous instance ended (exit code) and under which pair it was seen dead.
    last_exit: int | None = None
    last_exit_seen: str = ""

    @property
    def name(self) -> str:
        return f"{self.key[0]} {self.runtime.version}"

    @property
    def role(self) -> str:
        return self.key[0]

    def exit_code(self) -> int | None:
        """The instance's exit code once it has ended; None while it runs (or before it started)."""
        if self.supervisor is None:
            return None
        return self.supervisor.exited().get(self.role)


@dataclass(frozen=True)
class Acquired:
    """An engine a pair runs on, and what the pair's row says about it."""

    engine: Engine
    started_now: bool
    note: str


class SharedEngines:
    """The engines of one grid. Pairs call `acquire` and `release` one at a time (under `lock`), so each
    pair's metrics deltas come from its own two engines alone; a pair acquires its two engines (different
    keys) from two threads at once."""

    def __init__(self, grid: GridPlan, root: Path, allocator: PortAllocator, live: LiveCells) -> None:
        self.grid = grid
        self.lock = threading.Lock()
        self._root = root
        self._allocator = allocator
        self._live = live
        self._left: Counter[EngineKey] = Counter(grid.uses)
        self._engines: dict[EngineKey, Engine] = {}
        self._id = f"grid-{secrets.token_hex(4)}"
        self.starts = 0
        self._count_lock = threading.Lock()
        # Engines start ahead of their first pair, `start_slots` at a time (a per-cell pair starts its two
        # engines side by side too): the grid's start-ups overlap as much as one cell's do.
        self._ahead: dict[EngineKey, Future[ReadyResult]] = {}
        self._pool = ThreadPoolExecutor(max_workers=start_slots(), thread_name_prefix="grid-start")
        self._warmed = False

    # -- acquire ------------------------------------------------------------------------------------

    def start_ahead(self, wanted: Sequence[tuple[EngineKey, Environment]], case: CaseInfo, pair: str) -> None:
        """Once per grid: start every engine of `wanted` (in order) in the background, as start slots free up;
        `acquire` waits for an engine still starting."""
        if self._warmed:
            return
        self._warmed = True
        for key, environment in wanted:
            engine = self._engines.setdefault(key, Engine(key, self.grid.runtimes[key]))
            self._ahead[key] = self._pool.submit(self._start_ahead, engine, environment, case, pair)

    def _start_ahead(self, engine: Engine, environment: Environment, case: CaseInfo, pair: str) -> ReadyResult:
        ready = self._start(engine, environment, case, f"the grid (started ahead with {pair})")
        if not ready.ok:
            engine.failed, engine.failed_for = (ready.kind, ready.message + _details(ready)), engine.started_for
            self._stop(engine)
        return ready

    def acquire(
        self, key: EngineKey, runtime: RuntimeInfo, environment: Environment, case: CaseInfo, pair: str
    ) -> Acquired | ReadyResult:
        """The running engine for `key` (started now if absent, restarted if it died), or the ReadyResult of
        the start-up that failed (remembered: the grid's later pairs get it without another start-up)."""
        engine = self._engines.setdefault(key, Engine(key, runtime))
        ahead = self._ahead.pop(key, None)
        if ahead is not None:
            ahead.result()  # its failure, if any, is the engine's `failed`
        if engine.failed is not None and engine.failed[0] == "timeout":
            # Not ready in time is not the engine's verdict (a loaded host): the next pair tries it afresh,
            # as its own per-cell start-up would.
            engine.failed = None
        if engine.failed is not None:
            kind, message = engine.failed
            return ReadyResult(False, kind, f"{message}\n(shared {engine.name} failed to start for pair "
                               f"{engine.failed_for}; not started again)", 0.0, "")  # fmt: skip
        note = ""
        if engine.supervisor is not None:
            code = engine.exit_code()
            if code is None and ahead is not None:
                engine.served = [pair]
                return Acquired(engine, True, f"{engine.name} started ahead of this pair, ready in "
                                f"{engine.ready_s:.1f} s{_warned(engine)}")  # fmt: skip
            if code is None:
                engine.served.append(pair)
                return Acquired(engine, False, f"{engine.name} shared, started for {engine.started_for}")
            # Died between pairs (or under the previous one, whose row says so): restart it for this pair.
            engine.last_exit, engine.last_exit_seen = code, pair
            note = f"; its previous instance exited with code {code} after serving {', '.join(engine.served)}"
            self._stop(engine)
        ready = self._start(engine, environment, case, pair)
        if not ready.ok:
            engine.failed, engine.failed_for = (ready.kind, ready.message + _details(ready)), pair
            self._stop(engine)
            return ready
        engine.served = [pair]
        restarted = engine.starts > 1
        what = f"restarted (start {engine.starts})" if restarted else "started"
        return Acquired(engine, True, f"{engine.name} {what} for this pair, ready in {engine.ready_s:.1f} s"
                        f"{_warned(engine)}{note}")  # fmt: skip

    def _start(self, engine: Engine, environment: Environment, case: CaseInfo, pair: str) -> ReadyResult:
        engine.starts += 1
        with self._count_lock:  # a pair's two engines start in two threads
            self.starts += 1
        role, label = engine.key
        engine_id = f"{self._id}-{role}-{_safe(label)}-{engine.starts}"
        work_dir = self._root / engine_id
        work_dir.mkdir(parents=True, exist_ok=True)
        engine.work_dir = work_dir
        try:
            engine.ports = self._allocator.allocate(engine_id, (PortRequest(f"{role}_http"),
                                                                PortRequest(f"{role}_side_channel")))  # fmt: skip
            engine.plan = engine_plan(engine.key, engine.runtime, environment, case, engine_id, engine.ports, work_dir,
                                      self.fault_control(role))  # fmt: skip
        except Exception as exc:  # a model that could not be generated in time too: this engine's failure
            self._allocator.release(engine_id)
            return ReadyResult(False, "startup", f"cannot start shared {engine.name}: {exc!r}", 0.0, "")
        for scratch in engine.plan.scratch_dirs:
            Path(scratch).mkdir(parents=True, exist_ok=True)
        engine.supervisor = Supervisor(engine.plan, work_dir)
        engine.log_path = engine.supervisor.log_paths()[role]
        engine.started_for = pair
        self._live.add(engine_id, engine.supervisor)
        try:
            engine.supervisor.start()
            ready = engine.supervisor.wait_ready()
        except MatrixError as exc:
            return ReadyResult(False, "startup", str(exc), 0.0, "")
        engine.ready_s, engine.ready_warning = ready.ready_s, ready.warning
        return ready

    def fault_control(self, role: str) -> Path | None:
        """The file a fault grid's `role` engine reads its fault class from (None: not a fault grid). In the
        grid's directory, not the engine's: a restarted engine reads the same file."""
        return self._root / f"kv-fault-control-{role}" if self.grid.faults else None

    # -- release ------------------------------------------------------------------------------------

    def stop_now(self, keys: Iterable[EngineKey]) -> list[tuple[Engine, TeardownReport]]:
        """Stop these engines although later pairs name them (they start afresh for the next one): a pair
        left them holding work or KV that would be the next pair's. They get SIGTERM together, as a per-cell
        pair's engines do: a vLLM prefill still holding KV for its decode did not exit within the grace
        period while the decode was alive and waiting for its own teardown (a `never_complete` cell)."""
        running = [e for key in keys if (e := self._engines.get(key)) is not None and e.supervisor is not None]
        if not running:
            return []
        with ThreadPoolExecutor(max_workers=len(running), thread_name_prefix="grid-stop") as pool:
            return list(zip(running, pool.map(self._stop, running), strict=True))

    def release(self, keys: Iterable[EngineKey]) -> list[tuple[Engine, TeardownReport]]:
        """One planned use of each engine is done; an engine no later pair names is stopped now, and its
        teardown report goes to the row of the pair that used it last."""
        reports = []
        for key in keys:
            ahead = self._ahead.pop(key, None) if self._left[key] <= 1 else None
            if ahead is not None:
                ahead.result()  # a pair that never ran (e.g. its environment vanished) was its last use
            self._left[key] -= 1
            engine = self._engines.get(key)
            if self._left[key] <= 0 and engine is not None and engine.supervisor is not None:
                reports.append((engine, self._stop(engine)))
        return reports

    def _stop(self, engine: Engine) -> TeardownReport:
        assert engine.supervisor is not None and engine.plan is not None
        report = engine.supervisor.teardown()
        self._live.remove(engine.plan.cell_id)
        self._allocator.release(engine.plan.cell_id)
        for scratch in engine.plan.scratch_dirs:
            shutil.rmtree(scratch, ignore_errors=True)
        engine.supervisor = None
        return report

    def close(self) -> None:
        """Stop every engine still running (the campaign ended early: a stop, fail-fast, a skipped pair)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for engine in self._engines.values():
            if engine.supervisor is not None:
                self._stop(engine)

    def running(self) -> list[Engine]:
        return [engine for engine in self._engines.values() if engine.supervisor is not None]


SLOTS_ENV = "MATRIX_GRID_START_SLOTS"


def start_slots() -> int:
    """How many engines of a grid start at once: `MATRIX_GRID_START_SLOTS` if set, else two, as a per-cell
    pair's, or one per two CPUs on a larger host."""
    value = os.environ.get(SLOTS_ENV, "").strip()
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            raise ConfigError(f"{SLOTS_ENV}={value!r} is not a whole number: set it to how many engines of a grid "
                              "may start at once, or unset it") from None  # fmt: skip
    return max(2, len(os.sched_getaffinity(0)) // 2)  # the CPUs this runner may use, not the host's


def engine_plan(
    key: EngineKey, runtime: RuntimeInfo, environment: Environment, case: CaseInfo, engine_id: str,
    ports: dict[str, int], work_dir: Path, fault_control: Path | None = None,
) -> LaunchPlan:  # fmt: skip
    """The arm's pair plan for `runtime`, cut down to the one process of `key`'s role: the same argv and
    environment a per-cell run gives that role, on the engine's own ports. With `fault_control` (a fault
    grid's engine) the process loads the fault plugin for every class instead of the case's own fault; a fault
    made at launch (`model_revision`) stays the engine's own."""
    role = key[0]
    if fault_control is not None and not _launch_fault(case):
        case = replace(case, launch=replace(case.launch, kv_fault=None))
    arm = get_arm(case.arm)
    caches = cache_env(runtime) if environment.container is None else {}
    caches = {name: path for name, path in caches.items() if name not in environment.env}
    model_dir = resolve_model_dir(case.launch.model_dir, case.source_dir, environment.python)
    # The other role's and the proxy's ports are not this engine's: its process never reads them.
    all_ports = dict.fromkeys((request.name for request in arm.port_requests(case)), 0)
    context = LaunchContext(
        cell_id=engine_id, case=case, runtime=runtime, ports={**all_ports, **ports}, work_dir=work_dir,
        python=environment.python, env={**environment.env, **caches}, caches=caches, model_dir=model_dir,
    )  # fmt: skip
    pair = arm.plan(context)
    if fault_control is not None:
        pair = replace(pair, processes=tuple(
            replace(p, env={**p.env, **faults.control_env(fault_control, work_dir, dict(p.env))}) if p.role == role
            else p for p in pair.processes))  # fmt: skip
    plan = wrap_plan(environment, pair, case=case, runtime=runtime, workspace=work_dir, model_dir=model_dir)
    processes = tuple(p for p in plan.processes if p.role == role)
    if len(processes) != 1:
        raise MatrixError(f"arm {case.arm}'s plan has {len(processes)} {role!r} processes, not one")
    return replace(plan, processes=processes, ready_probes=(), ports=dict(ports), metrics_checks=(), oracle=None,
                   lifecycle=None)  # fmt: skip


def _details(ready: ReadyResult) -> str:
    return (f"\n--- error lines (whole log) ---\n{ready.error_lines}" if ready.error_lines else "") + (
        f"\n--- last log lines ---\n{ready.log_tail}" if ready.log_tail else ""
    )


def _warned(engine: Engine) -> str:
    return f" ({engine.ready_warning})" if engine.ready_warning else ""


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "._" else "_" for c in label)
