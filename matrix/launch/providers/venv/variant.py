"""A variant's environment made from its base's, not from scratch.

A variant recipe (`matrix.variants`) differs from its base in file steps only: an `extract` reading the
`vllm-rs` of another wheel, or an `expose` it replaces. Such an environment is the base's environment
plus one file, so it is made by copying the base with hard links (`cp -a -l`: no data is copied, the base
is seconds and a few MiB of directory entries), relocating it as every environment is relocated (the
`#!` lines and pyvenv.cfg name the final path) and running only the differing steps; then the components
those steps can change (executables) are asked again from the environment itself (`vllm-rs --version`), as
after a full build; its distributions are the base's very files, at the base's recorded versions.

Hard links share inodes with the base, so nothing here ever writes into a copied file: a file that
changes is unlinked and written anew (relocated scripts, env.json, the log; `extract` writes a fresh file
as it does in a full build; a file an earlier build took from the very same wheel is hard-linked from the
member kept for it (`venv.members`) or from that environment instead of reading the wheel again). Byte
code stays the base's: its recorded source paths name the base's files, which are the very same files.

The guarantees of the venv provider hold: the copy is made under the variant's own build lock in a
`.tmp-` directory renamed into place in one `rename(2)` (a SIGKILL leaves only a temporary directory,
which the next builder or `prune` removes), and the base is copied under its lock, taken without waiting,
so a base being removed is never copied half.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from packaging.utils import canonicalize_name

from matrix.cells import RuntimeInfo
from matrix.errors import MatrixError
from matrix.launch.providers.buildprocs import StopCheck, run_command
from matrix.launch.providers.components import Detected, ProbeError, detect, mismatches
from matrix.launch.providers.recipe import ExposeStep, ExtractStep
from matrix.launch.providers.venv.build import STEP_TIMEOUT_S, Echo
from matrix.launch.providers.venv.installer import Installer
from matrix.launch.providers.venv.locks import locked
from matrix.launch.providers.venv.members import keep_member, link_member, member_key
from matrix.launch.providers.venv.target import (
    INFO_NAME,
    LOG_NAME,
    TMP_PREFIX,
    ProvisionError,
    Target,
    discard,
    read_info,
)
from matrix.launch.providers.venv.wheelfiles import WheelFiles, fetched_wheel

# Steps that only put one file into bin/: a variant whose recipe differs from its base in these alone is
# made from the base's environment.
FILE_STEPS = ("extract", "expose")


@dataclass(frozen=True)
class Base:
    """A complete environment a target can be made from, and the indices of the steps that differ."""

    path: Path
    info: dict[str, Any]
    differing: tuple[int, ...]


def _is_file_step(step: Any) -> bool:
    return isinstance(step, dict) and any(key in step for key in FILE_STEPS)


def find_base(target: Target) -> Base | None:
    """The complete environment under the target's root whose recipe differs from the target's in the
    fewest file steps and nothing else (same interpreter, platform and every other step), or None."""
    wanted = [step.canonical() for step in target.recipe.steps]
    best: Base | None = None
    if not target.root.is_dir():
        return None
    for path in sorted(target.root.iterdir()):
        if path.name.startswith(".") or not path.is_dir() or path == target.path:
            continue
        info = read_info(path)
        if info is None or info.get("name") != path.name or "source" in info:
            continue  # incomplete, or built from a wheelhouse (its host site-packages are not ours to copy)
        if info.get("python_version") != target.python_version or info.get("platform") != target.platform:
            continue
        steps = info.get("recipe", {}).get("steps")
        if not isinstance(steps, list) or len(steps) != len(wanted):
            continue
        differing = tuple(i for i, (a, b) in enumerate(zip(steps, wanted, strict=True)) if a != b)
        if not differing or not all(_is_file_step(steps[i]) and _is_file_step(wanted[i]) for i in differing):
            continue
        if best is None or len(differing) < len(best.differing):
            best = Base(path, info, differing)
    return best


def _unlinked_write(path: Path, data: bytes) -> Path:
    """Write `path` as a new file: never through a hard link shared with the base; `path`."""
    path.unlink(missing_ok=True)
    path.write_bytes(data)
    return path


def _relocate(tmp: Path, old: str, final: str) -> list[Path]:
    """The base's absolute path in `#!` lines, activate scripts and pyvenv.cfg becomes the variant's; the
    files written anew."""
    before, after = old.encode(), final.encode()
    written = []
    for path in [*(p for p in (tmp / "bin").iterdir() if p.is_file() and not p.is_symlink()), tmp / "pyvenv.cfg"]:
        try:
            content = path.read_bytes()
        except OSError:
            continue
        if before in content and len(content) < 1_000_000:
            mode = path.stat().st_mode
            written.append(_unlinked_write(path, content.replace(before, after)))
            path.chmod(mode & 0o7777)
    return written


@dataclass
class _VariantBuild:
    runtime: RuntimeInfo
    target: Target
    base: Base
    tmp: Path
    echo: Echo
    stop: StopCheck
    # The target's installer: a base uv built has no pip in it, so uv reads the wheel too.
    installer: Installer
    # The files written anew (not hard-linked): what the variant adds to the base.
    written: list[Path] = field(default_factory=list)

    @property
    def python(self) -> str:
        return str(self.tmp / "bin" / "python")

    @property
    def log(self) -> Path:
        return self.tmp / LOG_NAME

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update({
            "VIRTUAL_ENV": str(self.tmp), "PATH": os.pathsep.join([str(self.tmp / "bin"), os.environ.get("PATH", "")]),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "PIP_PROGRESS_BAR": "off",
            "PYTHONDONTWRITEBYTECODE": "1",
        })  # fmt: skip
        return env

    def note(self, line: str) -> None:
        with self.log.open("a") as log:
            log.write(line + "\n")

    def run(self, argv: list[str]) -> None:
        with self.log.open("a") as log:
            log.write(f"$ {shlex.join(argv)}\n")
            log.flush()
            try:
                done = run_command(
                    argv,
                    stdout=log,
                    stderr=log,
                    env={**self.env(), **self.installer.env},
                    timeout_s=STEP_TIMEOUT_S,
                    stop=self.stop,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise ProvisionError(f"`{shlex.join(argv)}` could not finish: {exc}") from None
            log.write(f"[exit {done.returncode}]\n")
        if done.returncode != 0:
            raise ProvisionError(f"`{shlex.join(argv)}` failed with exit code {done.returncode}")

    def copy(self) -> None:
        """The base, hard-linked (its lock taken without waiting: a base being removed is not copied)."""
        with locked(self.base.path.parent / f"{self.base.path.name}.lock", blocking=False) as held:
            if not held or read_info(self.base.path) is None:
                raise _NoBase(f"environment {self.base.path.name} is being removed or rebuilt")
            done = subprocess.run(
                ["cp", "-a", "-l", "--", str(self.base.path), str(self.tmp)],
                capture_output=True,
                text=True,
                check=False,
            )
        if done.returncode != 0:  # e.g. another file system that cannot hard-link: build from scratch
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise _NoBase(f"cannot hard-link {self.base.path.name}: {done.stderr.strip()}")

    def donor(self, step: ExtractStep) -> Path | None:
        """The file this very step already put into another complete environment here (e.g. the vllm-rs of
        vllm==0.30.0 in the 0.30.0 runtime's environment), when no later step of that recipe renamed over it."""
        name = PurePosixPath(step.member).name
        wanted = step.canonical()
        for path in sorted(self.target.root.iterdir()):
            if path.name.startswith(".") or path in (self.tmp, self.target.path):
                continue
            info = read_info(path)
            steps = info.get("recipe", {}).get("steps") if info else None
            if not isinstance(steps, list) or wanted not in steps:
                continue
            later = steps[steps.index(wanted) + 1 :]
            if any(
                _is_file_step(s) and PurePosixPath(str(s.get("member") or s.get("expose"))).name == name for s in later
            ):
                continue
            candidate = path / "bin" / name
            if candidate.is_file() and not candidate.is_symlink():
                return candidate
        return None

    def extract(self, step: ExtractStep) -> None:
        target = self.tmp / "bin" / PurePosixPath(step.member).name
        key = member_key(step.requirement, step.member, self.target.python_version, self.target.platform)
        if link_member(self.target.root, key, target):
            self.note(f"extract: bin/{target.name} linked from the member kept for {step.describe()}")
            return
        donor = self.donor(step)
        if donor is not None:
            target.unlink(missing_ok=True)
            try:
                os.link(donor, target)  # the same bytes, no copy; nothing ever writes through it
            except OSError:
                pass  # removed meanwhile, or another file system: take it from the wheel
            else:
                self.note(f"extract: bin/{target.name} hard-linked from environment {donor.parents[1].name} "
                          f"(the same step {step.describe()})")  # fmt: skip
                return
        with self.wheel(step.requirement) as wheel:
            try:
                data = wheel.read(step.member)
            except KeyError:
                raise ProvisionError(f"extract: {wheel.name} has no member {step.member}") from None
        self.written.append(_unlinked_write(target, data))
        target.chmod(0o755)
        self.note(f"extract: bin/{target.name} from {wheel.name} ({len(data)} bytes)")
        keep_member(self.target.root, key, target)

    @contextmanager
    def wheel(self, requirement: str) -> Iterator[WheelFiles]:
        """One pinned distribution's wheel, not installed (as the full build reads it): unpacked by uv from
        its cache, or downloaded by pip; removed afterwards."""
        uv = self.installer.uv if self.installer.name == "uv" else None
        with fetched_wheel(
            self.run, self.tmp / ".download", requirement, python=self.python, uv=uv, uv_args=self.installer.args
        ) as wheel:
            yield wheel

    def expose(self, step: ExposeStep) -> None:
        site = self.tmp / "lib" / f"python{self.target.python_version}" / "site-packages"
        source = site / step.member
        if not source.is_file():
            raise ProvisionError(f"expose: {step.member} is not in the environment's site-packages")
        link = self.tmp / "bin" / source.name
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(source, link.parent))
        self.note(f"expose: bin/{source.name} -> {step.member}")

    def detect(self) -> Detected:
        """The runtime's components as the variant has them. A distribution's version is the base's as
        recorded (the variant's site-packages are the base's very files: only bin/ differs), so only the other
        components (an executable such as vllm-rs) are asked, as after a full build: `vllm-rs --version`,
        with no interpreter started to list distributions that cannot have changed."""
        site = self.tmp / "lib" / f"python{self.target.python_version}" / "site-packages"
        installed = {canonicalize_name(p.name.split("-", 1)[0]) for p in site.glob("*.dist-info")}
        recorded = self.base.info.get("components")
        recorded = recorded if isinstance(recorded, dict) else {}
        versions: dict[str, str] = {}
        asked = []
        for name in self.runtime.components:
            if canonicalize_name(name) in installed and name in recorded:
                versions[name] = str(recorded[name])
            else:
                asked.append(name)
        try:
            found = detect(self.python, asked, {**self.env(), **self.target.recipe.env})
        except ProbeError as exc:
            raise ProvisionError(str(exc)) from None
        return Detected({**versions, **found.versions}, dict(found.problems))

    def build(self) -> dict[str, Any]:
        started = time.monotonic()
        self.echo(f"{self.target.label}: from environment {self.base.path.name}: hard-link copy, then "
                  f"{len(self.base.differing)} differing step(s)")  # fmt: skip
        self.copy()
        base_log = (self.base.path / LOG_NAME).read_bytes() if (self.base.path / LOG_NAME).is_file() else b""
        self.written.append(
            _unlinked_write(self.log, base_log + f"# {self.target.label}: made from {self.base.path.name}\n".encode())
        )
        self.written += _relocate(self.tmp, str(self.base.path), str(self.target.path))
        copied_s = time.monotonic() - started
        for index in self.base.differing:
            step = self.target.recipe.steps[index]
            self.echo(f"{self.target.label}: step {index + 2} {step.describe()} ({time.monotonic() - started:.1f}s)")
            if isinstance(step, ExtractStep):
                self.extract(step)
            elif isinstance(step, ExposeStep):
                self.expose(step)
        steps_s = time.monotonic() - started - copied_s
        detected = self.detect()
        problems = mismatches(self.runtime.components, detected, "venv")
        if problems:
            raise ProvisionError(f"the variant's environment does not match the catalog: {'; '.join(problems)}")
        info = {
            **self.base.info,
            "key": self.target.key,
            "name": self.target.name,
            "recipe": {
                "python": self.target.recipe.python,
                "steps": [s.canonical() for s in self.target.recipe.steps],
                "summary": self.target.recipe.summary(),
            },
            "created": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "created_for": self.target.label,
            "tool": "variant",
            "build_s": round(time.monotonic() - started, 1),
            "components": dict(detected.versions),
            "derived_from": {
                "name": self.base.path.name,
                "key": self.base.info.get("key"),
                "steps": list(self.base.differing),
                "copy_s": round(copied_s, 2),
                "steps_s": round(steps_s, 2),
                "verify_s": round(time.monotonic() - started - copied_s - steps_s, 2),
            },
        }
        # Every other file is a hard link (the copy): the files written are looked at, not the copy's ~43,000
        # (a walk took seconds); one kept as a member is shared too. env.json's own few KiB are not in it.
        info["extra_bytes"] = sum(st.st_size for st in map(os.lstat, self.written) if st.st_nlink == 1)
        info["size_bytes"] = int(self.base.info.get("size_bytes", 0)) or info["extra_bytes"]
        _unlinked_write(self.tmp / INFO_NAME, (json.dumps(info, indent=2) + "\n").encode())
        return info


