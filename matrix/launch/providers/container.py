"""The `container` provider: every process of a pair runs in its own container of the runtime's image.

Each process becomes ``docker run`` (or ``podman run``) of the image with the process's argv. The
containers share the host's network (the pair talks over loopback ports the runner allocated), see only
the cell's GPUs, get a large /dev/shm (NIXL fails with Docker's 64 MiB default), mount
the cell's work directory at the same path, and carry the cell id as a name and a label, so a container
left behind by a runner that was killed can be found and removed (`leftover_argv`, `remove_cell_containers`).

Before a cell runs, `prepare_container` makes sure the image is here (a pull is tried once when it is
not) and checks the runtime's components *inside* the image, by one container of it running the same
distribution lookup the host provider uses plus `NAME --version` for executables: the tag says nothing
about what an image holds. The answer is kept per image id for the life of the process.

The argv builders are pure; `engine_problem`, `prepare_container`, `check_image_components` and
`remove_cell_containers` run the engine.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from matrix.case_launch import or_default
from matrix.cells import CaseInfo, RuntimeInfo
from matrix.errors import ConfigError
from matrix.launch.launch_plan import LaunchPlan, ProcessSpec
from matrix.launch.providers.base import ContainerSpec, Environment, Mismatch, Unavailable
from matrix.launch.providers.components import DISTRIBUTIONS_SCRIPT, Detected, mismatches, version_in_text
from matrix.text import excerpt

INFO_TIMEOUT_S = 5.0
# `docker info` costs a round trip to the daemon; every cell of a campaign asks, so answers are kept a while.
STATUS_TTL_S = 30.0
CELL_LABEL = "matrix.cell"
ROLE_LABEL = "matrix.role"
# Labels of the images `matrix runtime image` makes (informative: components are checked in the image).
RUNTIME_LABEL = "matrix.runtime"
RECIPE_LABEL = "matrix.recipe"
COMPONENTS_LABEL = "matrix.components"
PYTHON_LABEL = "matrix.python"
INSPECT_TIMEOUT_S = 30.0
PULL_TIMEOUT_S = 600.0
PROBE_TIMEOUT_S = 120.0
# /dev/shm for engines that move KV blocks through shared memory (upstream's containers use 10 GiB). vLLM's
# multiprocess executor alone asks for 160 MiB of it at start ("Insufficient space in /dev/shm ... 64 MiB free"
# under Docker's default); a tmpfs limit costs nothing until it is used.
DEFAULT_SHM_GIB: Mapping[str, float] = {"trtllm": 10.0, "vllm": 2.0, "vllm-cpu": 2.0, "sglang": 2.0}

_status: dict[str, tuple[float, str | None]] = {}
# (image id, python, component names) -> what the probe found in that image.
_probed: dict[tuple[str, str, tuple[str, ...]], Detected | Unavailable] = {}
_status_lock = threading.Lock()
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]")


def default_engine() -> str | None:
    """The first container engine on PATH (docker, then podman)."""
    from matrix.launch.providers.recipe import CONTAINER_ENGINES  # see `matrix.launch.providers`

    return next((engine for engine in CONTAINER_ENGINES if shutil.which(engine)), None)


def _first_error_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "cannot" in line.lower()]
    return excerpt((errors or lines or ["no output"])[-1], 300)


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
    """The image's environment when its engine runs here, the image is here (or pulls) and holds the
    runtime's components; otherwise why not (`Mismatch`: components differ, the cell fails as config)."""
    from matrix.launch.providers.recipe import container_config  # see `matrix.launch.providers`

    try:
        config = container_config(runtime)
    except ConfigError as exc:
        return Mismatch(str(exc))
    engine = config.engine or default_engine()
    if engine is None:
        return Unavailable(f"no container engine (docker or podman) on this host for runtime {runtime.label}")
    problem = engine_problem(engine)
    if problem is not None:
        return Unavailable(problem)
    image_id = local_image_id(engine, config.image)
    if isinstance(image_id, Unavailable):
        return image_id
    found = check_image_components(engine, image_id, config.python, config.env, runtime.components)
    if isinstance(found, Unavailable):
        return found
    spec = ContainerSpec(image=config.image, engine=engine, ipc_host=config.ipc_host)
    return Environment(python=config.python, env=dict(config.env), components=found, container=spec)


