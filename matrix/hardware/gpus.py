"""GPU inventory through NVML. A host without NVML or without GPUs is a normal host with zero GPUs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int


def inventory() -> tuple[Gpu, ...]:
    """Every GPU NVML sees, in NVML (PCI bus) order; empty when NVML is missing or fails."""
    try:
        import pynvml
    except ImportError:
        return ()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return ()
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            gpus.append(
                Gpu(
                    index=index,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    memory_total=int(memory.total),
                    memory_used=int(memory.used),
                )
            )
        return tuple(gpus)
    finally:
        pynvml.nvmlShutdown()
