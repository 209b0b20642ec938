"""Target and keys: a recipe resolved for this host, where its environment lives, whether it is built,
and what a cell on it gets."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matrix.cells import RuntimeInfo
from matrix.errors import ConfigError, MatrixError
from matrix.launch.providers.base import Environment, Mismatch, NotProvisioned, ProvisionFailed, Unavailable
from matrix.launch.providers.components import Detected, ProbeError, detect, mismatches
from matrix.launch.providers.host import resolve_interpreter
from matrix.launch.providers.interpreters import probe
from matrix.launch.providers.recipe import (
    VenvRecipe,
    venv_recipe,
)
from matrix.launch.providers.venv.installer import INSTALLERS, choose_installer
from matrix.paths import data_dir

# Directory names use this many hex digits of the key (80 bits): short paths keep `#!` lines well under
# the kernel's limit, and env.json holds the full key, which is checked on every use.
NAME_LENGTH = 20
LOG_NAME = "provision.log"
INFO_NAME = "env.json"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
MAJOR_MINOR = re.compile(r"^\d+\.\d+$")
THIS_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


class ProvisionError(MatrixError):
    """An environment could not be built or does not hold what the catalog says."""

    exit_code = 1


class HostCannotBuild(ProvisionError):
    """This host lacks what the recipe needs (its Python interpreter): the runtime's cells are skipped
    here, where a recipe that fails to build fails them."""


def envs_dir() -> Path:
    """Where provisioned environments live (not created here)."""
    return data_dir() / "envs"


def host_platform() -> str:
    """The platform part of the cache key, e.g. ``linux-x86_64``."""
    return sysconfig.get_platform()


def python_version_of(spec: str) -> str:
    """major.minor of the interpreter a recipe asks for: "" is this one, "3.11" is itself, else a path or
    command name that is asked. Raises `ProvisionError` when it is not on this host."""
    if not spec:
        return THIS_PYTHON
    if MAJOR_MINOR.match(spec):
        return spec
    path = resolve_interpreter(spec)
    if path is None:
        raise HostCannotBuild(f'interpreter {spec} is not on this host (write python = "3.11" or a path)')
    answer = probe(path)
    if answer.version is None:
        raise HostCannotBuild(f"interpreter {spec}: this interpreter does not run ({answer.problem})")
    return answer.version


@dataclass(frozen=True)
class Target:
    """A recipe resolved for this host: its key and where its environment lives."""

    label: str
    recipe: VenvRecipe
    python_version: str
    platform: str
    key: str
    root: Path
    installer: str = "pip"

    @property
    def recipe_key(self) -> str:
        """The key without the installer: what a wheelhouse's lock of this recipe is found by."""
        return self.recipe.key(self.python_version, self.platform)

    @property
    def name(self) -> str:
        return self.key[:NAME_LENGTH]

    @property
    def path(self) -> Path:
        return self.root / self.name

    @property
    def lock_path(self) -> Path:
        return self.root / f"{self.name}.lock"

    @property
    def failure_path(self) -> Path:
        return self.root / f"{self.name}.failed.json"

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def resolve_target(runtime: RuntimeInfo, installer: str | None = None) -> Target:
    """The runtime's recipe (carried by it, else parsed now) and its key for `installer` (None: the one the next
    build would use). `ConfigError`: bad recipe or installer; `ProvisionError`: its interpreter is not here."""
    recipe = venv_recipe(runtime)
    version = python_version_of(recipe.python)
    platform = host_platform()
    name = installer or choose_installer().name
    return Target(runtime.label, recipe, version, platform, recipe.key(version, platform, name), envs_dir(), name)


def targets_of(runtime: RuntimeInfo) -> list[Target]:
    """The runtime's target for each installer, the next build's first: an environment either built is used."""
    first = resolve_target(runtime)
    return [first, *(resolve_target(runtime, name) for name in INSTALLERS if name != first.installer)]


def read_info(path: Path) -> dict[str, Any] | None:
    """The env.json of a complete environment at `path`, or None (absent, unreadable, interpreter gone)."""
    try:
        info = json.loads((path / INFO_NAME).read_text())
    except (OSError, ValueError):
        return None
    # A dangling bin/python (its base interpreter was removed) makes the environment unusable.
    if not isinstance(info, dict) or not (path / "bin" / "python").exists():
        return None
    return info


def complete_info(target: Target) -> dict[str, Any] | None:
    """The env.json of the target's environment when it is complete and was built for this very key."""
    info = read_info(target.path)
    return info if info is not None and info.get("key") == target.key else None


