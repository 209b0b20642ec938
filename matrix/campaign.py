"""One `matrix run`: plan, record a campaign, run its cells one after another, write every outcome.

The database is written in short transactions (campaign row with a pending row per cell, each cell's
claim, each outcome), so a crash loses at most the cells in flight, and those are found and cleaned up
by the next run through their owner and heartbeat (`recover_stale`). `--join` adds a runner to a
running campaign: runners claim pending cells without duplicates (`matrix.schedule.claims`).
"""

from __future__ import annotations

import functools
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from matrix import __version__
from matrix.arm_table import workspace_unvouched
from matrix.catalog.queries import of_new_runtimes, plan_from_db
from matrix.cells import ROLES, Cell, RuntimeInfo
from matrix.db.engine import transaction
from matrix.db.models import Campaign, CellRun, utcnow
from matrix.errors import ConfigError
from matrix.executors import EXECUTORS
from matrix.executors.local import LocalExecutor
from matrix.executors.shared_engines import grid_plans
from matrix.fanout.shards import pick_cells
from matrix.hardware.gpus import Gpu, inventory
from matrix.hardware.ports import PortAllocator
from matrix.interrupts import StopSignal
from matrix.outcome import FAILED_STATUSES, INTERRUPTED, NOT_RUN, interruption
from matrix.owners import owner_alive, owner_gone
from matrix.paths import port_registry_path, runs_dir
from matrix.plan import Selection
from matrix.progress import Event, Reporter, make_reporter
from matrix.schedule.claims import add_pending_rows, cell_ids, latest_statuses, leave_campaign, pending_attempts
from matrix.schedule.executor import CellExecutor
from matrix.schedule.makespan import Forecast, PlannedJob, forecast
from matrix.schedule.scheduler import Job, Scheduler, SchedulerOptions, Tally
from matrix.schedule.slots import SlotPool, demand_for
from matrix.schedule.start import Start
from matrix.skew_outcome import PairClass, grid_lines
from matrix.versions import parse_version

HEARTBEAT_S = 5.0
# How `HostHooks.provision` starts the error of a runtime this host cannot build (no such Python).
HOST_CANNOT_BUILD = "this host cannot build it: "

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 3

Echo = Callable[[str], None]


@dataclass(frozen=True)
class RunOptions:
    selection: Selection
    logs_dir: Path | None = None
    quiet: bool = False
    json_events: bool = False
    jobs: int | None = None
    max_attempts: int = 1
    fail_fast: bool = False
    pack: bool = False
    gpus: tuple[str, ...] | None = None
    # New campaign, or resume / rerun-failed / join a recorded one (`matrix.schedule.start`).
    start: Start = field(default_factory=Start)
    workspace: Path | None = None
    executor: str = "local"  # local | ray
    ray_address: str | None = None  # None: start a local Ray cluster
    # `--cell`: run exactly these cells of the plan (stable ids or CASE@BACKEND-VERSION keys).
    cells: tuple[str, ...] = ()
    # Names the campaign across databases, so `matrix import` merges shards of one CI run into one campaign.
    campaign_key: str = ""
    # Told the campaign's id once its cells are chosen (e.g. to write `--results-out` afterwards).
    on_campaign: Callable[[int], None] | None = None
    # Where venv runtimes are provisioned from (`--find-links`, `--offline`); the index by default.
    # Where venv runtimes are built from (a `ProvisionSource` of the launch layer; None: the index).
    provision_source: Any = None
    # The launch machinery on this host; None: `matrix.executors.hooks.LocalHooks`.
    hooks: HostHooks | None = None
    # `--new`: only cells of runtimes that have no attempt at all yet (e.g. just added by `matrix discover`).
    new_only: bool = False
    # `--repeat N`: every cell of a new campaign runs N times, each repeat its own attempt (1..N).
    repeat: int = 1
    # `--loopback-only`: a cell whose processes listen beyond loopback fails (check `loopback_only`).
    loopback_only: bool = False
    # Skew grids of arms that serve any peer start each (role, runtime) engine once per grid, every pair on
    # its own proxy (`matrix.executors.shared_engines`); `--per-cell-engines` turns it off.
    shared_engines: bool = True