class _NoBase(Exception):
    """The base cannot be copied after all: build from scratch instead."""


def build_from_base(
    runtime: RuntimeInfo, target: Target, echo: Echo, stop: StopCheck, installer: Installer
) -> dict[str, Any] | None:
    """Make the target's environment from a base environment and return its env.json, or None when there is
    no base to make it from (the caller builds from scratch). Call with the target's build lock held.
    `ProvisionError` when a differing step fails (a full build would fail at the same step)."""
    base = find_base(target)
    if base is None:
        return None
    tmp = target.root / f"{TMP_PREFIX}{target.name}-{os.getpid()}-{secrets.token_hex(3)}"
    build = _VariantBuild(runtime, target, base, tmp, echo, stop, installer)
    try:
        info = build.build()
        os.rename(tmp, target.path)
        fd = os.open(target.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except _NoBase as exc:
        echo(f"{target.label}: {exc}; building from scratch")
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    except MatrixError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ProvisionError(f"provisioning {runtime.label} from environment {base.path.name} failed: {exc}") from None
    except BaseException:  # interrupted: deleted in the background, the runner exits at once
        discard(tmp)
        raise
    echo(f"{target.label}: environment {target.name} ready from {base.path.name} "
         f"(+{info['extra_bytes'] / 2**20:.1f} MiB, {info['build_s']:.1f}s)")  # fmt: skip
    return info