def not_provisioned(runtime: RuntimeInfo, target: Target) -> NotProvisioned:
    """Why cells of `runtime` cannot run: not built yet or this host cannot build it (a skip), or its
    recipe failed to build (`ProvisionFailed`: the cells fail, the build's error line first)."""
    command = f"matrix runtime provision --runtime {runtime.backend}={runtime.version}"
    try:
        failure = json.loads(target.failure_path.read_text())
    except (OSError, ValueError):
        failure = None
    if isinstance(failure, dict) and failure.get("error"):
        error = str(failure["error"])
        if failure.get("host"):
            return NotProvisioned(f"runtime {runtime.backend} {runtime.version} cannot be built on this host "
                                  f"({failure.get('at', '?')}): {error}")  # fmt: skip
        found = next((line for line in error.splitlines() if line.startswith("build error: ")), "")
        lead = found.removeprefix("build error: ") or error.splitlines()[0]
        return ProvisionFailed(
            f"runtime {runtime.backend} {runtime.version} failed to build ({failure.get('at', '?')}): {lead}\n"
            f"{error}\nretry with `{command}`"
        )
    return NotProvisioned(f"runtime {runtime.backend} {runtime.version} is not provisioned: run `{command}`")


def venv_environment(target: Target) -> dict[str, str]:
    """What a cell's processes get: the environment's bin first on PATH, as `activate` would do, and no
    inherited PYTHONPATH, so the cell imports what the environment holds and nothing from the runner's."""
    env = {"PYTHONPATH": "", **target.recipe.env}
    env["PATH"] = os.pathsep.join([str(target.path / "bin"), env.get("PATH", os.environ.get("PATH", os.defpath))])
    env["VIRTUAL_ENV"] = str(target.path)
    # Byte code is written on first import (builds compile none, see `relocate`): a runner's own
    # PYTHONDONTWRITEBYTECODE would make every engine start compile its modules again. Empty means unset.
    env["PYTHONDONTWRITEBYTECODE"] = ""
    return env


def check_recorded(
    runtime: RuntimeInfo, target: Target, info: Mapping[str, Any]
) -> Mapping[str, str] | Unavailable | Mismatch:
    """The runtime's components in a built environment: from env.json when it recorded them (no child
    process per cell), else looked up in the environment's interpreter."""
    recorded = info.get("components")
    recorded_versions = recorded if isinstance(recorded, dict) else {}
    if all(name in recorded_versions for name in runtime.components):
        detected = Detected({name: str(recorded_versions[name]) for name in runtime.components})
    else:
        try:
            env = {**os.environ, **venv_environment(target)}
            detected = detect(str(target.python), list(runtime.components), env)
        except ProbeError as exc:
            return Unavailable(f"runtime {runtime.label}: {exc}")
    problems = mismatches(runtime.components, detected, "venv")
    return Mismatch("; ".join(problems)) if problems else dict(detected.versions)


def prepare_venv(runtime: RuntimeInfo) -> Environment | Unavailable:
    """The runtime's environment when provisioned; otherwise why not and the command that provisions it."""
    try:
        targets = targets_of(runtime)
    except ConfigError as exc:
        return Mismatch(str(exc))
    except ProvisionError as exc:
        return Unavailable(f"runtime {runtime.label}: {exc}")
    # An environment the other installer built serves as well: the recipe is the same.
    built = next(((t, i) for t in targets if (i := complete_info(t)) is not None), None)
    if built is None:
        return not_provisioned(runtime, targets[0])
    target, info = built
    found = check_recorded(runtime, target, info)
    if isinstance(found, Unavailable):
        return found
    return Environment(python=str(target.python), env=venv_environment(target), components=found)


def tree_size(path: Path) -> int:
    """Bytes of the files under `path` (links not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def remove_tree(path: Path) -> None:
    """Remove a directory without ever leaving it half-deleted under its own name: rename, then delete."""
    if not path.exists():
        return
    trash = path.parent / f"{TRASH_PREFIX}{path.name}-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        os.rename(path, trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def discard(path: Path) -> None:
    """Remove an interrupted build's directory without making the interrupted runner wait for it.

    Deleting a half-built environment (tens of thousands of files) took seconds, after Ctrl-C, before the
    prompt came back. The tree is renamed to a trash name at once (nothing half-deleted under a build's
    name) and an `rm` in a session of its own deletes it, outliving this process; should it not finish,
    the next build of the same key sweeps the trash (`_stale_temps`), as `prune` does."""
    if not path.exists():
        return
    trash = path.parent / f"{TRASH_PREFIX}{path.name.removeprefix(TMP_PREFIX)}-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        os.rename(path, trash)
        subprocess.Popen(
            ["rm", "-rf", "--", str(trash)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,  # a second Ctrl-C on the terminal spares it
        )  # fmt: skip
    except OSError:
        shutil.rmtree(trash if trash.exists() else path, ignore_errors=True)