def git_sha() -> str:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=2, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout.strip() if result.returncode == 0 else ""


class HostHooks(Protocol):
    """What a campaign needs from the launch machinery on the driver's host (`matrix.executors.hooks`
    implements it), so that the campaign never imports `matrix.launch`."""

    build_interrupted: type[BaseException]  # what `provision` raises when a stop request ended a build

    def with_specs(self, cells: Sequence[Cell]) -> list[Cell]:
        """The cells with each runtime's provider entry parsed once into its typed recipe (`RuntimeInfo.spec`),
        shared by all the cells of that runtime, so that no cell parses it again."""
        ...

    def provision(
        self, runtimes: Sequence[RuntimeInfo], say: Callable[[str], None], source: Any, stop: Callable[[], bool]
    ) -> dict[str, str]:
        """Build the venv runtimes' environments; runtime label -> error for those that failed, starting
        with `HOST_CANNOT_BUILD` when this host lacks what the recipe needs (its cells are skipped)."""
        ...

    def sweep_orphan_builds(self) -> list[int]: ...

    def kill_cell_processes(self, uid: str) -> list[int]: ...


def local_hooks() -> HostHooks:
    from matrix.executors.hooks import LocalHooks

    return LocalHooks()


def recover_stale(factory: sessionmaker[Session], echo: Echo, hooks: HostHooks | None = None) -> int:
    """Mark cells of dead runners `interrupted` and kill any process still carrying their cell id, or the
    provisioning tag of a runner on this host that is gone (pip of a SIGKILLed build)."""
    hooks = hooks or local_hooks()
    now = utcnow()
    recovered = 0
    builds = hooks.sweep_orphan_builds()
    if builds:
        echo(f"killed {len(builds)} environment build process(es) left by a runner that died")
    with transaction(factory) as session:
        for row in session.scalars(select(CellRun).where(CellRun.status == "running")):
            if owner_gone(row, now):
                alive = owner_alive(row.owner_host, row.owner_pid)
                killed = hooks.kill_cell_processes(row.uid) if alive is False else []
                cut = interruption(
                    f"runner {row.owner_host}:{row.owner_pid} died while this cell ran"
                    + (f"; killed {len(killed)} leftover process(es)" if killed else "")
                )
                row.status, row.failure_kind, row.message = cut.status, cut.failure_kind, cut.message
                row.finished_at = now
                recovered += 1
                echo(f"recovered {row.uid} ({row.cell_key}): owner gone, marked interrupted")
        for campaign in session.scalars(select(Campaign).where(Campaign.status == "running")):
            if owner_alive(campaign.host, campaign.owner_pid) is not False:
                continue
            # Its owner is gone, but a runner that joined may still run cells: it owns the campaign now.
            live = session.scalars(
                select(CellRun).where(CellRun.campaign_id == campaign.id, CellRun.status == "running").limit(1)
            ).first()
            if live is not None:
                campaign.host, campaign.owner_pid = live.owner_host, live.owner_pid
                continue
            campaign.status = "interrupted"
            campaign.finished_at = campaign.finished_at or now
    return recovered


