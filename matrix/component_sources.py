"""Where a backend's components come from when they are not a pip pin of their own name: one table.

`vllm-rs` is not a distribution: it is the file `vllm/vllm-rs` inside the CUDA wheel `vllm==V` (exposed
from the installed wheel on CUDA runtimes, extracted from a wheel that is not installed on CPU ones).
`nixl` is a pip pin that moves with its CUDA companion (`nixl-cu12`/`nixl-cu13==V`). The SGLang gRPC
bridge is a module inside `sglang==V` itself, so it cannot change without SGLang.

Everything that varies one component (`matrix runtime derive`, `run --with`, catalog `base` + `with`,
`bisect --component`) reads this table; a component that is in neither the table nor a recipe pin is
refused with the reason. A leaf module: it imports nothing of matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.utils import canonicalize_name


@dataclass(frozen=True)
class WheelMember:
    """The component is one file of the wheel `project==V` (its releases are that project's on the index)."""

    project: str
    member: str

    def requirement(self, version: str) -> str:
        return f"{self.project}=={version}"

    def describe(self) -> str:
        return f"member {self.member} of the wheel {self.project}==V"


@dataclass(frozen=True)
class PipPins:
    """The component is the pip pin `project==V`, with companions pinned to the same version."""

    project: str
    companions: tuple[str, ...] = ()

    def describe(self) -> str:
        also = "".join(f" with {c}==V" for c in self.companions)
        return f"the pip pin {self.project}==V{also}"


@dataclass(frozen=True)
class Bundled:
    """The component ships inside another distribution and cannot be changed on its own."""

    project: str

    def describe(self) -> str:
        return f"inside {self.project}==V (changes only with {self.project})"


Source = WheelMember | PipPins | Bundled

_VLLM_RS = WheelMember("vllm", "vllm/vllm-rs")

SOURCES: dict[str, dict[str, Source]] = {
    "vllm": {"vllm-rs": _VLLM_RS, "nixl": PipPins("nixl", ("nixl-cu12", "nixl-cu13"))},
    "vllm-cpu": {"vllm-rs": _VLLM_RS, "nixl": PipPins("nixl", ("nixl-cu12",))},
    "sglang": {"sglang-grpc-bridge": Bundled("sglang"), "nixl": PipPins("nixl", ("nixl-cu12", "nixl-cu13"))},
}


def source_for(backend: str, component: str) -> Source | None:
    """The table's source of `component` on `backend`, or None (then only a recipe pin of its name can vary it)."""
    return SOURCES.get(backend, {}).get(str(canonicalize_name(component)))


def index_project(backend: str, component: str) -> str:
    """The project whose releases on the index are the component's versions (`vllm` for `vllm-rs`)."""
    source = source_for(backend, component)
    return source.project if isinstance(source, WheelMember | PipPins) else str(canonicalize_name(component))
