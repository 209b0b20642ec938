"""`matrix doctor`: what this host can run, and for each runtime of the catalog whether it runs here and
why not.

Everything is best effort: a host without NVML, without a container engine or without /dev/shm is a
normal host that can run fewer cells, and the report says which ones.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from matrix import __version__
from matrix.cells import CaseInfo, RuntimeInfo
from matrix.errors import MatrixError
from matrix.hardware.gpus import GIB, inventory
from matrix.launch import caches
from matrix.launch.arms import get_arm
from matrix.launch.providers import Mismatch, NotProvisioned, ProvisionFailed, Unavailable, prepare
from matrix.launch.providers.container import default_engine, engine_problem, labelled_containers
from matrix.launch.providers.recipe import CONTAINER_ENGINES
from matrix.launch.providers.venv import envs_dir, uv_path
from matrix.paths import data_dir

# Shared memory for KV transfers between processes (NIXL); read only, for its size.
from matrix.plan import Selection, make_plan

# Shared memory for KV transfers between processes (NIXL); read only, for its size.
SHM_PATH = "/dev/shm"  # noqa: S108 - not a temporary file: the mount whose size engines depend on


@dataclass(frozen=True)
class HostFacts:
    """What this host offers to cells."""

    matrix_version: str
    python: str
    platform: str
    cpus: int
    gpus: tuple[dict[str, Any], ...]
    nvml: bool
    driver_version: str | None
    cuda_driver_version: str | None
    container_engines: dict[str, str]
    default_engine: str | None
    # Containers carrying matrix's cell label on the default engine: a running campaign's, or strays.
    labelled_containers: tuple[str, ...]
    shm_bytes: int | None
    uv: str | None
    data_dir: str
    disk_free_bytes: int | None
    # Optional extras for running beyond one host: package -> installed version, or None.
    scale_out: dict[str, str | None] = field(default_factory=dict)
    # Per-runtime engine caches (`matrix.launch.caches`): on/off, how many, how big.
    engine_caches: str = ""


@dataclass(frozen=True)
class RuntimeReadiness:
    """Whether one runtime's cells can run here, and every reason some cannot."""

    runtime: str
    provider: str
    status: str  # ready | not provisioned | build failed | unavailable | mismatch | disabled
    runnable: str  # yes | partly | no
    cells: int
    runnable_cells: int
    reasons: tuple[str, ...] = ()
    components: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DoctorReport:
    """The host and every runtime, as `matrix doctor` prints them."""

    host: HostFacts
    runtimes: tuple[RuntimeReadiness, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"host": asdict(self.host), "runtimes": [asdict(r) for r in self.runtimes]}


def _driver_versions() -> tuple[bool, str | None, str | None]:
    """(NVML usable, driver version, CUDA version the driver supports); never raises."""
    try:
        import pynvml
    except ImportError:
        return False, None, None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, or a library that does not match it
        return False, None, None
    driver = cuda = None
    try:
        with suppress(Exception):
            raw = pynvml.nvmlSystemGetDriverVersion()
            driver = raw.decode() if isinstance(raw, bytes) else str(raw)
        with suppress(Exception):
            number = int(pynvml.nvmlSystemGetCudaDriverVersion())  # e.g. 12040
            cuda = f"{number // 1000}.{number % 1000 // 10}"
    finally:
        with suppress(Exception):
            pynvml.nvmlShutdown()
    return True, driver, cuda


def _engine_status(engine: str) -> str:
    if shutil.which(engine) is None:
        return "not installed"
    return engine_problem(engine, use_cache=False) or "running"


def _shm_bytes() -> int | None:
    try:
        stat = os.statvfs(SHM_PATH)
    except OSError:
        return None
    return stat.f_frsize * stat.f_blocks


def _disk_free(path: Path) -> int | None:
    # The data directory may not exist yet: its nearest existing parent is on the same file system.
    for candidate in (path, *path.parents):
        if candidate.exists():
            with suppress(OSError):
                return shutil.disk_usage(candidate).free
            return None
    return None


def _uv() -> str | None:
    path = uv_path()
    if path is None:
        return None
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return path
    return f"{done.stdout.strip() or 'uv'} ({path})"


# extra -> the distribution that provides it (checked without importing it: `ray` takes seconds to import).
SCALE_OUT_EXTRAS = {"ray": "ray", "postgres": "psycopg"}


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_facts() -> HostFacts:
    """Look at this host (NVML, container engines, /dev/shm, uv, disk); never raises."""
    nvml, driver, cuda = _driver_versions()
    engines = {name: _engine_status(name) for name in CONTAINER_ENGINES}
    engine = default_engine()
    gpus = tuple(
        {"index": g.index, "name": g.name, "uuid": g.uuid, "memory_total_gib": round(g.memory_total / GIB, 1)}
        for g in inventory()
    )
    return HostFacts(
        matrix_version=__version__,
        python=f"{platform.python_version()} ({sys.executable})",
        platform=f"{platform.system()} {platform.release()} {platform.machine()}",
        cpus=os.cpu_count() or 1,
        gpus=gpus,
        nvml=nvml,
        driver_version=driver,
        cuda_driver_version=cuda,
        container_engines=engines,
        default_engine=engine,
        labelled_containers=tuple(labelled_containers(engine)) if engine and engines[engine] == "running" else (),
        shm_bytes=_shm_bytes(),
        uv=_uv(),
        data_dir=str(data_dir()),
        disk_free_bytes=_disk_free(envs_dir()),
        scale_out={extra: _installed(dist) for extra, dist in SCALE_OUT_EXTRAS.items()},
        engine_caches=caches.summary(),
    )