class _Heartbeat(threading.Thread):
    """Keeps `heartbeat_at` of this runner's running rows fresh, from its own connection."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        super().__init__(name="matrix-heartbeat", daemon=True)
        self._factory = factory
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(HEARTBEAT_S):
            with transaction(self._factory) as session:
                session.execute(
                    update(CellRun)
                    .where(
                        CellRun.status == "running",
                        CellRun.owner_host == socket.gethostname(),
                        CellRun.owner_pid == os.getpid(),
                    )
                    .values(heartbeat_at=utcnow())
                )

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=HEARTBEAT_S)


def expected_durations(session: Session, case_ids: Collection[int] | None = None) -> dict[int, float]:
    """Median total time of each case (of `case_ids`, default all) over earlier finished attempts.

    A run asks for its own cases only: the history of every other case is no business of a one-cell run,
    and it grows with every campaign.
    """
    samples: dict[int, list[float]] = {}
    query = select(CellRun.case_id, CellRun.total_s).where(
        CellRun.total_s.is_not(None), CellRun.status.in_(("passed", "failed", "timeout"))
    )
    if case_ids is not None:
        query = query.where(CellRun.case_id.in_(sorted(case_ids)))
    rows = session.execute(query)
    for case_id, total in rows:
        if total is not None:
            samples.setdefault(case_id, []).append(float(total))
    return {case_id: statistics.median(values) for case_id, values in samples.items()}


def expected_phases(session: Session, case_ids: Collection[int]) -> dict[int, tuple[float, float]]:
    """(median seconds to ready, median seconds from ready to the end) of each case of `case_ids` over its
    earlier finished attempts that have both: what the makespan forecast replays (`schedule.makespan`)."""
    samples: dict[int, tuple[list[float], list[float]]] = {}
    query = select(CellRun.case_id, CellRun.ready_s, CellRun.total_s).where(
        CellRun.case_id.in_(sorted(case_ids)),
        CellRun.ready_s.is_not(None),
        CellRun.total_s.is_not(None),
        CellRun.status.in_(("passed", "failed", "timeout")),
    )
    for case_id, ready, total in session.execute(query):
        if ready is None or total is None:  # excluded by the query; typed as optional columns
            continue
        startups, runs = samples.setdefault(case_id, ([], []))
        startups.append(float(ready))
        runs.append(max(0.0, float(total) - float(ready)))
    return {case_id: (statistics.median(s), statistics.median(r)) for case_id, (s, r) in samples.items()}


def forecast_cells(
    session: Session, cells: Sequence[Cell], gpus: Sequence[Gpu], *, pack: bool, jobs: int | None
) -> Forecast:
    """The makespan `matrix run` would take for `cells` on this host with these options, predicted from the
    cases' earlier attempts (a case without one counts its start-up and request timeouts)."""
    phases = expected_phases(session, {cell.case.id for cell in cells if cell.case.id is not None})
    pool = SlotPool(gpus, pack=pack, cpu_slots=jobs or max(1, os.cpu_count() or 1))
    planned = []
    for cell in cells:
        startup, run = phases.get(cell.case.id or -1, (cell.case.startup_timeout_s, cell.case.request_timeout_s))
        demand = demand_for(cell, cpu_ok=cell.case.runs_on_cpu, absolute_memory=cell.case.absolute_memory)
        planned.append(PlannedJob(demand, startup, run))
    known = sum(1 for cell in cells if cell.case.id in phases)
    return forecast(planned, pool, workers=jobs or pool.slots, from_history=known)


def _latest_campaign(session: Session) -> Campaign:
    campaign = session.scalar(select(Campaign).order_by(Campaign.id.desc()))
    if campaign is None:
        raise ConfigError("there is no campaign yet: run `matrix run` first")
    return campaign


def _stored_cells(session: Session, campaign: Campaign) -> list[Cell]:
    """The cells of a campaign, planned again from the selection it stored."""
    stored = campaign.selection
    selection = Selection(
        marker_expression=stored.get("marker_expression"),
        since=tuple(stored.get("since", ())),
        until=tuple(stored.get("until", ())),
        backends=tuple(stored.get("backends", ())),
        cases=tuple(stored.get("cases", ())),
        runtimes=tuple(stored.get("runtimes", ())),
        strict_markers=False,
        skew=bool(stored.get("skew", False)),
        skew_frontend=bool(stored.get("skew_frontend", False)),
        prefill_runtime=stored.get("prefill_runtime"),
        decode_runtime=stored.get("decode_runtime"),
    )
    keys = set(stored.get("cells", ()))
    cells = [c for c in plan_from_db(session, selection).cells if c.key in keys]
    if len(cells) < len(keys):
        # Skew cells a shard ran by id (`--cell`) without --skew in its selection: made from the diagonal.
        from matrix.skew import every_skew_cell

        found = {c.key for c in cells}
        diagonal = plan_from_db(session, replace(selection, skew=False, skew_frontend=False,
                                                 prefill_runtime=None, decode_runtime=None)).cells  # fmt: skip
        cells += [c for c in every_skew_cell(diagonal) if c.key in keys and c.key not in found]
    return cells


