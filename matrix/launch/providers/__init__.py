"""Runtime providers: turn a runtime into an environment in which a plan's argv runs.

`builtin` (the reference server) runs with this interpreter. The other kinds report why they cannot
run here yet, so such cells are *skipped with a reason*, never silently dropped.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from matrix.plan import RuntimeInfo


@dataclass(frozen=True)
class Environment:
    """Where a runtime's processes run: the interpreter and extra environment."""

    python: str = sys.executable
    env: Mapping[str, str] = field(default_factory=dict)
    # Component versions actually found (name -> version), recorded with the outcome.
    components: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Unavailable:
    """The runtime cannot run on this host; `reason` goes into the skipped cell."""

    reason: str


def prepare(runtime: RuntimeInfo) -> Environment | Unavailable:
    kind = runtime.provider.get("kind", "host")
    if kind == "builtin":
        from matrix import __version__

        return Environment(components={"matrix-reference": __version__})
    return Unavailable(f"provider {kind!r} for {runtime.label} is not supported on this host yet")
