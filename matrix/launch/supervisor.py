"""Start, watch and stop the processes of one cell, leaving nothing behind.

Orphaned engines are what hurts users most: a leftover process keeps GPU memory and ports, and the next
cell fails for a reason that has nothing to do with it. So the supervisor

* starts every process in its own session (its own process group), so one signal reaches the process
  and every child that stayed in its group;
* tags every process with `MATRIX_CELL_ID` in its environment; children inherit it even when they leave
  the group (MPI launchers and `setsid` do), so a sweep over all processes finds them. The same sweep
  lets a later runner clean up after one that was killed outright;
* verifies after teardown that no tagged process is left and that the cell's ports can be bound again;
* starts a watchdog (`matrix.launch.watchdog`) that kills the cell's processes within moments of the
  runner's death, even by SIGKILL, so a killed runner leaves nothing running.

Readiness is polled with a short, gently growing interval rather than fixed sleeps, so a ready pair is
noticed within about 50 ms and a dead one is reported at once, with the end of its log. Once a server
answers HTTP (but is not ready yet) the interval grows with the time it has been answering, to half a
second after five: engines log each request, and 50 ms probes would fill the log's tail with them. A
failure message carries the error lines of the whole log (ERROR, Traceback, panic, "Failed to"...) before
its tail, so the cause survives a chatty process. A process that logs a fatal error (FATAL, CRITICAL, a
panic, an ERROR that failed to do something) and is still not ready a few seconds later fails the start-up
at once instead of waiting out the timeout.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx
import psutil

from matrix.check.http import loopback_client
from matrix.errors import MatrixError
from matrix.hardware.ports import port_is_free
from matrix.launch.launch_plan import HealthProbe, LaunchPlan, LogSettle, ProcessSpec
from matrix.launch.procenv import candidates, environ_value
from matrix.text import excerpt

CELL_ENV = "MATRIX_CELL_ID"
LOG_TAIL_LINES = 40

_POLL_FIRST_S = 0.005
_POLL_MAX_S = 0.05  # bounds how late readiness (or a process's exit) is noticed
_POLL_GROWTH = 1.5
_PROBE_TIMEOUT_S = 1.0
# Killed processes need a moment to vanish and their sockets to close; these bound the verification.
_SWEEP_WAIT_S = 5.0
_PORT_RELEASE_S = 2.0
_REAP_S = 5.0
_PUMP_JOIN_S = 2.0
_MAX_LINE_BYTES = 65_536  # progress bars redraw with "\r" and may never end a line
_TAIL_BYTES = 262_144
# Once a probe gets HTTP answers (each request is a log line in most engines), the interval is this
# fraction of the time the server has been answering, between _POLL_MAX_S and _POLL_ANSWERED_S: readiness
# is noticed within ~10 % of that wait, and a long start-up is asked twice a second. A flat half second
# here cost every Dynamo mocker cell about 0.2 s of ready time.
_POLL_ANSWERED_S = 0.5
_POLL_ANSWERED_FRACTION = 0.1
# Error lines taken from the whole log into a failure message; the log is read up to this many bytes.
ERROR_LINES = 20
_ERROR_SCAN_BYTES = 64 * 1024 * 1024
_ERROR_LINE_CHARS = 500
ERROR_LINE = re.compile(
    rb"\b(?:ERROR|CRITICAL|FATAL)\b|Traceback \(most recent call last\)|\bpanic(?:ked)?\b|[Ff]ailed to |"
    rb"\b\w*(?:Error|Exception): |\berror: "
)
# A line that says the process cannot work. ERROR alone is not enough (engines log recoverable errors
# while they wait for a peer); a fatal line only fails the start-up if no readiness followed in
# FATAL_GRACE_S, so a process that recovers is not failed early.
FATAL_LINE = re.compile(rb"\b(?:FATAL|CRITICAL)\b|panicked at|\bpanic: |\bERROR\b.*[Ff]ailed to ")
FATAL_GRACE_S = 5.0


@dataclass(frozen=True)
class ProcessExit:
    """How one started process ended; `killed` means it outlived SIGTERM and the grace period."""

    role: str
    pid: int
    returncode: int | None
    killed: bool


@dataclass(frozen=True)
class ReadyResult:
    """Outcome of `wait_ready`: `kind` is None when ready, "startup" if a process died, else "timeout"."""

    ok: bool
    kind: str | None
    message: str
    ready_s: float
    log_tail: str
    error_lines: str = ""  # the error lines of the whole log of the processes concerned
    # Ready, but only just (`NEAR_TIMEOUT_FRACTION` of the budget used): the time, the budget and the host's
    # load, so a pass that nearly timed out on a loaded host is not read as a healthy start-up.
    warning: str = ""


@dataclass(frozen=True)
class TeardownReport:
    """What teardown had to do and whether it left the host clean."""

    duration_s: float
    exits: tuple[ProcessExit, ...]
    needed_sigkill: tuple[str, ...]
    escaped_pids: tuple[int, ...]
    survivors: tuple[int, ...]
    busy_ports: tuple[int, ...]

    @property
    def clean(self) -> bool:
        """No process of the cell is alive and all its ports can be bound again."""
        return not self.survivors and not self.busy_ports


class _FatalWatch:
    """The first fatal line a process printed, and when (set by its log pump, read by `wait_ready`)."""

    def __init__(self) -> None:
        self.line: str = ""
        self.at: float | None = None

    def see(self, line: bytes) -> None:
        if self.at is None and FATAL_LINE.search(line):
            self.line = excerpt(line.decode("utf-8", errors="replace").strip(), _ERROR_LINE_CHARS)
            self.at = time.monotonic()


class _SettleWatch:
    """When each of a process's `LogSettle` lines was opened and whether it settled (set by its log pump)."""

    def __init__(self, settles: tuple[LogSettle, ...]) -> None:
        self.settles = [(re.compile(s.opened.encode()), re.compile(s.settled.encode()), s) for s in settles]
        self.opened_at: dict[int, float] = {}
        self.settled: set[int] = set()

    def see(self, line: bytes) -> None:
        for index, (opened, settled, _) in enumerate(self.settles):
            if index not in self.opened_at and opened.search(line):
                self.opened_at[index] = time.monotonic()
            if index in self.opened_at and settled.search(line):
                self.settled.add(index)

    def waiting(self, now: float) -> LogSettle | None:
        """The first opened line still waiting for its settled one within its `wait_s`, if any."""
        for index, at in self.opened_at.items():
            spec = self.settles[index][2]
            if index not in self.settled and now < at + spec.wait_s:
                return spec
        return None