def _cells_with_latest(session: Session, campaign: Campaign) -> list[tuple[Cell, int, str]]:
    """Every cell of the campaign with its latest attempt number and status ((0, "") if it has no row)."""
    state = latest_statuses(session, campaign.id)
    out = []
    for cell in _stored_cells(session, campaign):
        attempt, status = state.get(cell_ids(cell), (0, ""))
        out.append((cell, attempt, status))
    return out


def _key(cell: Cell) -> tuple[int, int, str]:
    return cell_ids(cell)


def _joined_cells(session: Session, campaign_id: int, echo: Echo) -> list[tuple[Cell, int, bool]]:
    """The cells of a running campaign that no runner has claimed yet, for `--join`."""
    campaign = session.get(Campaign, campaign_id)
    if campaign is None:
        raise ConfigError(f"no campaign {campaign_id} to join: give the id `matrix run` printed for it")
    if campaign.status != "running":
        raise ConfigError(
            f"campaign {campaign_id} is {campaign.status}, not running: only a running campaign can be joined; "
            f"run its unfinished cells with `matrix run --resume {campaign_id}`"
        )
    cells = _cells_with_latest(session, campaign)
    waiting = pending_attempts(session, campaign.id)
    chosen = [(cell, n, False) for cell, _attempt, _status in cells for n in waiting.get(_key(cell), [])]
    chosen += [(cell, 1, False) for cell, _attempt, status in cells if status == ""]
    echo(f"joining campaign {campaign.id}: {len(chosen)} of {len(cells)} cells not claimed yet")
    return chosen


def _selected_cells(session: Session, options: RunOptions, echo: Echo) -> tuple[int, list[tuple[Cell, int, bool]]]:
    """The campaign to write into and its (cell, attempt, failed before) list; creates a campaign if new."""
    start = options.start
    if start.mode == "join":
        assert start.campaign is not None  # `Start.from_flags` gives join its campaign
        return start.campaign, _joined_cells(session, start.campaign, echo)
    if start.mode in ("resume", "rerun-failed"):
        wanted = start.campaign
        campaign = session.get(Campaign, wanted) if wanted else _latest_campaign(session)
        if campaign is None:
            raise ConfigError(f"no campaign {wanted}; see `matrix campaigns list`")
        cells = _cells_with_latest(session, campaign)
        waiting = pending_attempts(session, campaign.id)
        chosen: list[tuple[Cell, int, bool]] = []
        for cell, attempt, status in cells:
            # Never started (its runner died first): claim those rows (several under --repeat).
            chosen.extend((cell, n, False) for n in waiting.get(_key(cell), []))
            if status == "pending":
                continue
            if start.mode == "resume" and status in ("", INTERRUPTED, NOT_RUN):
                chosen.append((cell, attempt + 1, False))
            elif start.mode == "rerun-failed" and status in FAILED_STATUSES:
                # An interruption says nothing about the cell: passing after one is not flaky.
                chosen.append((cell, attempt + 1, status != INTERRUPTED))
        campaign.status = "running"
        campaign.finished_at = None
        # The resuming runner owns the campaign now, so recovery elsewhere does not mark it interrupted.
        campaign.host, campaign.owner_pid = socket.gethostname(), os.getpid()
        what = "resuming" if start.mode == "resume" else "rerunning failed cells of"
        echo(f"{what} campaign {campaign.id}: {len(chosen)} of {len(cells)} cells to run")
        return campaign.id, chosen
    plan = plan_from_db(session, options.selection)
    planned = pick_cells(plan, options.cells) if options.cells else list(plan.cells)
    if options.new_only:
        planned = of_new_runtimes(session, planned)
    recorded = {**options.selection.as_dict(), "cells": [c.key for c in planned]}
    if options.campaign_key:
        recorded["campaign_key"] = options.campaign_key
    campaign = Campaign(
        status="running",
        selection=recorded,
        host=socket.gethostname(),
        executor=options.executor,
        git_sha=git_sha(),
        matrix_version=__version__,
        owner_pid=os.getpid(),
    )
    session.add(campaign)
    session.flush()
    add_pending_rows(session, campaign.id, planned, repeat=options.repeat)
    # Repeats round-robin over the cells (every cell's first repeat, then every second one...): runtimes
    # compared with each other then share the host's load over time, instead of one running in a quiet
    # hour and the other in a busy one (docs/statistics.md measured that drift).
    return campaign.id, [(cell, n, False) for n in range(1, options.repeat + 1) for cell in planned]


