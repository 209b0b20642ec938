"""The environments under the envs directory: list them, and prune what the catalog no longer uses.

Removal takes the environment's build lock without waiting, so an environment being built (or a build's
temporary directory) is never removed under its builder; a temporary directory whose lock nobody holds
belongs to a build that died (the lock goes with the builder's last file descriptor, even on SIGKILL).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matrix.cells import RuntimeInfo
from matrix.errors import MatrixError
from matrix.launch.providers.buildprocs import sweep_orphans
from matrix.launch.providers.venv import (
    TMP_PREFIX,
    TRASH_PREFIX,
    envs_dir,
    locked,
    read_info,
    remove_tree,
    targets_of,
    tree_size,
)
from matrix.launch.providers.venv.members import MEMBERS_DIR, prune_members


@dataclass(frozen=True)
class EnvEntry:
    """One directory under the envs directory, as `matrix runtime envs` shows it."""

    name: str
    path: Path
    state: str  # ready | broken | building | stale
    info: Mapping[str, Any] = field(default_factory=dict)

    @property
    def size_bytes(self) -> int:
        size = self.info.get("size_bytes")
        return int(size) if isinstance(size, int) else 0


def _lock_is_free(root: Path, name: str) -> bool:
    if not (root / f"{name}.lock").exists():
        return True  # a build creates its lock file before its temporary directory
    with locked(root / f"{name}.lock", blocking=False) as held:
        return held


def _temp_owner(path: Path) -> str:
    """The environment name a temporary directory belongs to (`.tmp-<name>-<pid>-<r>`)."""
    return path.name.removeprefix(TMP_PREFIX).split("-", 1)[0]


def list_envs(root: Path | None = None) -> list[EnvEntry]:
    """Every environment, build in progress and leftover under the envs directory."""
    root = envs_dir() if root is None else root
    if not root.is_dir():
        return []
    entries = []
    for path in sorted(root.iterdir()):
        if not path.is_dir() or path.name == MEMBERS_DIR:  # files kept for `extract` (`venv.members`)
            continue
        if path.name.startswith(TMP_PREFIX):
            building = not _lock_is_free(root, _temp_owner(path))
            entries.append(EnvEntry(_temp_owner(path), path, "building" if building else "stale"))
        elif path.name.startswith(TRASH_PREFIX):
            entries.append(EnvEntry(path.name, path, "stale"))
        else:
            info = read_info(path)
            entries.append(EnvEntry(path.name, path, "ready" if info else "broken", info or {}))
    return entries


@dataclass(frozen=True)
class Removal:
    """One directory `prune` removed (or would remove), and why."""

    path: Path
    why: str
    size_bytes: int


@dataclass(frozen=True)
class PruneReport:
    """What `prune` removed, which environments it kept because the catalog uses them, and which were busy."""

    removed: tuple[Removal, ...]
    kept: tuple[str, ...]
    busy: tuple[str, ...]

    @property
    def freed_bytes(self) -> int:
        return sum(r.size_bytes for r in self.removed)


def referenced_names(runtimes: Iterable[RuntimeInfo]) -> set[str]:
    """Environment names the catalog's venv runtimes use (runtimes whose interpreter is absent use none)."""
    names: set[str] = set()
    for runtime in runtimes:
        if runtime.provider.get("kind") != "venv":
            continue
        try:
            names.update(target.name for target in targets_of(runtime))  # built by uv or by pip
        except MatrixError:
            continue
    return names


def prune(referenced: set[str], *, dry_run: bool = False, root: Path | None = None) -> PruneReport:
    """Remove environments no current runtime references, and temporary directories of builds that died.

    An environment or build whose lock is held (being built, or built right now by another runner) is
    left alone and reported as busy.
    """
    root = envs_dir() if root is None else root
    removed: list[Removal] = []
    kept: list[str] = []
    busy: list[str] = []
    entries = list_envs(root)
    if not dry_run and any(entry.state == "stale" for entry in entries):
        # A build command of a runner killed outright (its own session, outside the runner's group) may still
        # write into the stale directory until the runner's build watchdog ends it; end it first, or it
        # recreates what is removed.
        sweep_orphans()
    for entry in entries:
        if entry.state == "building":
            busy.append(entry.path.name)
            continue
        if entry.state == "stale":
            why = "temporary directory of a build that did not finish"
        elif entry.name in referenced:
            kept.append(entry.name)
            continue
        else:
            why = "not used by any runtime of the catalog" if entry.state == "ready" else "incomplete environment"
        size = entry.size_bytes or tree_size(entry.path)
        if dry_run:
            removed.append(Removal(entry.path, why, size))
            continue
        with locked(root / f"{entry.name}.lock", blocking=False) as held:
            if not held:
                busy.append(entry.path.name)
                continue
            remove_tree(entry.path)
            if entry.state != "stale":
                (root / f"{entry.name}.failed.json").unlink(missing_ok=True)
        removed.append(Removal(entry.path, why, size))
    if not dry_run:
        _remove_orphan_files(root, referenced)
        prune_members(root)
    return PruneReport(tuple(removed), tuple(kept), tuple(busy))


def _remove_orphan_files(root: Path, referenced: set[str]) -> None:
    """Lock and failure files of environments that neither exist nor are referenced any more."""
    if not root.is_dir():
        return
    present = {p.name for p in root.iterdir() if p.is_dir()}
    for path in root.iterdir():
        for suffix in (".lock", ".failed.json"):
            if path.is_file() and path.name.endswith(suffix):
                name = path.name.removesuffix(suffix)
                if name in referenced or name in present or not _lock_is_free(root, name):
                    continue
                # A runner that opens this lock file right now and builds anyway is still safe: a build
                # renames into place only if the final name is free (see _build_locked).
                path.unlink(missing_ok=True)