@dataclass
class _Child:
    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    log_path: Path
    pump: threading.Thread
    fatal: _FatalWatch
    settle: _SettleWatch

    @property
    def role(self) -> str:
        return self.spec.role


class Supervisor:
    """Owns every process of one `LaunchPlan`: start, readiness, teardown. Use it as a context manager."""

    def __init__(self, plan: LaunchPlan, log_dir: Path, *, base_env: Mapping[str, str] | None = None) -> None:
        roles = [spec.role for spec in plan.processes]
        if len(set(roles)) != len(roles):
            raise ValueError(f"roles must be unique, they name the log files: {roles}")
        for index, spec in enumerate(plan.processes):
            unknown = set(spec.start_after) - set(roles[:index])
            if unknown:
                raise ValueError(f"{spec.role} starts after {sorted(unknown)}, which are not earlier roles")
        self._plan = plan
        self._log_dir = log_dir
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._children: list[_Child] = []
        self._spawned_at: float | None = None
        self._report: TeardownReport | None = None
        self._teardown_lock = threading.Lock()
        self._watchdog: _Watchdog | None = None

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.teardown()

    def log_paths(self) -> dict[str, Path]:
        """Log file of every role, whether or not its process was started."""
        return {spec.role: self._log_dir / f"{spec.role}.log" for spec in self._plan.processes}

    # -- start -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start every process of the plan; raises `MatrixError` if one cannot be executed at all.

        Processes already started stay owned by the supervisor, so teardown still stops them.
        """
        if self._spawned_at is not None:
            raise RuntimeError("Supervisor.start() may only be called once")
        self._log_dir.mkdir(parents=True, exist_ok=True)
        plan = self._plan
        self._watchdog = _Watchdog.start(plan.cell_id, self._base_env, plan.container_engine, plan.scratch_dirs)
        self._spawned_at = time.monotonic()
        for spec in self._plan.processes:
            if not spec.start_after:
                self._spawn_owned(spec)

    def _spawn_owned(self, spec: ProcessSpec) -> None:
        # Spawning holds the teardown lock, so a teardown from another thread (cancellation) either
        # sees this child or stops the start before it is spawned: nothing starts unowned.
        with self._teardown_lock:
            if self._report is not None:
                raise MatrixError("cell cancelled before all its processes started")
            self._spawn(spec, self.log_paths()[spec.role])

    def _spawn(self, spec: ProcessSpec, log_path: Path, *, append: bool = False) -> None:
        log = log_path.open("ab" if append else "wb")
        _write_line(log, f"[matrix] starting {spec.role}: {shlex.join(spec.argv)}")
        try:
            popen = subprocess.Popen(
                spec.argv,
                # Never the runner's own directory: `python -m` puts the cwd first on sys.path, so a stray
                # timeit.py there would shadow the standard library inside the engine.
                cwd=spec.cwd or str(self._log_dir),
                env=self._child_env(spec.env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            _write_line(log, f"[matrix] cannot start {spec.role}: {exc}")
            log.close()
            raise MatrixError(f"cannot start {spec.role} ({spec.argv[0]}): {exc}") from exc
        # Owned at once, so an interruption from here on still ends in this process's teardown.
        assert popen.stdout is not None  # stdout=PIPE
        fatal, settle = _FatalWatch(), _SettleWatch(spec.settles)

        def see(line: bytes) -> None:
            fatal.see(line)
            settle.see(line)

        pump = threading.Thread(target=_pump, args=(popen.stdout, log, see), name=f"log-{spec.role}", daemon=True)
        self._children.append(_Child(spec, popen, log_path, pump, fatal, settle))
        _write_line(log, f"[matrix] {spec.role} started as pid {popen.pid}")
        pump.start()

    # -- one process lost and started again (the peer-loss check, `matrix.check.peer_loss`) ------------------

    def kill_role(self, role: str, reap_timeout_s: float) -> tuple[int, int | None, str]:
        """SIGKILL the process group of `role`'s current process, as a crash would end it: (its pid, its exit
        code once reaped or None if it was still not gone after `reap_timeout_s`, and then what the kernel said
        it was doing, e.g. "state D (disk sleep), in folio_wait_bit")."""
        child = self._current(role)
        _signal_group(child.popen.pid, signal.SIGKILL)
        try:
            return child.popen.pid, child.popen.wait(timeout=reap_timeout_s), ""
        except subprocess.TimeoutExpired:
            return child.popen.pid, None, _kernel_state(child.popen.pid)

    def restart_role(self, role: str) -> int:
        """Start `role` again from its spec (its log continues in the same file); the new pid. The old process
        stays in the teardown's list, so its exit is reported and its group swept like any other's."""
        child = self._current(role)
        with self._teardown_lock:
            if self._report is not None:
                raise MatrixError(f"cell torn down: {role} is not started again")
            self._spawn(child.spec, child.log_path, append=True)
        return self._children[-1].popen.pid

    def wait_role_ready(self, role: str, timeout_s: float) -> str | None:
        """Poll `role`'s own probes until they pass (None), or it dies or `timeout_s` passes (why not)."""
        child = self._current(role)
        pending: list[tuple[_Child | None, HealthProbe]] = [(child, probe) for probe in child.spec.health]
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        with loopback_client(_PROBE_TIMEOUT_S) as client:
            while pending:
                if (code := child.popen.poll()) is not None:
                    return f"{role} exited with code {code} before it was ready again"
                last = _advance(client, pending, deadline) or last
                if not pending:
                    break
                if time.monotonic() >= deadline:
                    return f"{role} not ready again after {timeout_s:g} s: {pending[0][1].url} last answered {last}"
                time.sleep(_POLL_MAX_S)
        return None

    def _current(self, role: str) -> _Child:
        found = [child for child in self._children if child.role == role]
        if not found:
            raise MatrixError(f"no started process has the role {role!r}")
        return found[-1]

    def pids(self) -> dict[str, int]:
        """The pid of every started process, by role (for telemetry); a role started again: its newest."""
        return {child.role: child.popen.pid for child in self._children}

    def exited(self) -> dict[str, int]:
        """The exit code of every started process that has ended, by role (a shared engine's liveness)."""
        current = {child.role: child for child in self._children}.values()  # a role started again: its newest
        return {child.role: code for child in current if (code := child.popen.poll()) is not None}

    def _child_env(self, extra: Mapping[str, str]) -> dict[str, str]:
        # Python children block-buffer a piped stdout: lines would be timestamped late and lost on a
        # crash. Unbuffered is only a default; the base environment or the spec may override it.
        env = {"PYTHONUNBUFFERED": "1", **self._base_env, **extra}
        env[CELL_ENV] = self._plan.cell_id
        return env

    # -- readiness ---------------------------------------------------------------------------------

    def wait_ready(self) -> ReadyResult:
        """Poll until every process is alive and all probes pass, or one dies, or the startup timeout.

        The timeout counts from spawning, so the whole startup fits the plan's budget.
        """
        if self._spawned_at is None:
            raise RuntimeError("Supervisor.wait_ready() called before start()")
        deadline = self._spawned_at + self._plan.startup_timeout_s
        # Each process's own probes first (in plan order), then the plan's: once a probe has passed it
        # is not asked again; a process dying later is still caught by the liveness check. Processes
        # that start after others are spawned once every started process's probes have passed.
        pending: list[tuple[_Child | None, HealthProbe]] = [
            (child, probe) for child in self._children for probe in child.spec.health
        ]
        deferred = [spec for spec in self._plan.processes if spec.start_after]
        plan_probes: list[tuple[_Child | None, HealthProbe]] = [(None, probe) for probe in self._plan.ready_probes]
        last_answer = "no answer yet"
        delay = _POLL_FIRST_S
        answered_since: float | None = None  # when the failing probe first got an HTTP answer (not ready)
        answered_probe: HealthProbe | None = None
        with loopback_client(_PROBE_TIMEOUT_S) as client:
            while True:
                dead = next((child for child in self._children if child.popen.poll() is not None), None)
                if dead is not None:
                    return self._died(dead)
                doomed = next((child for child in self._children if _fatal_due(child)), None)
                if doomed is not None:
                    return self._fatal(doomed)
                answer = _advance(client, pending, deadline)
                last_answer = answer or last_answer
                # A server that answers but is not ready yet is asked less often (see the module docstring).
                # The clock is per probe: the next probe's server has not been answering for as long.
                if answer is not None and answer.startswith("HTTP ") and pending:
                    if answered_since is None or answered_probe is not pending[0][1]:
                        answered_since, answered_probe = time.monotonic(), pending[0][1]
                else:
                    answered_since = None
                if not pending and deferred:
                    healthy = {child.role for child in self._children}
                    # Never empty: the first deferred process only waits on earlier roles, all started.
                    due = [spec for spec in deferred if healthy.issuperset(spec.start_after)]
                    for spec in due:
                        deferred.remove(spec)
                        self._spawn_owned(spec)
                        pending += [(self._children[-1], probe) for probe in spec.health]
                    continue
                if not pending and plan_probes:
                    pending, plan_probes = plan_probes, []
                    continue
                settling = next((c for c in self._children if c.settle.waiting(time.monotonic())), None)
                if not pending and settling is None:
                    return self._ready()
                if not pending:
                    time.sleep(_POLL_FIRST_S)  # every probe passed; a process still finishes what it logged
                    continue
                if time.monotonic() >= deadline:
                    return self._timed_out(*pending[0], last_answer)
                if answered_since is not None:
                    answering = time.monotonic() - answered_since
                    delay = min(max(_POLL_ANSWERED_FRACTION * answering, _POLL_MAX_S), _POLL_ANSWERED_S)
                time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
                delay = min(delay * _POLL_GROWTH, _POLL_MAX_S)

    def _died(self, child: _Child) -> ReadyResult:
        # The pump sees end-of-file once the process is gone (unless a child of it holds the pipe), so
        # joining it briefly lets the log tail include the process's last words.
        child.pump.join(timeout=1.0)
        code = child.popen.returncode
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        message = f"{child.role} {how} before it was ready"
        errors = self._errors(child)
        # The exception it logged says why; "killed by SIGKILL" alone hides it where an engine kills its own
        # process tree after a child failed (SGLang's launcher does).
        if (cause := _exception_line(errors)) is not None:
            message += f" ({cause})"
        return ReadyResult(False, "startup", message, self._elapsed(), _tail(child.log_path), errors)

    def _errors(self, first: _Child) -> str:
        """The error lines of every process, the one that failed first: a worker that died may have died of
        its peer (and when both die at once, which one is seen first is a race)."""
        ordered = [first, *(c for c in self._children if c is not first)]
        found = [(child, lines) for child in ordered if (lines := error_lines(child.log_path))]
        if len(found) == 1 and found[0][0] is first:
            return found[0][1]
        return "\n".join(f"==> {child.role} <==\n{lines}" for child, lines in found)

    def _fatal(self, child: _Child) -> ReadyResult:
        message = (
            f"{child.role} logged a fatal error and was still not ready {FATAL_GRACE_S:g} s later: {child.fatal.line}"
        )
        return ReadyResult(
            False, "startup", message, self._elapsed(), _tail(child.log_path), error_lines(child.log_path)
        )

    def _ready(self) -> ReadyResult:
        elapsed, budget = self._elapsed(), self._plan.startup_timeout_s
        warning = ""
        if budget > 0 and elapsed >= NEAR_TIMEOUT_FRACTION * budget:
            warning = (f"warning: ready at {elapsed:.1f} s of the {budget:g} s start-up timeout "
                       f"({max(0.0, budget - elapsed):.1f} s to spare) at {host_load()}: a slower start times out; "
                       "raise the case's startup_timeout_s or run fewer cells at once (-j)")  # fmt: skip
        return ReadyResult(True, None, "ready", elapsed, "", warning=warning)

    def _timed_out(self, owner: _Child | None, probe: HealthProbe, last_answer: str) -> ReadyResult:
        # The host's load, measured as it gave up: a start-up that needs 296 s at load 20 is not a broken one.
        message = (
            f"not ready after {self._plan.startup_timeout_s:g} s: {probe.url} "
            f"({owner.role if owner else 'cell'} probe) last answered: {last_answer}; at {host_load()}"
        )
        # A plan-level probe (e.g. the frontend's model list) may wait on any process: show them all.
        stuck = [owner] if owner is not None else self._children
        tails = [_tail(child.log_path) for child in stuck]
        errors = [error_lines(child.log_path) for child in self._children]  # the cause may be anywhere
        errors = [f"==> {child.role} <==\n{e}" for child, e in zip(self._children, errors, strict=True) if e]
        if owner is None:
            tails = [f"==> {child.role} <==\n{tail}" for child, tail in zip(stuck, tails, strict=True)]
        return ReadyResult(False, "timeout", message, self._elapsed(), "\n".join(tails), "\n".join(errors))

    def _elapsed(self) -> float:
        assert self._spawned_at is not None
        return time.monotonic() - self._spawned_at

    # -- teardown ----------------------------------------------------------------------------------

    @property
    def teardown_budget_s(self) -> float:
        """The longest a teardown waits before SIGKILL: per stage, the grace for exits and again for groups."""
        started = list(self._children)
        stages = 2 if any(child.spec.start_after for child in started) else 1
        return 2 * stages * self._plan.teardown_grace_s

    def kill_now(self) -> None:
        """SIGKILL every process of the cell at once, from any thread, without waiting for a teardown in
        progress (which then sees them gone and finishes, still sweeping and checking)."""
        for child in list(self._children):
            _signal_group(child.popen.pid, signal.SIGKILL)
        kill_cell_processes(self._plan.cell_id, timeout_s=_SWEEP_WAIT_S)

    def teardown(self) -> TeardownReport:
        """Stop everything the cell started and verify the host is clean. Idempotent and thread-safe."""
        with self._teardown_lock:
            if self._report is None:
                self._report = self._teardown()
            return self._report

    def _teardown(self) -> TeardownReport:
        started = time.monotonic()
        # Dependents stop before what they depend on: a Dynamo sidecar drains against its engine on
        # SIGTERM, and with the engine already gone it waits out its whole drain timeout instead.
        needed = {role for child in self._children for role in child.spec.start_after}
        stages = [[c for c in self._children if c.role not in needed], [c for c in self._children if c.role in needed]]
        for stage in (group for group in stages if group):
            for child in stage:
                _signal_group(child.popen.pid, signal.SIGTERM)
            _wait_exits(stage, self._plan.teardown_grace_s)
            _wait_until(functools.partial(_all_gone, stage), self._plan.teardown_grace_s)
        stubborn = [child for child in self._children if _group_alive(child)]
        for child in stubborn:
            _signal_group(child.popen.pid, signal.SIGKILL)
        exits = tuple(_reap(child, killed=child in stubborn) for child in self._children)
        # Whatever left its group (setsid, MPI daemons) is found by its tag. What is still finishing on its own
        # gets the grace the children got first: vllm-rs runs its Python engine in a process group of its own,
        # whose multiprocessing resource tracker outlives the engine by a second or two while it cleans up. Only
        # what is still there after the grace is killed and counted as escaped.
        escaped: tuple[int, ...] = ()
        if _let_finish(self._plan.cell_id, self._plan.teardown_grace_s):
            escaped = tuple(kill_cell_processes(self._plan.cell_id, timeout_s=_SWEEP_WAIT_S))
        # A child that could not be reaped counts even if its environment cannot be read. The sweep above
        # read every process's environment; when it found nothing (and every child was reaped) nothing of
        # the cell can be left to fork, so a second full scan would only cost time.
        unreaped = {exit_.pid for exit_ in exits if exit_.returncode is None}
        rescan = escaped or unreaped
        left = {proc.pid for proc in find_cell_processes(self._plan.cell_id)} if rescan else set()
        survivors = tuple(sorted(left | unreaped))
        busy = _busy_ports(self._plan.ports.values(), _PORT_RELEASE_S)
        for child in self._children:
            child.pump.join(timeout=_PUMP_JOIN_S)
        if self._watchdog is not None:
            self._watchdog.dismiss()
        return TeardownReport(
            duration_s=time.monotonic() - started,
            exits=exits,
            needed_sigkill=tuple(child.role for child in stubborn),
            escaped_pids=escaped,
            survivors=survivors,
            busy_ports=busy,
        )