def _cell_blockers(cases: Sequence[CaseInfo], gpu_count: int) -> tuple[int, list[str]]:
    """How many of `cases` can run on a host with `gpu_count` GPUs, and why the others cannot."""
    runnable = 0
    needs_gpus: dict[int, int] = {}
    other: list[str] = []
    for case in cases:
        try:
            cpu_ok = get_arm(case.arm).runs_on_cpu(case)
        except MatrixError as exc:
            other.append(f"case {case.name}: {exc}")
            continue
        if cpu_ok or case.gpus_needed <= gpu_count:
            runnable += 1
        else:
            needs_gpus[case.gpus_needed] = needs_gpus.get(case.gpus_needed, 0) + 1
    reasons = [
        f"{count} of {len(cases)} case(s) need {gpus} GPU{'s' if gpus > 1 else ''}, host has {gpu_count}"
        for gpus, count in sorted(needs_gpus.items())
    ]
    return runnable, reasons + other


def runtime_readiness(
    cases: Sequence[CaseInfo],
    runtimes: Sequence[RuntimeInfo],
    *,
    known_markers: set[str],
    known_backends: set[str],
    gpu_count: int,
) -> list[RuntimeReadiness]:
    """For each runtime: provider state, and how many of its cells this host can run."""
    # Planned as if every runtime were enabled, so a disabled one still shows what it would need.
    plan = make_plan(
        cases,
        [replace(r, enabled=True) for r in runtimes],
        Selection(),
        known_markers=known_markers,
        known_backends=known_backends,
    )
    cases_of: dict[str, list[CaseInfo]] = {}
    for cell in plan.cells:
        cases_of.setdefault(cell.runtime.label, []).append(cell.case)
    report = []
    for runtime in sorted(runtimes, key=lambda r: (r.backend, r.parsed_version)):
        runtime_cases = cases_of.get(runtime.label, [])
        runnable, reasons = _cell_blockers(runtime_cases, gpu_count)
        environment = prepare(runtime)
        components: dict[str, str] = {}
        if isinstance(environment, Mismatch):
            status = "mismatch"
        elif isinstance(environment, ProvisionFailed):  # its cells fail (kind provision)
            status = "build failed"
        elif isinstance(environment, NotProvisioned):
            status = "not provisioned"
        elif isinstance(environment, Unavailable):
            status = "unavailable"
        else:
            status = "ready"
            components = dict(environment.components)
        if isinstance(environment, Unavailable):
            reasons.insert(0, environment.reason)
        if not runtime.enabled:
            status = "disabled"
            reasons.insert(0, f"disabled: `matrix runtime enable {runtime.backend} {runtime.version}`")
        if status != "ready":
            verdict = "no"
        elif runnable == len(runtime_cases):
            verdict = "yes"
        else:
            verdict = "partly" if runnable else "no"
        if not runtime_cases:
            reasons.append("no case uses this runtime")
        report.append(
            RuntimeReadiness(
                runtime=runtime.label,
                provider=str(runtime.provider.get("kind", "host")),
                status=status,
                runnable=verdict,
                cells=len(runtime_cases),
                runnable_cells=runnable if status == "ready" else 0,
                reasons=tuple(reasons),
                components=components,
            )
        )
    return report


def doctor(
    cases: Sequence[CaseInfo], runtimes: Sequence[RuntimeInfo], *, known_markers: set[str], known_backends: set[str]
) -> DoctorReport:
    """The host's facts and every runtime's readiness on it."""
    host = host_facts()
    readiness = runtime_readiness(
        cases, runtimes, known_markers=known_markers, known_backends=known_backends, gpu_count=len(host.gpus)
    )
    return DoctorReport(host, tuple(readiness))


def _gib(value: int | None) -> str:
    return "unknown" if value is None else f"{value / GIB:.1f} GiB"


def host_lines(host: HostFacts) -> list[tuple[str, str]]:
    """(what, value) rows describing the host, for the table view."""
    gpus = ", ".join(f"{g['index']}: {g['name']} ({g['memory_total_gib']} GiB)" for g in host.gpus)
    if not host.gpus:
        gpus = "none" + ("" if host.nvml else " (NVML not available)") + ": GPU cases are skipped"
    driver = host.driver_version or "none"
    if host.cuda_driver_version:
        driver += f" (CUDA {host.cuda_driver_version})"
    engines = "; ".join(f"{name}: {status}" for name, status in host.container_engines.items())
    uv = host.uv or "not found (environments are built with python -m venv and pip)"
    return [
        ("matrix", host.matrix_version),
        ("python", host.python),
        ("platform", host.platform),
        ("cpus", str(host.cpus)),
        ("gpus", gpus),
        ("nvidia driver", driver),
        ("container engines", engines),
        ("matrix containers", _containers_line(host)),
        (SHM_PATH, _gib(host.shm_bytes)),
        ("uv", uv),
        ("data directory", host.data_dir),
        ("free disk (envs)", _gib(host.disk_free_bytes)),
        ("engine caches", host.engine_caches),
        *((f"{extra} extra", _extra_line(extra, version)) for extra, version in host.scale_out.items()),
    ]


def _containers_line(host: HostFacts) -> str:
    if not host.labelled_containers:
        return "none" if host.default_engine else "no engine"
    where = f"`{host.default_engine} rm --force ID` removes one unless its campaign still runs"
    return f"{len(host.labelled_containers)} labelled ({where}): " + "; ".join(host.labelled_containers)


def _extra_line(extra: str, version: str | None) -> str:
    what = {"ray": "--executor ray", "postgres": "postgresql:// databases"}.get(extra, extra)
    if version is None:
        return f"not installed: pip install 'disagg-matrix[{extra}]' for {what}"
    return f"{SCALE_OUT_EXTRAS[extra]} {version} ({what})"
