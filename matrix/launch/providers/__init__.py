"""Runtime providers: turn a runtime into an environment in which a plan's argv runs.

| kind        | environment                                                  | not runnable when                   |
|-------------|--------------------------------------------------------------|-------------------------------------|
| `builtin`   | this interpreter (the reference server ships with matrix)    | never                               |
| `host`      | this interpreter or `python`, plus `env` and `pythonpath`    | the interpreter is missing (skip)   |
| `venv`      | a cached virtual environment built from the recipe           | not built, or no Python here (skip) |
| `container` | `docker run`/`podman run` of `image` around every process    | no engine running here (skip)       |

`prepare` answers `Environment`, `Unavailable` (the cell is skipped with the reason) or `Mismatch` (the
runtime is here but not what the catalog says: the cell fails with kind ``config``). `Mismatch` and
`NotProvisioned` (a venv runtime not built yet) are subclasses of `Unavailable`: test `Mismatch` first.
`ProvisionFailed` (a `NotProvisioned` whose recipe failed to build) fails the cell with kind ``provision``:
test it before `Unavailable` too.

The `host` and `venv` providers (and the recipe parser with `packaging`'s requirement grammar behind them)
are imported when a runtime of theirs is prepared or built, not by every `matrix run`: a run of builtin
runtimes never needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from matrix.cells import RuntimeInfo
from matrix.launch.providers.base import (
    ContainerSpec,
    Environment,
    Mismatch,
    NotProvisioned,
    ProvisionFailed,
    Unavailable,
)
from matrix.launch.providers.container import remove_cell_containers, wrap_plan

if TYPE_CHECKING:
    from matrix.launch.providers.recipe import check_provider
    from matrix.launch.providers.venv import ProvisionError, ensure_provisioned, provision

# Names this package offers from modules it imports on first use (PEP 562).
_LAZY = {
    "check_provider": "recipe",
    "ProvisionError": "venv",
    "ensure_provisioned": "venv",
    "provision": "venv",
}

__all__ = [
    "ContainerSpec",
    "Environment",
    "Mismatch",
    "NotProvisioned",
    "ProvisionError",
    "ProvisionFailed",
    "Unavailable",
    "check_provider",
    "ensure_provisioned",
    "prepare",
    "provision",
    "remove_cell_containers",
    "wrap_plan",
]


def prepare(runtime: RuntimeInfo) -> Environment | Unavailable:
    """The environment a cell of `runtime` runs in, or why it cannot run here (`Mismatch`: why it must fail)."""
    kind = runtime.provider.get("kind", "host")
    if kind == "builtin":
        from matrix import __version__

        # `env` reaches the reference server's processes: e.g. MATRIX_REFERENCE_FAULTS plants a break in
        # one runtime's recipe, which `matrix bisect` must then find.
        env = {str(k): str(v) for k, v in runtime.provider.get("env", {}).items()}
        return Environment(env=env, components={"matrix-reference": __version__})
    if kind == "host":
        from matrix.launch.providers.host import prepare_host

        return prepare_host(runtime)
    if kind == "venv":
        from matrix.launch.providers.venv import prepare_venv

        return prepare_venv(runtime)
    if kind == "container":
        from matrix.launch.providers.container import prepare_container

        return prepare_container(runtime)
    return Mismatch(f"runtime {runtime.label}: unknown provider kind {kind!r}")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