class _Watchdog:
    """The runner's side of a cell's watchdog: the pipe's write end, and the process to reap."""

    def __init__(self, popen: subprocess.Popen[bytes], write_fd: int) -> None:
        self._popen, self._write_fd = popen, write_fd

    @classmethod
    def start(
        cls, cell_id: str, base_env: Mapping[str, str], engine: str = "", scratch: tuple[str, ...] = ()
    ) -> _Watchdog | None:
        from matrix.launch import watchdog

        read_fd, write_fd = os.pipe()  # not inheritable: no other child of the runner holds the write end
        env = {k: v for k, v in base_env.items() if k != CELL_ENV}  # never part of the cell it watches
        try:
            popen = subprocess.Popen(
                [sys.executable, "-I", watchdog.__file__, *watchdog.watchdog_argv(read_fd, cell_id, engine, scratch)],
                pass_fds=(read_fd,), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        except OSError:
            os.close(write_fd)
            return None  # no watchdog: a killed runner's pair waits for the next run's recovery, as before
        finally:
            os.close(read_fd)
        return cls(popen, write_fd)

    def dismiss(self) -> None:
        """Teardown is done: tell the watchdog to leave without killing, and reap it."""
        with contextlib.suppress(OSError):
            os.write(self._write_fd, watchdog_done())
        with contextlib.suppress(OSError):
            os.close(self._write_fd)
        # The watchdog is not part of the cell (no MATRIX_CELL_ID, its own session): the cell's teardown
        # need not wait for an interpreter to exit. A daemon thread reaps it.
        if self._popen.poll() is None:
            threading.Thread(target=self._reap, name="watchdog-reap", daemon=True).start()

    def _reap(self) -> None:
        try:
            self._popen.wait(timeout=_REAP_S)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait()


def watchdog_done() -> bytes:
    from matrix.launch.watchdog import DONE

    return DONE


def find_cell_processes(cell_id: str) -> list[psutil.Process]:
    """Every live process (zombies excluded) whose environment carries `MATRIX_CELL_ID=cell_id`.

    Processes of other users cannot be inspected and are skipped; the runner never starts such.
    """
    found = []
    for pid in candidates(CELL_ENV, cell_id):
        try:
            proc = psutil.Process(pid)
            if environ_value(pid, CELL_ENV) == cell_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def _let_finish(cell_id: str, grace_s: float) -> bool:
    """Wait up to `grace_s` for the cell's tagged processes that are still alive to end by themselves; whether
    there were any (then the caller sweeps again: one may have started another meanwhile)."""
    left = find_cell_processes(cell_id)
    if left:
        _wait_until(lambda: not any(_is_alive(proc) for proc in left), grace_s)
    return bool(left)


def kill_cell_processes(cell_id: str, timeout_s: float = 5.0) -> list[int]:
    """SIGKILL every process of the cell, wait up to `timeout_s` for them to go; return their pids."""
    killed: list[psutil.Process] = []
    for proc in find_cell_processes(cell_id):
        try:
            proc.kill()  # psutil checks the pid still names the same process before signalling
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        killed.append(proc)
    _wait_until(lambda: not any(_is_alive(proc) for proc in killed), timeout_s)
    return [proc.pid for proc in killed]


# -- helpers ---------------------------------------------------------------------------------------


def _timestamp() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _write_line(sink: IO[bytes], text: str) -> None:
    sink.write(f"{_timestamp()} {text}\n".encode())
    sink.flush()


def _pump(source: IO[bytes], sink: IO[bytes], see: Callable[[bytes], None] | None = None) -> None:
    """Copy a process's output to its log, one timestamped line at a time, until end-of-file."""
    with source, sink:
        for line in iter(lambda: source.readline(_MAX_LINE_BYTES), b""):
            sink.write(_timestamp().encode() + b" " + line.rstrip(b"\n") + b"\n")
            sink.flush()  # so a log tail read while the process runs is current
            if see is not None:
                see(line)


def _fatal_due(child: _Child) -> bool:
    at = child.fatal.at
    return at is not None and time.monotonic() - at >= FATAL_GRACE_S


# A start-up that used this much of its budget is ready only just: its outcome carries a warning.
NEAR_TIMEOUT_FRACTION = 0.9


def host_load() -> str:
    """`host load 20.3 (1-min average) on 2 CPUs`: what a slow start-up ran against."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return "host load unknown"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return f"host load {load:.1f} (1-min average) on {cpus} CPU{'s' if cpus != 1 else ''}"


def error_lines(path: Path, limit: int = ERROR_LINES) -> str:
    """The first `limit` error lines of the whole log (and how many more there were), for a failure message.

    A process that logs its fatal error once and then one line per request (Dynamo's frontend answering
    probes) pushes the cause out of any tail; these lines keep it. Long lines are cut.
    """
    found: list[str] = []
    more = 0
    try:
        with path.open("rb") as handle:
            for number, line in enumerate(iter(lambda: handle.readline(_MAX_LINE_BYTES + 64), b"")):
                if handle.tell() > _ERROR_SCAN_BYTES:
                    break
                if not ERROR_LINE.search(line) or line.find(b" [matrix] ") in range(0, 40):
                    continue
                if len(found) < limit:
                    text = line.decode("utf-8", errors="replace").rstrip()
                    found.append(f"line {number + 1}: {excerpt(text, _ERROR_LINE_CHARS)}")
                else:
                    more += 1
    except OSError:
        return ""
    return "\n".join(found) + (f"\n... and {more} more error line(s)" if more else "")


_EXCEPTION = re.compile(r"\b([A-Z]\w*(?:Error|Exception): .+)")


def _exception_line(errors: str) -> str | None:
    """The last Python exception line (`ValueError: ...`) among a failure's error lines, if any."""
    found = [m.group(1) for line in errors.splitlines() if (m := _EXCEPTION.search(line))]
    return excerpt(found[-1], 300) if found else None


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, path.stat().st_size - _TAIL_BYTES))
            data = handle.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])


