"""The `container` provider: every process of a pair runs in its own container of the runtime's image.

Each process becomes ``docker run`` (or ``podman run``) of the image with the process's argv. The
containers share the host's network (the pair talks over loopback ports the runner allocated), see only
the cell's GPUs, get a large /dev/shm (NIXL fails with Docker's 64 MiB default), mount
the cell's work directory at the same path, and carry the cell id as a name and a label, so a container
left behind by a runner that was killed can be found and removed (`leftover_argv`, `remove_cell_containers`).

The argv builders are pure; only `engine_problem` and `remove_cell_containers` run anything.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from matrix.cells import CaseInfo, RuntimeInfo
from matrix.errors import ConfigError
from matrix.launch.launch_plan import LaunchPlan, ProcessSpec
from matrix.launch.providers.base import ContainerSpec, Environment, Mismatch, Unavailable

INFO_TIMEOUT_S = 5.0
# `docker info` costs a round trip to the daemon; every cell of a campaign asks, so answers are kept a while.
STATUS_TTL_S = 30.0
CELL_LABEL = "matrix.cell"
ROLE_LABEL = "matrix.role"
# /dev/shm for engines that move KV blocks through shared memory (upstream's containers use 10 GiB).
DEFAULT_SHM_GIB: Mapping[str, float] = {"trtllm": 10.0}

_status: dict[str, tuple[float, str | None]] = {}
_status_lock = threading.Lock()
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]")


def default_engine() -> str | None:
    """The first container engine on PATH (docker, then podman)."""
    from matrix.launch.providers.recipe import CONTAINER_ENGINES  # see `matrix.launch.providers`

    return next((engine for engine in CONTAINER_ENGINES if shutil.which(engine)), None)


def _first_error_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "cannot" in line.lower()]
    return (errors or lines or ["no output"])[-1][:300]


def engine_problem(engine: str, *, use_cache: bool = True) -> str | None:
    """Why `engine` cannot run containers here (None when `ENGINE info` answers within 5 s)."""
    now = time.monotonic()
    if use_cache:
        with _status_lock:
            cached = _status.get(engine)
        if cached is not None and now - cached[0] < STATUS_TTL_S:
            return cached[1]
    problem = _ask_engine(engine)
    with _status_lock:
        _status[engine] = (now, problem)
    return problem


def _ask_engine(engine: str) -> str | None:
    path = shutil.which(engine)
    if path is None:
        return f"container engine {engine} is not installed on this host"
    not_running = f"container engine {engine} is not running on this host"
    try:
        done = subprocess.run(
            [path, "info"], capture_output=True, text=True, timeout=INFO_TIMEOUT_S, check=False,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"{not_running} ({engine} info timed out after {INFO_TIMEOUT_S:g} s)"
    except OSError as exc:
        return f"{not_running} ({engine} info could not run: {exc})"
    if done.returncode != 0:
        return f"{not_running} ({engine} info failed: {_first_error_line(done.stderr or done.stdout)})"
    return None


def prepare_container(runtime: RuntimeInfo) -> Environment | Unavailable:
    """The image's environment when its engine runs here. Components are not looked up: that needs a
    container of the image, so none are reported as found."""
    from matrix.launch.providers.recipe import parse_container  # see `matrix.launch.providers`

    try:
        config = parse_container(runtime.provider, runtime.label)
    except ConfigError as exc:
        return Mismatch(str(exc))
    engine = config.engine or default_engine()
    if engine is None:
        return Unavailable(f"no container engine (docker or podman) on this host for runtime {runtime.label}")
    problem = engine_problem(engine)
    if problem is not None:
        return Unavailable(problem)
    spec = ContainerSpec(image=config.image, engine=engine, ipc_host=config.ipc_host)
    return Environment(python=config.python, env=dict(config.env), components={}, container=spec)


def shm_gib_for(case: CaseInfo, runtime: RuntimeInfo) -> float | None:
    """Size of the shared-memory mount in GiB: the case's ``launch.shm_gib``, else the engine's default
    (trtllm: 10 GiB), else None (the container engine's own default)."""
    value = case.launch.get("shm_gib")
    if value is not None:
        return float(value)
    engine = str(case.launch.get("engine", runtime.backend))
    return DEFAULT_SHM_GIB.get(engine, DEFAULT_SHM_GIB.get(runtime.backend))


def container_name(cell_id: str, role: str) -> str:
    """`matrix-<cell id>-<role>`, with characters container names do not allow replaced by `-`."""
    return _NAME_UNSAFE.sub("-", f"matrix-{cell_id}-{role}")


def _gpu_args(engine: str, gpu_ids: Sequence[str]) -> list[str]:
    if not gpu_ids:
        return []
    if engine == "podman":
        # Podman reaches NVIDIA GPUs through CDI device names.
        return [arg for gpu in gpu_ids for arg in ("--device", f"nvidia.com/gpu={gpu}")]
    devices = ",".join(gpu_ids)
    # Docker splits --gpus on commas unless the device list is quoted inside the value.
    return ["--gpus", f'"device={devices}"' if len(gpu_ids) > 1 else f"device={devices}"]


def container_argv(
    spec: ContainerSpec,
    *,
    cell_id: str,
    role: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    gpu_ids: Sequence[str] = (),
    shm_gib: float | None = None,
    workspace: Path | None = None,
    workdir: str | None = None,
    read_only_mounts: Sequence[str] = (),
) -> list[str]:
    """``docker run ... IMAGE ARGV`` for one process of a cell (pure).

    Inside the container the GPUs given by `gpu_ids` (host NVML indices) are numbered from 0, so
    CUDA_VISIBLE_DEVICES is rewritten to match; MATRIX_CELL_ID is set so the supervisor's sweep by cell id
    also finds the container's processes.
    """
    run = [spec.engine, "run", "--rm", "--init", "--network", "host"]
    run += ["--name", container_name(cell_id, role)]
    run += ["--label", f"{CELL_LABEL}={cell_id}", "--label", f"{ROLE_LABEL}={role}"]
    if spec.ipc_host:
        run += ["--ipc", "host"]  # the host's /dev/shm: no --shm-size then
    elif shm_gib is not None:
        run += ["--shm-size", f"{max(1, round(shm_gib * 1024))}m"]
    run += _gpu_args(spec.engine, gpu_ids)
    if workspace is not None:
        run += ["-v", f"{workspace}:{workspace}"]
    for mount in read_only_mounts:
        run += ["-v", f"{mount}:{mount}:ro"]
    if workdir or workspace is not None:
        run += ["-w", str(workdir or workspace)]
    inside = {**env, "MATRIX_CELL_ID": cell_id}
    if "CUDA_VISIBLE_DEVICES" in inside or gpu_ids:
        inside["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(gpu_ids)))
    for key in sorted(inside):
        run += ["-e", f"{key}={inside[key]}"]
    return [*run, *spec.extra_args, spec.image, *argv]


def wrap_plan(
    environment: Environment, plan: LaunchPlan, *, case: CaseInfo, runtime: RuntimeInfo, workspace: Path
) -> LaunchPlan:
    """Run every process of `plan` inside the runtime's image; the plan itself when not a container."""
    spec = environment.container
    if spec is None:
        return plan
    shm = shm_gib_for(case, runtime)
    mounts = [case.source_dir] if case.source_dir else []

    def wrap(process: ProcessSpec) -> ProcessSpec:
        """The same process, started by the container engine instead of directly."""
        argv = container_argv(
            spec, cell_id=plan.cell_id, role=process.role, argv=process.argv, env=process.env,
            gpu_ids=plan.gpu_ids, shm_gib=shm, workspace=workspace, workdir=process.cwd, read_only_mounts=mounts,
        )  # fmt: skip
        return replace(process, argv=tuple(argv))

    return replace(plan, processes=tuple(wrap(p) for p in plan.processes))


def leftover_argv(engine: str, cell_id: str | None = None) -> list[str]:
    """List the ids of containers of one cell (or of every cell) that still exist."""
    label = f"{CELL_LABEL}={cell_id}" if cell_id else CELL_LABEL
    return [engine, "ps", "--all", "--quiet", "--filter", f"label={label}"]


def remove_cell_containers(environment: Environment, cell_id: str) -> list[str]:
    """Force-remove every container of the cell that survived teardown (best effort); their ids."""
    spec = environment.container
    if spec is None:
        return []
    try:
        listed = subprocess.run(
            leftover_argv(spec.engine, cell_id), capture_output=True, text=True, timeout=30, check=False
        )
        ids = listed.stdout.split()
        if ids:
            subprocess.run([spec.engine, "rm", "--force", *ids], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return ids
