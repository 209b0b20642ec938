"""The body of a Ray task: run one cell on the node Ray chose, on the GPUs Ray assigned.

This module does not import Ray, so it can be exercised without a cluster; `ray_cluster` wraps it in a
task. It is the same `run_cell` the local executor calls: only where logs live and who reads NVML differ.
The worker never touches the database; the outcome and a capped copy of the logs go back to the driver.
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from matrix import __version__
from matrix.cells import Cell
from matrix.executors.local import wait_for_baseline
from matrix.hardware.gpus import Gpu, inventory, memory_used
from matrix.hardware.ports import PortAllocator
from matrix.launch.supervisor import kill_cell_processes
from matrix.outcome import CellOutcome, error, interruption
from matrix.paths import port_registry_path
from matrix.runner import LiveCells, Resources, run_cell

# What of a remote cell's logs travels back: the tail of each file, and at most this much in all.
LOG_FILE_CAP_BYTES = 256 * 1024
LOG_TOTAL_CAP_BYTES = 4 * 1024 * 1024
# In each remote cell's scratch directory: the task process that owns it (pid and start time, so a reused
# pid does not pass for the owner).
SCRATCH_OWNER = "matrix-owner.json"


@dataclass(frozen=True)
class RemoteResult:
    outcome: CellOutcome
    node: str
    # Relative path inside the cell's log directory -> content (the tail when the file was larger).
    logs: dict[str, bytes] = field(default_factory=dict)
    truncated: tuple[str, ...] = ()


def run_remote_cell(
    cell: Cell, uid: str, driver_version: str, gpu_ids: Sequence[str], workspace: str | None = None
) -> RemoteResult:
    node = socket.gethostname()
    if driver_version != __version__:
        message = (
            f"node {node} has matrix {__version__}, the driver has {driver_version}: "
            "install the same matrix version on every Ray node"
        )
        return RemoteResult(error("config", message), node)
    from matrix.launch.providers import ensure_provisioned

    # Every role's runtime (a skew cell runs several): a failed build makes run_cell skip the cell.
    ensure_provisioned(list(cell.runtimes), lambda _line: None)
    sweep_orphan_scratch()
    scratch = _scratch(uid)
    log_dir = scratch / "logs"
    indices = [int(gpu) for gpu in gpu_ids if gpu.isdigit()]
    baseline = {index: memory_used(index) for index in indices}
    node_gpus = {gpu.index: gpu for gpu in inventory()}
    resources = Resources(
        gpu_ids=tuple(gpu_ids),
        host_gpus=len(node_gpus) or len(gpu_ids),
        workspace=Path(workspace) if workspace else None,
    )
    try:
        try:
            outcome = run_cell(cell, uid, log_dir, PortAllocator(port_registry_path()), resources, LiveCells())
        except KeyboardInterrupt:
            # Ray cancels a running task with KeyboardInterrupt; run_cell has torn the pair down on the way out.
            outcome = interruption(f"cancelled on node {node}; the pair was torn down")
        finally:
            kill_cell_processes(uid)  # a last sweep by MATRIX_CELL_ID, whatever happened above
        if indices:
            after = {str(i): wait_for_baseline(i, before) for i, before in baseline.items() if before is not None}
            gpu = {**outcome.gpu, "node": node, "ray_gpu_ids": list(gpu_ids), "baseline": baseline,
                   "memory_used_after": after, **_gpu_names(indices, node_gpus)}  # fmt: skip
            outcome = replace(outcome, gpu=gpu)
        logs, truncated = collect_logs(log_dir)
        return RemoteResult(replace(outcome, log_dir=""), node, logs, truncated)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _scratch(uid: str) -> Path:
    scratch = Path(tempfile.mkdtemp(prefix=f"matrix-{uid}-"))
    me = psutil.Process()
    (scratch / SCRATCH_OWNER).write_text(json.dumps({"pid": me.pid, "started": me.create_time()}))
    return scratch


def sweep_orphan_scratch(root: Path | None = None) -> list[Path]:
    """Remove the scratch directories of remote cells whose task process is gone: a Ray worker killed
    mid-cell (SIGKILL, the node's OOM killer) never reaches the `finally` that removes its own. Run before each
    remote cell on the node; a directory without a readable owner file is not matrix's to remove."""
    removed = []
    for owner in (root or Path(tempfile.gettempdir())).glob(f"matrix-*-*/{SCRATCH_OWNER}"):
        try:
            entry = json.loads(owner.read_text())
            pid, started = int(entry["pid"]), float(entry["started"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not _alive(pid, started):
            shutil.rmtree(owner.parent, ignore_errors=True)
            removed.append(owner.parent)
    return removed


def _alive(pid: int, started: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # not ours to judge (another user's process): leave its directory


def _gpu_names(indices: list[int], gpus: dict[int, Gpu]) -> dict[str, object]:
    return {
        "indices": indices,
        "uuids": [gpus[i].uuid for i in indices if i in gpus],
        "names": [gpus[i].name for i in indices if i in gpus],
    }


def collect_logs(log_dir: Path) -> tuple[dict[str, bytes], tuple[str, ...]]:
    """Every file under `log_dir`, each cut to its tail, newest content kept within the total cap."""
    logs: dict[str, bytes] = {}
    truncated: list[str] = []
    budget = LOG_TOTAL_CAP_BYTES
    if not log_dir.is_dir():
        return logs, ()
    for path in sorted(p for p in log_dir.rglob("*") if p.is_file() and not p.is_symlink()):
        relative = path.relative_to(log_dir).as_posix()
        size = path.stat().st_size
        keep = min(size, LOG_FILE_CAP_BYTES, budget)
        with path.open("rb") as handle:
            handle.seek(size - keep)
            logs[relative] = handle.read(keep)
        if keep < size:
            truncated.append(relative)
        budget -= keep
    return logs, tuple(truncated)


def write_logs(log_dir: Path, logs: dict[str, bytes], truncated: Sequence[str]) -> None:
    """Recreate a remote cell's logs on the driver's host, refusing paths that would leave `log_dir`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    root = log_dir.resolve()
    for relative, content in logs.items():
        target = (log_dir / relative).resolve()
        if root not in target.parents:
            continue  # a hostile or broken name: never write outside the cell's directory
        target.parent.mkdir(parents=True, exist_ok=True)
        prefix = b"[matrix: earlier output cut; this is the tail of the remote log]\n" if relative in truncated else b""
        target.write_bytes(prefix + content)