def _runtimes_of(cells: list[Cell]) -> list[RuntimeInfo]:
    """Every runtime the cells run, each once: a skew cell's roles' runtimes too."""
    found: dict[str, RuntimeInfo] = {}
    for cell in cells:
        for runtime in cell.runtimes:
            found.setdefault(runtime.label, runtime)
    return list(found.values())


def _provision(cells: list[Cell], options: RunOptions, echo: Echo, stop: StopSignal, hooks: HostHooks) -> None:
    """Build the environments the cells need first, with progress; cells of a failed build are skipped.

    Raises `hooks.build_interrupted` on SIGINT/SIGTERM, with the half-built environment removed."""

    def say(line: str) -> None:
        if options.json_events:  # stdout carries only JSON events then
            print(line, file=sys.stderr, flush=True)
        elif not options.quiet:
            echo(line)

    failures = hooks.provision(
        _runtimes_of(cells), say, options.provision_source, stop=lambda: stop.requested
    )
    for label, error in failures.items():
        say(f"{label}: not provisioned, its cells will {_consequence(error)}: {_first_error(error)}")


def _consequence(error: str) -> str:
    """A recipe that fails to build fails its cells; a host that cannot build it (no such Python) skips them."""
    return "be skipped" if error.startswith(HOST_CANNOT_BUILD) else "fail (kind provision)"


def _first_error(error: str) -> str:
    """The build's own error line when the message carries one, else the message's first line."""
    lines = error.splitlines()
    found = next((line.removeprefix("build error: ") for line in lines if line.startswith("build error: ")), "")
    return found or (lines[0] if lines else "")


def _check_repeat(options: RunOptions) -> None:
    if options.repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    if options.repeat > 1 and options.max_attempts > 1:
        # A retry turns a failure into a later pass; repeats are there to count failures.
        raise ConfigError("--repeat measures how often a cell fails, --max-attempts retries failures away: "
                          "use one of them")  # fmt: skip
    # What the start mode contradicts (`--repeat`, `--cell`, `--new` with a continued campaign), for callers
    # other than the command line, which checks it first.
    options.start.check(cells=bool(options.cells), new_only=options.new_only, repeat=options.repeat)


def _check_executor_options(options: RunOptions) -> None:
    if options.executor not in EXECUTORS:
        raise ConfigError(f"unknown executor {options.executor!r}; choose one of {', '.join(EXECUTORS)}")
    if options.executor != "ray":
        if options.ray_address is not None:
            raise ConfigError("--ray-address needs --executor ray")
        return
    if options.pack:
        raise ConfigError("--pack is for the local executor: under Ray each cell gets whole GPUs from Ray")
    if options.gpus is not None:
        raise ConfigError("--gpus is for the local executor: under Ray, Ray assigns each cell its GPUs")


