"""The launch machinery a campaign needs on the driver's host, behind `matrix.campaign.HostHooks`: the
runtimes' provider entries parsed once for all their cells, provisioning environments, and cleaning up after
runners that died. (Whether a case runs on CPU and bounds its memory absolutely came with the cell:
`CaseInfo.runs_on_cpu`, `CaseInfo.absolute_memory`, from its arm's row.)

The campaign calls these instead of importing `matrix.launch` (the executors are the layer that launches).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from matrix.cells import Cell, RuntimeInfo
from matrix.launch.providers.buildprocs import BuildInterrupted, sweep_orphans
from matrix.launch.supervisor import kill_cell_processes


class LocalHooks:
    """`HostHooks` for this host (both executors: the Ray driver also recovers and checks cells here)."""

    # What `provision` raises when a stop request ended the build in progress.
    build_interrupted: type[BaseException] = BuildInterrupted

    def with_specs(self, cells: Sequence[Cell]) -> list[Cell]:
        parsed: dict[str, RuntimeInfo] = {}

        def parse(runtime: RuntimeInfo) -> RuntimeInfo:
            if runtime.provider.get("kind") == "builtin":
                return runtime  # nothing to parse: a run of builtin runtimes never imports the recipe parser
            from matrix.launch.providers.recipe import with_spec

            if runtime.label not in parsed:
                parsed[runtime.label] = with_spec(runtime)
            return parsed[runtime.label]

        return [
            replace(cell, runtime=parse(cell.runtime), roles=tuple((role, parse(r)) for role, r in cell.roles))
            for cell in cells
        ]

    def provision(
        self, runtimes: Sequence[RuntimeInfo], say: Callable[[str], None], source: Any, stop: Callable[[], bool]
    ) -> dict[str, str]:
        if not any(runtime.provider.get("kind") == "venv" for runtime in runtimes):
            return {}  # nothing to build; the venv machinery is not even imported
        from matrix.launch.providers import ensure_provisioned

        return ensure_provisioned(runtimes, say, source, stop=stop)

    def sweep_orphan_builds(self) -> list[int]:
        return sweep_orphans()

    def kill_cell_processes(self, uid: str) -> list[int]:
        return kill_cell_processes(uid)