def engine_run(argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of an engine command; exit -1 with the reason when it could not run."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return -1, "", f"timed out after {timeout:g} s"
    except OSError as exc:
        return -1, "", str(exc)
    return done.returncode, done.stdout, done.stderr


def local_image_id(engine: str, image: str) -> str | Unavailable:
    """The id of `image` on this host, pulling it once when absent; `Unavailable` with the engine's one line."""
    inspect = [engine, "image", "inspect", "--format", "{{.Id}}", image]
    code, out, err = engine_run(inspect, INSPECT_TIMEOUT_S)
    if code == 0 and out.strip():
        return out.strip()
    code, _, err = engine_run([engine, "pull", "--quiet", image], PULL_TIMEOUT_S)
    if code != 0:
        return Unavailable(
            f"image {image} is not on this host and `{engine} pull {image}` failed: {_first_error_line(err)} "
            "(build it with `matrix runtime image`, or pull it on a host that reaches its registry)"
        )
    code, out, err = engine_run(inspect, INSPECT_TIMEOUT_S)
    if code != 0 or not out.strip():
        return Unavailable(f"image {image} was pulled but cannot be inspected: {_first_error_line(err)}")
    return out.strip()


# Inside the image: the distribution lookup, then `NAME --version` for names that are no distribution.
_PROBE_SCRIPT = (
    DISTRIBUTIONS_SCRIPT.replace("sys.stdout.write(json.dumps(found))", "")
    + """
import shutil, subprocess
outputs = {}
for name, version in found.items():
    if version is None and shutil.which(name):
        try:
            done = subprocess.run([shutil.which(name), "--version"], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=10)
            outputs[name] = done.stdout.decode("utf-8", "replace")[:2000]
        except Exception as exc:
            outputs[name] = "could not run: %s" % exc
sys.stdout.write(json.dumps({"distributions": found, "executables": outputs}))
"""
)


def probe_argv(engine: str, image: str, python: str, env: Mapping[str, str], names: Sequence[str]) -> list[str]:
    """One throwaway container of `image` (no network, labelled) that prints the components it finds."""
    run = [engine, "run", "--rm", "--network", "none", "--label", f"{CELL_LABEL}=probe"]
    for key in sorted(env):
        run += ["-e", f"{key}={env[key]}"]
    return [*run, "--entrypoint", python, image, "-c", _PROBE_SCRIPT, *names]


def check_image_components(
    engine: str, image: str, python: str, env: Mapping[str, str], expected: Mapping[str, str]
) -> Mapping[str, str] | Unavailable:
    """The runtime's components as found inside `image` (an id, so a moved tag is probed again);
    `Mismatch` when they are not the catalog's, `Unavailable` when the image cannot be asked."""
    names = tuple(expected)
    if not names:
        return {}
    key = (image, python, names)
    with _status_lock:
        cached = _probed.get(key)
    if cached is None:
        cached = _probe(engine, image, python, env, names)
        with _status_lock:
            _probed[key] = cached
    if isinstance(cached, Unavailable):
        return cached
    problems = mismatches(expected, cached, "image")
    return Mismatch("; ".join(problems)) if problems else dict(cached.versions)


def _probe(
    engine: str, image: str, python: str, env: Mapping[str, str], names: Sequence[str]
) -> Detected | Unavailable:
    code, out, err = engine_run(probe_argv(engine, image, python, env, names), PROBE_TIMEOUT_S)
    short = image.removeprefix("sha256:")[:12]
    if code != 0:
        why = _first_error_line(err or out)
        return Unavailable(f"cannot check the components inside image {short} ({python} there): {why}")
    try:
        answer = json.loads(out)
        distributions, executables = answer["distributions"], answer["executables"]
    except (ValueError, KeyError, TypeError):
        return Unavailable(f"the component probe in image {short} printed no answer: {excerpt(out, 200)!r}")
    versions: dict[str, str] = {}
    problems: dict[str, str] = {}
    for name in names:
        if distributions.get(name) is not None:
            versions[name] = str(distributions[name])
        elif name in executables:
            version = version_in_text(str(executables[name]))
            if version is not None:
                versions[name] = version
            else:
                first = str(executables[name]).strip().splitlines()[:1] or ["nothing"]
                problems[name] = f"`{name} --version` in the image printed no version ({excerpt(first[0], 120)!r})"
    return Detected(versions, problems)


def shm_gib_for(case: CaseInfo, runtime: RuntimeInfo) -> float | None:
    """Size of the shared-memory mount in GiB: the case's ``launch.shm_gib``, else the engine's default
    (trtllm: 10 GiB; vLLM and SGLang: 2 GiB), else None (the container engine's own default)."""
    value = case.launch.shm_gib
    if value is not None:
        return float(value)
    engine = or_default(case.launch.engine, runtime.backend)
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
    mounts: Sequence[str] = (),
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
    for mount in mounts:
        run += ["-v", f"{mount}:{mount}"]
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
    environment: Environment,
    plan: LaunchPlan,
    *,
    case: CaseInfo,
    runtime: RuntimeInfo,
    workspace: Path,
    model_dir: Path | None = None,
) -> LaunchPlan:
    """Run every process of `plan` inside the runtime's image; the plan itself when not a container.

    The container sees the cell's work directory (its logs) and scratch directories read-write, and the
    case's directory and model directory read-only, each at its host path, so argv needs no rewriting.
    """
    spec = environment.container
    if spec is None:
        return plan
    shm = shm_gib_for(case, runtime)
    read_only = [p for p in (case.source_dir, str(model_dir) if model_dir else "") if p]
    writable = [d for d in plan.scratch_dirs if not Path(d).is_relative_to(workspace)]

    def wrap(process: ProcessSpec) -> ProcessSpec:
        """The same process, started by the container engine instead of directly."""
        argv = container_argv(
            spec, cell_id=plan.cell_id, role=process.role, argv=process.argv, env=process.env,
            gpu_ids=plan.gpu_ids, shm_gib=shm, workspace=workspace, workdir=process.cwd,
            read_only_mounts=read_only, mounts=writable,
        )  # fmt: skip
        return replace(process, argv=tuple(argv))

    return replace(plan, processes=tuple(wrap(p) for p in plan.processes), container_engine=spec.engine)


def leftover_argv(engine: str, cell_id: str | None = None) -> list[str]:
    """List the ids of containers of one cell (or of every cell) that still exist."""
    label = f"{CELL_LABEL}={cell_id}" if cell_id else CELL_LABEL
    return [engine, "ps", "--all", "--quiet", "--filter", f"label={label}"]


def labelled_containers(engine: str) -> list[str]:
    """Every container of this engine carrying the cell label: one line each (id, name, cell, status).

    None should exist outside a running campaign: a runner's teardown and its watchdog remove them.
    """
    fmt = "{{.ID}} {{.Names}} cell=" + '{{.Label "' + CELL_LABEL + '"}} ({{.Status}})'
    argv = [engine, "ps", "--all", "--filter", f"label={CELL_LABEL}", "--format", fmt]
    code, out, _ = engine_run(argv, INSPECT_TIMEOUT_S)
    return [line.strip() for line in out.splitlines() if line.strip()] if code == 0 else []


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