# The most never-started cells a stopped run names; the rest are counted.
NOT_STARTED_SHOWN = 20


def _stopped_lines(campaign_id: int, not_started: Sequence[str]) -> list[str]:
    """What a stopped run leaves to do: the cells that never started, and the command that runs them."""
    lines = []
    if not_started:
        names = ", ".join(not_started[:NOT_STARTED_SHOWN])
        more = f" and {len(not_started) - NOT_STARTED_SHOWN} more" if len(not_started) > NOT_STARTED_SHOWN else ""
        lines.append(f"not started ({len(not_started)}): {names}{more}")
    lines.append(f"to finish it (interrupted and never-started cells): matrix run --resume {campaign_id}")
    return lines


def run_campaign(factory: sessionmaker[Session], options: RunOptions, echo: Echo) -> int:
    if options.max_attempts < 1:
        raise ConfigError("--max-attempts must be at least 1")
    _check_repeat(options)
    if options.jobs is not None and options.jobs < 1:
        raise ConfigError("--jobs must be at least 1")
    if options.json_events:  # stdout carries only JSON events then
        echo = functools.partial(print, file=sys.stderr, flush=True)
    _check_executor_options(options)
    if options.executor == "ray":
        from matrix.executors.ray_cluster import RayExecutor

        # Connect before anything is written, so an unreachable cluster leaves the database unchanged.
        ray_executor = RayExecutor(options.ray_address, workspace=options.workspace)
        try:
            gpus, cluster_cpus, gpus_per_node = ray_executor.cluster()
            return _run(factory, options, echo, gpus, ray_executor, cluster_cpus, gpus_per_node)
        finally:
            ray_executor.shutdown()  # idempotent: stops a cluster this run started, or disconnects
    return _run(factory, options, echo, inventory(restrict=options.gpus), None, None, None)


@dataclass
class _Run:
    """One run of a campaign as its steps (`_STEPS`) fill it in: what each step needs of the steps before."""

    factory: sessionmaker[Session]
    options: RunOptions
    echo: Echo
    gpus: tuple[Gpu, ...]
    ray_executor: CellExecutor | None  # None: the local executor
    cluster_cpus: int | None
    gpus_per_node: int | None
    hooks: HostHooks = field(init=False)
    campaign_id: int = field(init=False)
    selected: list[tuple[Cell, int, bool]] = field(init=False)  # (cell, attempt, failed before)
    durations: dict[int, float] = field(init=False)
    pool: SlotPool = field(init=False)
    jobs_limit: int = field(init=False)
    jobs: list[Job] = field(init=False)
    stop: StopSignal = field(init=False)
    executor: CellExecutor = field(init=False)
    reporter: Reporter = field(init=False)


def _recover(run: _Run) -> int | None:
    """Cells and campaigns of runners that died are marked first, their leftover processes killed."""
    run.hooks = run.options.hooks or local_hooks()
    recover_stale(run.factory, run.echo, run.hooks)
    return None


def _choose_cells(run: _Run) -> int | None:
    """The campaign and its attempts to run, in one transaction (a new campaign is recorded here); each
    runtime's recipe parsed once; the cases' expected durations."""
    options = run.options
    with transaction(run.factory) as session:
        run.campaign_id, selected = _selected_cells(session, options, run.echo)
        parsed = run.hooks.with_specs([cell for cell, _attempt, _failed in selected])
        run.selected = [(cell, attempt, failed) for cell, (_, attempt, failed) in zip(parsed, selected, strict=True)]
        if not run.selected and not options.start.continuing:
            run.echo("nothing to run: the selection matches no cells (see `matrix plan --explain`)")
            session.rollback()
            return EXIT_OK
        run.durations = expected_durations(
            session, {cell.case.id for cell, _attempt, _failed in run.selected if cell.case.id}
        )
    if options.on_campaign is not None:
        options.on_campaign(run.campaign_id)
    return None


