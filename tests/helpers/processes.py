"""Process assertions: a cell's processes found by its uid, nothing left behind, a graceful stop."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from matrix.hardware.ports import port_is_free
from matrix.launch.procenv import environ_value

if TYPE_CHECKING:  # the CLI helper imports this module
    from tests.helpers.cli import Matrix


def stop_gracefully(proc: subprocess.Popen[str], grace: float = 60) -> None:
    """SIGTERM, time to tear down, then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def assert_nothing_left(m: Matrix, uid: str) -> None:
    assert cell_processes(uid) == [], f"processes of {uid} survived"
    ports_json, started, finished = m.sql("SELECT ports, started_at, finished_at FROM cell_run WHERE uid = ?", uid)[0]
    ports = ports_json if isinstance(ports_json, dict) else json.loads(str(ports_json))  # PostgreSQL decodes JSON
    lifetime = (_epoch(started), _epoch(finished)) if started is not None and finished is not None else None
    for port in ports.values():
        held = port_still_held(int(port), uid, lifetime=lifetime)
        assert not held, f"port {port} of {uid} (alive {lifetime}) still in use: {listeners_of(int(port))}"


def listeners_of(port: int) -> list[str]:
    """Who listens on `port`, for a failure message: pid, name, cell id and creation time."""
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            try:
                process = psutil.Process(conn.pid) if conn.pid else None
                cell = environ_value(process.pid, "MATRIX_CELL_ID") if process else None
                found.append(f"pid {conn.pid} {process.name() if process else '?'} cell={cell} "
                             f"created={process.create_time() if process else '?'}")  # fmt: skip
            except psutil.Error as exc:
                found.append(f"pid {conn.pid}: {exc}")
    return found


def _epoch(value: object) -> float:
    """A timestamp column as seconds since the epoch (SQLite gives naive UTC text, PostgreSQL a datetime)."""
    moment = value if isinstance(value, dt.datetime) else dt.datetime.fromisoformat(str(value))
    return (moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)).timestamp()


def port_still_held(port: int, *uids: str, lifetime: tuple[float, float] | None = None) -> bool:
    """Whether something the cells `uids` may have left still listens on `port`.

    Test workers run cells side by side, so once a cell has released a port another worker's cell may be
    handed it and listen there: a listener tagged with another cell's id is not a leftover. Neither is one
    whose process was created outside the cells' `lifetime` (start, end; seconds since the epoch), as
    nothing the cells started can be older or younger than they are: a released port once failed a test
    this way, taken by an untagged server of another test (Ray's daemons, for one, pick their own ports).
    Any other untagged listener, or one whose owner cannot be read, is counted as held (the strict reading).
    """
    if port_is_free(port, reuse_addr=True):
        return False
    listeners = 0
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or not conn.laddr or conn.laddr.port != port:
            continue
        listeners += 1
        try:
            process = psutil.Process(conn.pid) if conn.pid else None
            owner = environ_value(process.pid, "MATRIX_CELL_ID") if process else None
            born = process.create_time() if process else None
        except psutil.Error:
            owner = born = None
        outside = lifetime is not None and born is not None and not lifetime[0] - 1 <= born <= lifetime[1] + 1
        if owner in uids or (owner is None and not outside):
            return True
    if listeners:
        return False  # every listener belongs to another cell
    # No listener: a bound socket that does not listen, or one that closed since the bind failed: look again.
    return not port_is_free(port, reuse_addr=True)


def cell_processes(uid: str) -> list[psutil.Process]:
    """Live processes tagged with the cell's id, read as the sweeps read it (`environ_value`: vLLM's renamed
    engine cores and workers show psutil an empty environment)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if environ_value(proc.pid, "MATRIX_CELL_ID") == uid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def home_cell_processes(home: Path) -> list[psutil.Process]:
    """Processes of the cells of one data directory: they carry a MATRIX_CELL_ID and that MATRIX_HOME, or run
    in a directory under it (a process renamed by setproctitle may have lost MATRIX_HOME from the start of
    its environment block, never its working directory), so a test never counts another test's cells."""
    found = []
    for proc in psutil.process_iter():
        try:
            if not environ_value(proc.pid, "MATRIX_CELL_ID") or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            ours = environ_value(proc.pid, "MATRIX_HOME") == str(home) or Path(proc.cwd()).is_relative_to(home)
            if ours:
                found.append(proc)
        except psutil.Error:
            continue
    return found
