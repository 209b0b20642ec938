"""Provisioning: build an environment once under its lock, rename it into place, or wait for the
runner that builds it."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matrix.cells import RuntimeInfo
from matrix.errors import ConfigError, MatrixError
from matrix.launch.providers.base import Unavailable
from matrix.launch.providers.buildprocs import StopCheck, never, sweep_orphans
from matrix.launch.providers.venv.build import Builder, now
from matrix.launch.providers.venv.installer import INSTALLER_VARIABLE, Installer, choose_installer
from matrix.launch.providers.venv.locks import locked
from matrix.launch.providers.venv.relocate import compile_in_place, compile_wanted
from matrix.launch.providers.venv.target import (
    TMP_PREFIX,
    TRASH_PREFIX,
    HostCannotBuild,
    ProvisionError,
    Target,
    check_recorded,
    complete_info,
    discard,
    remove_tree,
    resolve_target,
    targets_of,
)
from matrix.launch.providers.venv.variant import build_from_base
from matrix.launch.providers.wheelhouse import (
    ProvisionSource,
)

Echo = Callable[[str], None]


TAIL_LINES = 20


def _tail(log: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


@dataclass(frozen=True)
class Provisioned:
    """A provisioned environment and how it came to be: built now, or reused (after waiting or not)."""

    path: Path
    built: bool
    waited: bool = False
    build_s: float | None = None


def _stale_temps(root: Path, name: str | None = None) -> list[Path]:
    prefix = f"{TMP_PREFIX}{name}-" if name else TMP_PREFIX
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith((prefix, TRASH_PREFIX)) and p.is_dir())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _require_components(runtime: RuntimeInfo, target: Target, info: Mapping[str, Any]) -> None:
    found = check_recorded(runtime, target, info)
    if isinstance(found, Unavailable):
        raise ProvisionError(f"environment {target.name} for {runtime.label}: {found.reason}")


def provision_target(
    runtime: RuntimeInfo, *, echo: Echo, source: ProvisionSource | None = None, stop: StopCheck = never
) -> Provisioned:
    """Make sure the runtime's environment exists (build it, or wait for another runner's build) and
    holds the catalog's component versions. Raises `ConfigError` or `ProvisionError` saying why not, and
    `BuildInterrupted` (the half-built directory removed) once `stop()` says so."""
    installer = choose_installer()
    target = resolve_target(runtime, installer.name)
    # Unless an installer is asked for by name, an environment the other one built is as good.
    others = [] if os.environ.get(INSTALLER_VARIABLE) else targets_of(runtime)[1:]
    for candidate in (target, *others):
        info = complete_info(candidate)
        if info is not None:
            _require_components(runtime, candidate, info)
            return Provisioned(candidate.path, built=False)
    waited: list[bool] = []

    def on_wait() -> None:
        waited.append(True)
        echo(f"{runtime.label}: waiting for another runner that is building environment {target.name}")

    with locked(target.lock_path, on_wait=on_wait, stop=stop):
        info = complete_info(target)
        if info is None:
            # We hold the lock, so no one else builds this key: leftovers are from builds that died, and
            # so are tagged build processes whose runner is gone (they would write into those leftovers).
            killed = sweep_orphans()
            if killed:
                echo(f"{runtime.label}: killed {len(killed)} build process(es) left by a runner that died")
            for stale in _stale_temps(target.root, target.name):
                shutil.rmtree(stale, ignore_errors=True)
            remove_tree(target.path)  # an incomplete or broken environment under the final name
            info = _from_base(runtime, target, installer, echo, source, stop) or _buildlocked(
                runtime, target, installer, echo, source or ProvisionSource(), stop
            )
            _require_components(runtime, target, info)
            return Provisioned(target.path, built=True, build_s=float(info.get("build_s", 0.0)))
    _require_components(runtime, target, info)
    return Provisioned(target.path, built=False, waited=bool(waited))


def _from_base(
    runtime: RuntimeInfo,
    target: Target,
    installer: Installer,
    echo: Echo,
    source: ProvisionSource | None,
    stop: StopCheck,
) -> dict[str, Any] | None:
    """A variant made from a base environment that differs in file steps only (`variant.py`), else None.
    Never from a wheelhouse: an offline build installs exactly its lock; never with
    MATRIX_VARIANTS_FROM_BASE=off (a full build, e.g. to measure one against the other)."""
    if source is not None and (source.offline or source.find_links):
        return None
    if os.environ.get("MATRIX_VARIANTS_FROM_BASE", "").lower() in ("0", "off", "no"):
        return None
    try:
        return build_from_base(runtime, target, echo, stop, installer)
    except ProvisionError as exc:
        _record_failure(target, runtime, str(exc))
        raise


def _record_failure(target: Target, runtime: RuntimeInfo, message: str, *, host: bool = False) -> None:
    """Remember why the last build failed; `host`: this host cannot build it (a skip, not a failure)."""
    record = {"at": now(), "runtime": runtime.label, "error": message, "host": host}
    target.failure_path.write_text(json.dumps(record))


_ERROR_LINE = re.compile(r"^(?:\S+ )?(ERROR|error|Error)\b.*|.*\b(?:No matching distribution|Could not find)\b.*")


# What uv prints under its `error: ...` line to say why ("cause: Because x was not found ..."): the name of
# what failed is there, not in the error line itself.
_CAUSE = re.compile(r"^(?:cause:|Caused by:|╰─▶)\s*(.*)")


def error_line(log_tail: str) -> str:
    """The build log's own error line (pip's `ERROR: ...`, uv's `error: ...` with the cause uv prints under
    it), the last one; "" if none."""
    found = ""
    lines = [line.strip() for line in log_tail.splitlines()]
    for index, line in enumerate(lines):
        if _ERROR_LINE.match(line):
            found = line
            cause = _CAUSE.match(lines[index + 1]) if index + 1 < len(lines) else None
            if cause and cause.group(1):
                found = f"{line.rstrip(':')}: {cause.group(1)}"
    return found


def _buildlocked(
    runtime: RuntimeInfo, target: Target, installer: Installer, echo: Echo, source: ProvisionSource, stop: StopCheck
) -> dict[str, Any]:
    tmp = target.root / f"{TMP_PREFIX}{target.name}-{os.getpid()}-{secrets.token_hex(3)}"
    if installer.note:
        echo(f"{runtime.label}: {installer.note}")
    builder = Builder(target, runtime, tmp, echo, installer, source, stop=stop)
    try:
        info = builder.build()
        try:
            os.rename(tmp, target.path)
        except OSError:
            # Only possible if something made the final directory without the lock (a racing prune
            # unlinked our lock file): keep the environment that is there if it is complete.
            existing = complete_info(target)
            if existing is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return existing
        _fsync_dir(target.root)
    except ConfigError as exc:
        # A wheelhouse that lacks what the build needs: the user's to fix, so it stays a ConfigError.
        shutil.rmtree(tmp, ignore_errors=True)
        message = f"provisioning {runtime.label} failed: {exc}"
        _record_failure(target, runtime, message)
        raise ConfigError(message) from None
    except Exception as exc:
        tail = _tail(builder.log)
        shutil.rmtree(tmp, ignore_errors=True)
        message = f"provisioning {runtime.label} failed at step {builder.step}/{builder.total}: {exc}"
        line = error_line(tail)
        if line:
            message += f"\nbuild error: {line}"
        if tail:
            message += f"\n--- last {TAIL_LINES} lines of the build log ---\n{tail}"
        host = isinstance(exc, HostCannotBuild)
        _record_failure(target, runtime, message, host=host)
        raise (HostCannotBuild if host else ProvisionError)(message) from None
    except BaseException:
        # Interrupted (Ctrl-C, a stop request): no half environment stays behind, and no failure is recorded;
        # it is deleted in the background, so the interrupted runner exits at once.
        discard(tmp)
        raise
    target.failure_path.unlink(missing_ok=True)
    elapsed = time.monotonic() - builder.started
    echo(f"{runtime.label}: environment {target.name} ready ({info['size_bytes'] / 2**20:.0f} MiB, {elapsed:.1f}s)")
    if compile_wanted():
        # In place and complete, still under the build lock: its log and commands are the final path's now.
        builder.tmp = target.path
        compile_in_place(target.path, builder.run, builder.log)
        echo(f"{runtime.label}: byte code compiled ({time.monotonic() - builder.started - elapsed:.1f}s)")
    return info


def provision(runtime: RuntimeInfo, *, echo: Echo, source: ProvisionSource | None = None) -> Path:
    """Build (or reuse) the venv of `runtime` and return its directory. Progress lines go to `echo`."""
    return provision_target(runtime, echo=echo, source=source).path


# The start of a failure message for a runtime this host cannot build (`matrix.campaign.HOST_CANNOT_BUILD`).
HOST_CANNOT_BUILD = "this host cannot build it: "


def _failure_text(exc: MatrixError) -> str:
    return f"{HOST_CANNOT_BUILD}{exc}" if isinstance(exc, HostCannotBuild) else str(exc)


def ensure_provisioned(
    runtimes: Iterable[RuntimeInfo], echo: Echo, source: ProvisionSource | None = None, stop: StopCheck = never
) -> dict[str, str]:
    """Provision every venv runtime in `runtimes` (each recipe once); runtime label -> error for failures.

    Cells on a runtime whose recipe failed to build fail (`ProvisionFailed`), cells on one this host cannot
    build are skipped, both by `prepare` from the recorded failure; the returned messages are for the
    caller to show (those of the second kind start with `HOST_CANNOT_BUILD`).
    """
    failures: dict[str, str] = {}
    failed_keys: dict[str, str] = {}
    seen: set[str] = set()
    for runtime in runtimes:
        if runtime.provider.get("kind") != "venv" or runtime.label in seen:
            continue
        seen.add(runtime.label)
        try:
            target = resolve_target(runtime)
        except MatrixError as exc:
            failures[runtime.label] = _failure_text(exc)
            continue
        if target.key in failed_keys:  # the same recipe already failed to build in this call
            failures[runtime.label] = failed_keys[target.key]
            continue
        try:
            provision_target(runtime, echo=echo, source=source, stop=stop)
        except MatrixError as exc:
            failures[runtime.label] = _failure_text(exc)
            if complete_info(target) is None:
                failed_keys[target.key] = _failure_text(exc)
    return failures