def _plan_jobs(run: _Run) -> int | None:
    """The slots of this host (or cluster) and one job per attempt with its demand and expected duration."""
    options = run.options
    cpu_slots = options.jobs or max(1, run.cluster_cpus or os.cpu_count() or 1)
    run.pool = SlotPool(run.gpus, pack=options.pack, cpu_slots=cpu_slots, max_gpus_per_cell=run.gpus_per_node)
    run.jobs_limit = options.jobs or run.pool.slots
    run.jobs = []
    for cell, attempt, failed_before in run.selected:
        # The memory facts came with the cell (`CaseInfo`, computed from its arm's row when it was made).
        absolute = cell.case.absolute_memory and not workspace_unvouched(cell.case.launch, options.workspace)
        demand = demand_for(cell, cpu_ok=cell.case.runs_on_cpu, absolute_memory=absolute)
        expected = run.durations.get(cell.case.id or -1, cell.case.startup_timeout_s + cell.case.request_timeout_s)
        run.jobs.append(Job(cell, attempt, expected, demand, failed_before))
    return None


def _provision_first(run: _Run) -> int | None:
    """Build the environments the jobs need before any cell starts (Ray workers build their own)."""
    # From here a signal only sets a flag: a build in progress is ended and removed, the campaign is left
    # `interrupted` with its cells pending (`--resume` finishes it).
    stop = run.stop = StopSignal()
    stop.install()
    if run.ray_executor is not None:  # Ray workers build what their cells need on their own nodes
        return None
    try:
        cells = [job.cell for job in run.jobs if run.pool.can_ever_fit(job.demand) is None]
        _provision(cells, run.options, run.echo, stop, run.hooks)
    except run.hooks.build_interrupted:
        stop.requested = True
    except BaseException:
        stop.restore()
        raise
    if not stop.requested:
        return None
    stop.restore()
    state = leave_campaign(run.factory, run.campaign_id, interrupted=True)
    run.echo(f"campaign {run.campaign_id} {state}: {stop.signal_name or 'stopped'} while provisioning, no cell "
             f"ran; `matrix run --resume {run.campaign_id}` finishes it")  # fmt: skip
    return EXIT_INTERRUPTED


def _make_executor(run: _Run) -> int | None:
    """The executor (Ray's, or threads on this host with the skew grids' shared engines) and the live view."""
    options = run.options
    # Ray tasks run one cell each on whichever node: their grids stay per cell.
    local = run.ray_executor is None
    grids = grid_plans([job.cell for job in run.jobs]) if options.shared_engines and local else {}
    run.executor = run.ray_executor or LocalExecutor(
        run.pool, PortAllocator(port_registry_path()), max_workers=run.jobs_limit, gpus=run.gpus,
        workspace=options.workspace, grids=grids,
    )  # fmt: skip
    run.reporter = make_reporter(total=len(run.jobs), json_events=options.json_events, quiet=options.quiet)
    return None


