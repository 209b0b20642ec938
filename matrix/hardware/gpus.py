"""GPU inventory through NVML. A host without NVML or without GPUs is a normal host with zero GPUs.

Indices here are always NVML indices, which follow PCI bus order. CUDA's own default enumeration is
"fastest first" and can disagree with NVML on hosts with mixed GPUs, so every child process we start gets
`CHILD_ENV` (``CUDA_DEVICE_ORDER=PCI_BUS_ID``): then ``CUDA_VISIBLE_DEVICES=2`` in a child means the
same GPU as NVML index 2 here, and the GPU a cell was leased is the GPU it runs on.

Every NVML call is best effort: a missing library, a missing driver or a GPU that fell off the bus turns
into "no GPU" or "unknown", never into an exception, because a test runner that cannot even start on a
CPU-only machine (or a half-broken GPU host) helps nobody.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from matrix.errors import ConfigError

# Set for every child process (merged into its environment) so that CUDA numbers devices like NVML does.
CHILD_ENV: dict[str, str] = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

GIB = 2**30

INVENTORY_COLUMNS = ("index", "uuid", "name", "total GiB", "used GiB", "free GiB")


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML saw it when the inventory was taken; memory figures are bytes."""

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int

    @property
    def memory_free(self) -> int:
        """Bytes not in use when the inventory was taken (never negative)."""
        return max(0, self.memory_total - self.memory_used)


def _text(value: object) -> str:
    # Older nvidia-ml-py releases return bytes for names and UUIDs, newer ones str.
    return value.decode() if isinstance(value, bytes) else str(value)


@contextmanager
def _nvml() -> Iterator[Any | None]:
    """The initialised `pynvml` module, or None when NVML cannot be used on this host.

    nvmlInit/nvmlShutdown are reference counted by NVML, so nesting and concurrent use from several
    threads are safe; each caller gets a fresh view rather than a handle cached across driver resets.
    """
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
        except Exception:  # NVMLError (no driver, driver/library mismatch) or a broken shared library
            pynvml = None
    if pynvml is None:
        yield None
        return
    try:
        yield pynvml
    finally:
        # Shutting down a library that is already failing must not mask the caller's result or error.
        with suppress(Exception):
            pynvml.nvmlShutdown()


def _read_gpu(nvml: Any, index: int) -> Gpu:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    return Gpu(
        index=index,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        name=_text(nvml.nvmlDeviceGetName(handle)),
        memory_total=int(memory.total),
        memory_used=int(memory.used),
    )


def inventory(*, restrict: Sequence[str] | None = None) -> tuple[Gpu, ...]:
    """Every GPU NVML sees, in NVML (PCI bus) order; empty when NVML is missing or fails.

    `restrict` is the `--gpus` list (NVML indices, UUIDs or UUID prefixes): only those GPUs are returned,
    still in NVML order, and an entry that names no GPU raises `ConfigError`. A device NVML lists but
    cannot read (e.g. "GPU is lost") is left out rather than failing the whole inventory.
    """
    gpus: list[Gpu] = []
    with _nvml() as nvml:
        if nvml is not None:
            try:
                count = int(nvml.nvmlDeviceGetCount())
            except Exception:
                count = 0
            for index in range(count):
                try:
                    gpus.append(_read_gpu(nvml, index))
                except Exception:  # noqa: S112 - one unreadable GPU must not hide the others
                    continue
    found = tuple(gpus)
    return found if restrict is None else restrict_gpus(found, restrict)


def parse_gpu_list(text: str) -> list[str]:
    """Split a `--gpus` value such as ``"0,2"`` or ``"GPU-8c3e,1"`` into entries.

    Raises `ConfigError` for an empty value or an empty entry (``"0,,2"``), which is always a typo.
    """
    if not text.strip():
        raise ConfigError("--gpus needs at least one GPU index or UUID, e.g. --gpus 0,2")
    entries = [part.strip() for part in text.split(",")]
    if any(not entry for entry in entries):
        raise ConfigError(f"--gpus {text!r} has an empty entry; use e.g. --gpus 0,2")
    return entries


def _describe(gpus: Sequence[Gpu]) -> str:
    if not gpus:
        return "this host has no GPUs NVML can see"
    return "GPUs here: " + ", ".join(f"{gpu.index} {gpu.uuid} ({gpu.name})" for gpu in gpus)