def _advance(client: httpx.Client, pending: list[tuple[_Child | None, HealthProbe]], deadline: float) -> str | None:
    """Drop passing probes from the front of `pending`; return the first failing one's answer."""
    while pending:
        timeout = min(_PROBE_TIMEOUT_S, max(0.01, deadline - time.monotonic()))
        failure = _probe(client, pending[0][1], timeout)
        if failure is not None:
            return failure
        pending.pop(0)
    return None


def _probe(client: httpx.Client, probe: HealthProbe, timeout: float) -> str | None:
    """None if the probe passes, else what it got instead (for the timeout message)."""
    try:
        response = client.get(probe.url, timeout=timeout)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if response.status_code != 200:
        return f"HTTP {response.status_code}"
    if probe.require_models and not _lists_models(response):
        return "HTTP 200 without models"
    missing = _missing_endpoints(response, probe.require_endpoints)
    if missing:
        return f"HTTP 200 without endpoints {', '.join(missing)}"
    return None


def _missing_endpoints(response: httpx.Response, wanted: tuple[str, ...]) -> list[str]:
    if not wanted:
        return []
    try:
        body: Any = response.json()
    except ValueError:
        return list(wanted)
    listed = body.get("endpoints") if isinstance(body, dict) else None
    names = [str(e) for e in listed] if isinstance(listed, list) else []
    # Dynamo lists an endpoint once however many workers serve it; its `instances` name one per worker, so
    # they count the workers of a topology (two decode workers: two ".generate" instances of one endpoint).
    instances = body.get("instances") if isinstance(body, dict) else None
    if isinstance(instances, list) and instances:
        names = [f"{i.get('namespace')}.{i.get('component')}.{i.get('endpoint')}" for i in instances
                 if isinstance(i, dict)]  # fmt: skip
    # Each wanted suffix needs an endpoint of its own: (".generate", ".generate") means two workers.
    missing = []
    for suffix in wanted:
        match = next((name for name in names if name.endswith(suffix)), None)
        if match is None:
            missing.append(suffix)
        else:
            names.remove(match)
    return missing


