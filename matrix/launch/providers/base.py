"""What a provider hands back: an environment to run in, or the reason the runtime cannot run.

Kept apart from the providers themselves so that every provider module and the package's dispatcher can
import these types without importing each other.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ContainerSpec:
    """The image a container runtime's processes run in, and the engine that runs it."""

    image: str
    engine: str  # "docker" or "podman"
    # `--ipc host` shares the host's IPC namespace (and its /dev/shm, so no --shm-size then).
    ipc_host: bool = False
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Environment:
    """Where a runtime's processes run: the interpreter and extra environment."""

    python: str = sys.executable
    env: Mapping[str, str] = field(default_factory=dict)
    # Component versions actually found (name -> version), recorded with the outcome.
    components: Mapping[str, str] = field(default_factory=dict)
    # Set for container runtimes: every process of the plan must be wrapped (see `wrap_plan`).
    container: ContainerSpec | None = None


@dataclass(frozen=True)
class Unavailable:
    """The runtime cannot run on this host; `reason` goes into the skipped cell."""

    reason: str


@dataclass(frozen=True)
class Mismatch(Unavailable):
    """The runtime is present but is not what the catalog says (or its provider entry is invalid).

    Such a cell must *fail* with failure kind ``config``: skipping it would hide a broken installation
    (version skew between components). It subclasses `Unavailable` so that a caller
    that only knows `Unavailable` still never runs the cell; callers that know better test `Mismatch` first.
    """


@dataclass(frozen=True)
class NotProvisioned(Unavailable):
    """A venv runtime whose environment has not been built here (yet): skipped, with the command to run."""


@dataclass(frozen=True)
class ProvisionFailed(NotProvisioned):
    """A venv runtime whose recipe failed to build here: its cells *fail* (kind ``provision``), since a
    recipe that does not build is the release's failure. `reason` leads with the build's error line.

    A host that cannot build it at all (no such Python) stays a plain `NotProvisioned`: a skip."""