def _schedule(run: _Run) -> int | None:
    """Run every job on the scheduler, the heartbeat keeping this runner's rows alive; then leave the campaign
    and say how it went (and, when stopped, what is left and the command that finishes it)."""
    options, campaign_id, reporter, stop = run.options, run.campaign_id, run.reporter, run.stop
    where = f"{len(run.gpus)} GPU(s) in the Ray cluster" if run.ray_executor else f"{len(run.gpus)} GPU(s)"
    logs_root = (options.logs_dir or runs_dir()) / f"campaign-{campaign_id}"
    reporter.emit(
        Event("campaign-start", detail=f"campaign {campaign_id}: {len(run.jobs)} cells, {run.jobs_limit} at once, "
              f"{where}, logs in {logs_root}", data={"campaign": campaign_id, "cells": len(run.jobs)})
    )  # fmt: skip
    heartbeat = _Heartbeat(run.factory)
    heartbeat.start()
    started = time.monotonic()
    scheduler = Scheduler(
        run.factory, campaign_id, run.pool, run.executor, reporter, stop,
        SchedulerOptions(jobs=run.jobs_limit, max_attempts=options.max_attempts, fail_fast=options.fail_fast,
                         loopback_only=options.loopback_only),
        logs_root,
    )  # fmt: skip
    try:
        tally = scheduler.run(run.jobs)
    finally:
        heartbeat.stop()
        stop.restore()
        state = leave_campaign(run.factory, campaign_id, interrupted=stop.requested)
    summary = ", ".join(f"{n} {status}" for status, n in sorted(tally.counts.items())) or "no cells finished"
    if tally.classes:  # a skew run's pairs by class: refusals are outcomes, only the findings fail the run
        summary += "; skew pairs: " + ", ".join(f"{n} {cls}" for cls, n in sorted(tally.classes.items()))
        summary += " (a clean-reject is an honest refusal, not a finding)" if tally.refused else ""
    # Other runners still at work: this runner's part is done, the campaign is not.
    what = f"{state} in" if state != "running" else "still running on other runners; this runner done after"
    reporter.emit(
        Event("campaign-end", status=state, detail=f"campaign {campaign_id} {what} "
              f"{time.monotonic() - started:.1f}s: {summary}", data={"campaign": campaign_id, "counts": tally.counts})
    )  # fmt: skip
    if stop.requested:
        for line in _stopped_lines(campaign_id, tally.not_started):
            reporter.emit(Event("message", detail=line, data={"campaign": campaign_id}))
    elif tally.classes:
        for line in _skew_grid_lines(tally):
            reporter.emit(Event("message", detail=line, data={"campaign": campaign_id}))
    reporter.close()
    if stop.requested:
        return EXIT_INTERRUPTED
    return EXIT_FAILED if tally.any_failed else EXIT_OK


def _skew_grid_lines(tally: Tally) -> list[str]:
    """A skew run ends with its grids: each pair's class from this run's attempts (the latest decides; one
    of an earlier attempt in this run that was classed otherwise is marked), `matrix skew`'s text."""
    by_case: dict[tuple[str, str, str], dict[str, list[PairClass]]] = {}
    for case, backend, options, pair in tally.skew_pairs:
        by_case.setdefault((case, backend, options), {}).setdefault(pair.cell, []).append(pair)
    lines = []
    for (case, backend, options), cells in sorted(by_case.items()):
        pairs = []
        for attempts in cells.values():
            latest = attempts[-1]
            others = tuple(f"{a.verdict.cls} in this run: {(a.verdict.reason.splitlines() or [''])[0]}"
                           for a in attempts[:-1] if a.verdict.cls != latest.verdict.cls)  # fmt: skip
            pairs.append(replace(latest, disagreed=others))
        versions = sorted({v for pair in pairs for v in pair.roles.values()}, key=parse_version)
        pairs.sort(key=lambda p: tuple(parse_version(p.roles[r]) for r in ROLES))
        title = f"{case} ({backend})" + (f", {options}" if options else "")
        lines += grid_lines(title, versions, pairs)
    return lines


# A campaign run, in order: a step that returns an exit code ends the run there (nothing to run, stopped while
# provisioning); the last one always does.
_STEPS: tuple[Callable[[_Run], int | None], ...] = (
    _recover, _choose_cells, _plan_jobs, _provision_first, _make_executor, _schedule,
)  # fmt: skip


def _run(
    factory: sessionmaker[Session],
    options: RunOptions,
    echo: Echo,
    gpus: tuple[Gpu, ...],
    ray_executor: CellExecutor | None,
    cluster_cpus: int | None,
    gpus_per_node: int | None,
) -> int:
    run = _Run(factory, options, echo, gpus, ray_executor, cluster_cpus, gpus_per_node)
    for step in _STEPS:
        code = step(run)
        if code is not None:
            return code
    raise AssertionError("the last step of a campaign run returns its exit code")