def _lists_models(response: httpx.Response) -> bool:
    try:
        body: Any = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("data"), list) and len(body["data"]) > 0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `done` with the readiness back-off until it holds or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    delay = _POLL_FIRST_S
    while not done():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * _POLL_GROWTH, _POLL_MAX_S)
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    # Each child leads its own session, so its pid is its process group id. A missing group is gone
    # already; a member that changed user cannot be signalled and will be reported by the sweep.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait_exits(children: list[_Child], timeout_s: float) -> None:
    """Block until every child process has exited or `timeout_s` passes, woken by the exits themselves.

    A pidfd becomes readable the moment its process exits, so a stage's teardown is noticed at once rather
    than at the next tick of a back-off (which cost up to 50 ms per stage). Where pidfds are unavailable,
    the caller's polling does the waiting.
    """
    fds: list[int] = []
    try:
        for child in children:
            if child.popen.poll() is None:
                with contextlib.suppress(OSError, AttributeError):
                    fds.append(os.pidfd_open(child.popen.pid))
        deadline = time.monotonic() + timeout_s
        waiting = set(fds)
        while waiting and (remaining := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select(list(waiting), [], [], remaining)
            waiting -= set(readable)
    finally:
        for fd in fds:
            os.close(fd)


def _all_gone(children: list[_Child]) -> bool:
    return not any(_group_alive(child) for child in children)


def _group_alive(child: _Child) -> bool:
    """Whether the child or any non-zombie member of its process group is still running."""
    if child.popen.poll() is None:
        return True
    pgid = child.popen.pid
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Only zombies may be left: orphans wait for init to reap them, forever if this runner is init.
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue
    return False


def _kernel_state(pid: int) -> str:
    """What a process that does not die is doing, from /proc (its state and the kernel function it waits in)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    state = next((line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("State:")), "?")
    return f"state {state}" + (f", in {wchan}" if wchan not in ("", "0") else "")


def _reap(child: _Child, *, killed: bool) -> ProcessExit:
    try:
        code: int | None = child.popen.wait(timeout=_REAP_S)
    except subprocess.TimeoutExpired:
        code = None  # stuck in the kernel (e.g. a hung GPU driver call): reported as a survivor
    return ProcessExit(child.role, child.popen.pid, code, killed)


def _is_alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def _busy_ports(ports: Iterable[int], timeout_s: float) -> tuple[int, ...]:
    """Ports that still have a listener after `timeout_s` (closing sockets may linger a moment)."""
    busy = sorted(set(ports))

    def all_free() -> bool:
        busy[:] = [port for port in busy if not port_is_free(port, reuse_addr=True)]
        return not busy

    _wait_until(all_free, timeout_s)
    return tuple(busy)
