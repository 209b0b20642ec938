"""Cells as Ray tasks: each asks Ray for the cell's GPUs, so Ray's CUDA_VISIBLE_DEVICES pins the pair.

The driver (this process) keeps the scheduler, the claims and every database write; a task runs
`remote.run_remote_cell` on whichever node Ray picks and returns the outcome with a capped copy of the
logs. Cancelling sends the running tasks a KeyboardInterrupt (Ray's non-forced cancel), on which the
cell tears its pair down; a task still running FORCE_CANCEL_AFTER_S later (the interrupt can wait on a
blocking call) is cancelled by force and every node swept, so a stopped run always ends. A task whose
worker or node died comes back `interrupted` (retried under the retry policy) after a sweep of every node
for processes still carrying its cell id.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from matrix import __version__
from matrix.errors import ConfigError
from matrix.executors.remote import RemoteResult, run_remote_cell, write_logs
from matrix.hardware.gpus import Gpu
from matrix.launch.supervisor import kill_cell_processes
from matrix.outcome import CellOutcome, error, interruption
from matrix.schedule.executor import Submission

INSTALL_HINT = "install it with: pip install 'disagg-matrix[ray]'"
# Stand-ins for the cluster's GPUs in the driver's slot pool: they only count; Ray picks the device.
_VIRTUAL_GPU_BYTES = 2**50
_SWEEP_TIMEOUT_S = 30.0
_CONNECT_TIMEOUT_S = 5.0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--executor ray needs the `ray` package, which is not installed; {INSTALL_HINT}") from None
    return ray


def _task(cell: Any, uid: str, driver_version: str, workspace: str | None) -> RemoteResult:
    import ray

    gpu_ids = [str(gpu) for gpu in ray.get_gpu_ids()]
    return run_remote_cell(cell, uid, driver_version, gpu_ids, workspace)


def _check_reachable(address: str) -> None:
    """Fail fast on a HOST:PORT nobody listens on: Ray itself retries for minutes before giving up."""
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray-address {address!r} is not auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConfigError(
            f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}. Start one there with "
            "`ray start --head --port PORT`, or leave --ray-address out to start a local cluster"
        ) from None


# How long a cancelled task may take to tear its pair down before its worker is killed (the teardown of one
# pair takes seconds; its grace periods are bounded by the case).
FORCE_CANCEL_AFTER_S = 30.0


def _sweep(uid: str) -> list[int]:
    return kill_cell_processes(uid)


class RayExecutor:
    name = "ray"

    def __init__(self, address: str | None, *, workspace: Path | None = None) -> None:
        """Connect to the cluster at `address` ("auto", HOST:PORT, ray://...) or start a local one (None)."""
        ray = _import_ray()
        self._ray = ray
        self._workspace = str(workspace) if workspace else None
        self._lock = threading.Lock()
        self._running: dict[str, Any] = {}  # uid -> ObjectRef
        self._results: list[Future[CellOutcome]] = []
        self._cancelled = False
        self._forced: set[str] = set()  # uids whose task was cancelled by force
        # Ray resolves futures on its own threads, which must not block (a sweep waits on other tasks):
        # outcomes are turned into rows' material on this pool instead.
        self._landing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ray-landing")
        options: dict[str, Any] = {
            "include_dashboard": False,
            "log_to_driver": False,  # cell output comes back with the outcome, never interleaved with ours
            "logging_level": logging.WARNING,
            "configure_logging": False,
        }
        if address not in (None, "auto"):
            _check_reachable(address)
        try:
            # "local" always starts a fresh cluster, never attaches to one that happens to run here.
            ray.init(address=address or "local", **options)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
            raise ConfigError(
                f"cannot connect to {where}: {str(exc).splitlines()[0]}. Start one with `ray start --head`, "
                "or pass --ray-address HOST:PORT (or leave it out to start a local cluster)"
            ) from None
        self._remote = ray.remote(_task)
        self._remote_sweep = ray.remote(_sweep)

    # --- what the driver needs to plan ---------------------------------------------------------------

    def cluster(self) -> tuple[tuple[Gpu, ...], int, int]:
        """(virtual GPUs, CPUs, most GPUs on one node) of the alive nodes, for the driver's slot pool."""
        gpus = cpus = per_node = 0
        for node in self._ray.nodes():
            if not node.get("Alive"):
                continue
            resources = node.get("Resources", {})
            gpus += int(resources.get("GPU", 0))
            cpus += int(resources.get("CPU", 0))
            per_node = max(per_node, int(resources.get("GPU", 0)))
        virtual = tuple(Gpu(i, f"ray-gpu-{i}", "Ray cluster GPU", _VIRTUAL_GPU_BYTES, 0) for i in range(gpus))
        return virtual, cpus, per_node

    # --- CellExecutor --------------------------------------------------------------------------------

    def submit(self, submission: Submission) -> Future[CellOutcome]:
        result: Future[CellOutcome] = Future()
        with self._lock:
            self._results.append(result)
            if self._cancelled:
                result.set_result(interruption("cancelled before it started"))
                return result
            task = self._remote.options(
                num_gpus=len(submission.lease.gpu_indices),
                num_cpus=1,
                max_retries=0,  # the scheduler's retry policy decides, and records every attempt
                name=f"matrix {submission.cell.key} {submission.uid}",
            )
            ref = task.remote(submission.cell, submission.uid, __version__, self._workspace)
            self._running[submission.uid] = ref
        ref.future().add_done_callback(lambda done: self._landing.submit(self._land, submission, done, result))
        return result

    def cancel_all(self) -> None:
        with self._lock:
            self._cancelled = True
            running = dict(self._running)
        for ref in running.values():
            # A task that finished meanwhile cannot be cancelled, which is fine: its outcome is on the way.
            with contextlib.suppress(Exception):
                self._ray.cancel(ref, force=False)
        if running:
            timer = threading.Timer(FORCE_CANCEL_AFTER_S, self._force_cancel, args=(list(running),))
            timer.daemon = True
            timer.start()

    def stopping(self) -> list[tuple[str, float]]:
        """Cancelled tasks still running; Ray force-cancels them FORCE_CANCEL_AFTER_S after the cancel."""
        with self._lock:
            return [(uid, FORCE_CANCEL_AFTER_S) for uid in self._running] if self._cancelled else []

    def kill_all(self) -> None:
        with self._lock:
            running = list(self._running)
        self._force_cancel(running)

    def _force_cancel(self, uids: list[str]) -> None:
        """Kill the workers of cancelled tasks that are still running; their outcomes sweep the nodes."""
        with self._lock:
            left = {uid: self._running[uid] for uid in uids if uid in self._running}
            self._forced.update(left)
        for ref in left.values():
            with contextlib.suppress(Exception):
                self._ray.cancel(ref, force=True)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def shutdown(self) -> None:
        for result in list(self._results):
            result.exception()  # waits; `_land` always resolves it
        self._landing.shutdown(wait=True)
        self._ray.shutdown()  # stops a cluster this process started, else just disconnects

    # --- outcome handling (runs on a Ray thread) -----------------------------------------------------

    def _land(self, submission: Submission, done: Future[RemoteResult], result: Future[CellOutcome]) -> None:
        try:
            outcome = self._outcome(submission, done)
        except Exception as exc:  # the scheduler must always get an outcome
            outcome = error("infra", f"internal error collecting the outcome: {exc!r}")
        with self._lock:
            self._running.pop(submission.uid, None)
        result.set_result(replace(outcome, log_dir=str(submission.log_dir)))

    def _outcome(self, submission: Submission, done: Future[RemoteResult]) -> CellOutcome:
        exceptions = self._ray.exceptions
        try:
            remote = done.result()
        except exceptions.TaskCancelledError:
            if submission.uid in self._forced:  # its worker was killed mid-teardown: what it left must go
                swept = self._sweep_everywhere(submission.uid)
                note = f"; killed {swept} leftover process(es)" if swept else ""
                return interruption(f"cancelled by force after {FORCE_CANCEL_AFTER_S:g} s{note}")
            return interruption("cancelled before it started on a Ray node")
        except exceptions.RayTaskError as exc:  # our code raised on the worker: a bug, keep its traceback
            return error("infra", f"internal error on a Ray worker: {exc}")
        except (exceptions.RayError, OSError) as exc:  # worker or node lost: what the pair left must go
            swept = self._sweep_everywhere(submission.uid)
            note = f"; killed {swept} leftover process(es)" if swept else ""
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return interruption(f"Ray lost the cell's worker or node: {first}{note}")
        write_logs(submission.log_dir, remote.logs, remote.truncated)
        return remote.outcome

    def _sweep_everywhere(self, uid: str) -> int:
        """Kill processes carrying `uid` on every alive node (the task's node is not known any more)."""
        strategies = self._ray.util.scheduling_strategies
        refs = [
            self._remote_sweep.options(
                num_cpus=0,
                scheduling_strategy=strategies.NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
            ).remote(uid)
            for node in self._ray.nodes()
            if node.get("Alive")
        ]
        ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=_SWEEP_TIMEOUT_S)
        killed = 0
        for ref in ready:
            try:
                killed += len(self._ray.get(ref))
            except self._ray.exceptions.RayError:
                continue
        return killed