def _match_entry(entry: str, gpus: Sequence[Gpu]) -> list[Gpu]:
    """GPUs an entry names: an NVML index, or a case-insensitive UUID prefix with or without "GPU-"."""
    if entry.isdigit():
        return [gpu for gpu in gpus if gpu.index == int(entry)]
    wanted = entry.lower()
    if not wanted.startswith("gpu-"):
        wanted = "gpu-" + wanted
    return [gpu for gpu in gpus if gpu.uuid.lower().startswith(wanted)]


def restrict_gpus(gpus: Sequence[Gpu], entries: Sequence[str]) -> tuple[Gpu, ...]:
    """The GPUs `entries` name (see `inventory`), deduplicated, in NVML order.

    An entry that names no GPU, or a UUID prefix that names several, raises `ConfigError` listing the
    GPUs so the user can pick a correct one.
    """
    chosen: set[int] = set()
    for entry in entries:
        matches = _match_entry(entry, gpus)
        if not matches:
            raise ConfigError(f"--gpus entry {entry!r} names no GPU; {_describe(gpus)}")
        if len(matches) > 1:
            raise ConfigError(
                f"--gpus entry {entry!r} matches {len(matches)} GPUs; give more of the UUID. {_describe(gpus)}"
            )
        chosen.add(matches[0].index)
    return tuple(gpu for gpu in gpus if gpu.index in chosen)


def visible_devices_mapping(cuda_visible_devices: str | None, gpus: Sequence[Gpu]) -> list[Gpu]:
    """The GPUs a process sees as cuda:0, cuda:1, ... under `cuda_visible_devices`.

    Follows CUDA's rules, assuming ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (see `CHILD_ENV`) so indices are NVML
    indices: None (unset) shows every GPU in order; ``""`` shows none; entries are indices or ``GPU-``
    UUIDs, possibly abbreviated to a unique prefix; the first invalid entry (``-1``, an index or UUID
    that names no GPU, an ambiguous prefix) hides itself and everything after it. A GPU named a second
    time is treated as invalid too, since one device cannot be enumerated twice. MIG identifiers are not
    modelled and count as invalid.
    """
    if cuda_visible_devices is None:
        return list(gpus)
    seen: list[Gpu] = []
    for raw in cuda_visible_devices.split(","):
        entry = raw.strip()
        if entry.isdigit():
            matches = [gpu for gpu in gpus if gpu.index == int(entry)]
        elif entry.startswith("GPU-"):
            matches = [gpu for gpu in gpus if gpu.uuid.startswith(entry)]
        else:
            matches = []
        if len(matches) != 1 or matches[0] in seen:
            break
        seen.append(matches[0])
    return seen


def memory_used(index: int) -> int | None:
    """Bytes in use on GPU `index` right now, or None when NVML cannot tell."""
    with _nvml() as nvml:
        if nvml is None:
            return None
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            return int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception:
            return None


def gpu_processes(index: int) -> dict[int, int]:
    """Compute processes on GPU `index`: pid -> bytes they use; empty when NVML cannot tell.

    Best effort: inside a container NVML may report host pids or none at all, and the driver reports
    memory as unavailable (None) on some setups, which we count as 0 bytes. A pid listed more than once
    (one entry per context) gets the sum.
    """
    with _nvml() as nvml:
        if nvml is None:
            return {}
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            return {}
        found: dict[int, int] = {}
        for process in processes:
            used = getattr(process, "usedGpuMemory", None)
            pid = int(process.pid)
            found[pid] = found.get(pid, 0) + (int(used) if isinstance(used, int) else 0)
        return found


def format_inventory(gpus: Sequence[Gpu]) -> list[tuple[int, str, str, float, float, float]]:
    """Rows for a table under `INVENTORY_COLUMNS`: index, uuid, name, total/used/free GiB (one decimal)."""
    return [
        (
            gpu.index,
            gpu.uuid,
            gpu.name,
            round(gpu.memory_total / GIB, 1),
            round(gpu.memory_used / GIB, 1),
            round(gpu.memory_free / GIB, 1),
        )
        for gpu in gpus
    ]
