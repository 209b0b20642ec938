"""A version-skew cell's launch plan: each process taken from the plan of its own role's runtime.

The runner plans the cell once per distinct runtime of its roles (same ports, same work directory), each plan
in that runtime's environment (interpreter, PATH, container image); `compose_roles` keeps the base plan's
shape and probes and swaps in each role's process from its own plan, so prefill 0.29.0 really runs in the
0.29.0 environment while decode runs in 0.30.0's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from matrix.errors import ConfigError
from matrix.launch.launch_plan import LaunchPlan, ProcessSpec

# Processes that play one skew role: the engine itself and its sidecar (which runs the same version).
_ROLE_OF = {"frontend": "frontend", "prefill": "prefill", "prefill_sidecar": "prefill",
            "decode": "decode", "decode_sidecar": "decode"}  # fmt: skip
# Processes that are matrix's own code (the P/D proxy), indifferent to the engines' versions.
_NEUTRAL = frozenset({"proxy"})


def skew_role(process: ProcessSpec) -> str | None:
    """The skew role whose runtime runs `process`, or None for matrix's own helpers; a process that plays
    several roles at once cannot run two versions and is refused."""
    if process.role in _NEUTRAL:
        return None
    base, _, number = process.role.rpartition("_")
    if number.isdigit() and base in ("prefill", "decode"):
        return base  # a later worker of an xPyD topology ("decode_2") runs its role's runtime
    if process.role not in _ROLE_OF:
        raise ConfigError(
            f"process {process.role!r} runs more than one role in one process, so its roles cannot run "
            "different runtimes: plan this case without --skew, or give it one process per role"
        )
    return _ROLE_OF[process.role]


def compose_roles(base: LaunchPlan, by_role: Mapping[str, LaunchPlan]) -> LaunchPlan:
    """`base` with each process of a role in `by_role` replaced by that role's plan's process of the same name."""
    processes = []
    for process in base.processes:
        role = skew_role(process)
        plan = by_role.get(role) if role else None
        if plan is None:
            processes.append(process)
            continue
        same = [p for p in plan.processes if p.role == process.role]
        if len(same) != 1:
            raise ConfigError(f"the {role} runtime's plan has {len(same)} {process.role!r} processes, not one")
        processes.append(same[0])
    return replace(base, processes=tuple(processes))
