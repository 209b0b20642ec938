"""Build steps: one build of one target in a temporary directory, step by step, with its log."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import site
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import IO, Any

from packaging.utils import canonicalize_name

from matrix.cells import RuntimeInfo
from matrix.errors import ConfigError
from matrix.launch.providers.buildprocs import StopCheck, never, run_command
from matrix.launch.providers.components import ProbeError, detect, distribution_versions, mismatches
from matrix.launch.providers.host import resolve_interpreter
from matrix.launch.providers.interpreters import find_python
from matrix.launch.providers.recipe import (
    AliasStep,
    ExposeStep,
    ExtractStep,
    PipStep,
    PluginStep,
    RequirementsOfStep,
    UninstallStep,
    plugin_path,
    select_requirements,
)
from matrix.launch.providers.venv.installer import Installer
from matrix.launch.providers.venv.members import keep_member, link_member, member_key
from matrix.launch.providers.venv.relocate import relocate
from matrix.launch.providers.venv.target import (
    INFO_NAME,
    LOG_NAME,
    MAJOR_MINOR,
    THIS_PYTHON,
    HostCannotBuild,
    ProvisionError,
    Target,
    tree_size,
)
from matrix.launch.providers.venv.wheelfiles import WheelFile, WheelFiles, fetched_wheel
from matrix.launch.providers.wheelhouse import (
    LockedStep,
    ProvisionSource,
    RuntimeLock,
    check_files,
    manifest_digest,
    wheelhouse_command,
)
from matrix.launch.providers.wheeltarget import this_host

Echo = Callable[[str], None]


# Lists the site-packages of the interpreter running matrix, after the environment's own: how an environment
# built from a wheelhouse sees the distributions the wheelhouse left to the host (`--exclude`).
HOST_SITE_PTH = "_matrix_host_site.pth"
# One pip step may download and build a lot (a GPU engine's wheels); a hung index must still end.
STEP_TIMEOUT_S = 3600.0

# Runs inside the venv's interpreter: the PEP 508 marker environment, like packaging's
# default_environment(), without needing packaging there.
_MARKER_ENV_SCRIPT = """
import json, os, platform, sys
def fmt(info):
    version = "%d.%d.%d" % (info.major, info.minor, info.micro)
    if info.releaselevel != "final":
        version += info.releaselevel[0] + str(info.serial)
    return version
impl = sys.implementation
print(json.dumps({
    "implementation_name": impl.name,
    "implementation_version": fmt(impl.version),
    "os_name": os.name,
    "platform_machine": platform.machine(),
    "platform_release": platform.release(),
    "platform_system": platform.system(),
    "platform_version": platform.version(),
    "python_full_version": platform.python_version(),
    "platform_python_implementation": platform.python_implementation(),
    "python_version": ".".join(platform.python_version_tuple()[:2]),
    "sys_platform": sys.platform,
}))
"""


# Switches uv refuses to see twice (a recipe step's --no-index next to the pip configuration's).
_UV_SWITCHES = frozenset({"--no-index", "--no-deps", "--offline", "--pre"})


def once(argv: Sequence[str], switches: frozenset[str]) -> list[str]:
    """`argv` with each of `switches` kept at its first place only."""
    seen: set[str] = set()
    kept = []
    for arg in argv:
        if arg in switches:
            if arg in seen:
                continue
            seen.add(arg)
        kept.append(arg)
    return kept


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def build_env(tmp: Path) -> dict[str, str]:
    """The environment of build commands: the outer interpreter's variables must not leak into the venv's
    (PYTHONPATH would make packages look installed that are not), and pip must never prompt."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(
        {
            "VIRTUAL_ENV": str(tmp),
            "PATH": os.pathsep.join([str(tmp / "bin"), os.environ.get("PATH", os.defpath)]),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_INPUT": "1",
            "PIP_PROGRESS_BAR": "off",
            # No byte code in the temporary directory: it would name its paths (see `relocate`).
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    return env


@dataclass
class Builder:
    """One build of one target in one temporary directory, with its log and progress lines."""

    target: Target
    runtime: RuntimeInfo
    tmp: Path
    echo: Echo
    installer: Installer
    source: ProvisionSource = field(default_factory=ProvisionSource)
    started: float = field(default_factory=time.monotonic)
    step: int = 0
    # Offline: the wheelhouse's lock of this recipe, and the locked step being built.
    lock: RuntimeLock | None = None
    current: LockedStep | None = None
    # Polled while a command runs: the runner was asked to stop (SIGINT/SIGTERM).
    stop: StopCheck = never

    @property
    def total(self) -> int:
        # create + the recipe's steps + verify and finish
        return len(self.target.recipe.steps) + 2

    @property
    def uv(self) -> str | None:
        """The uv binary when uv builds this environment."""
        return self.installer.uv if self.installer.name == "uv" else None

    @property
    def offline(self) -> list[str]:
        # uv's own switch: no network at all, not even for a build backend (pip has --no-index alone).
        return ["--offline"] if self.uv and self.source.offline else []

    @property
    def log(self) -> Path:
        return self.tmp / LOG_NAME

    @property
    def python(self) -> str:
        return str(self.tmp / "bin" / "python")

    @property
    def prompt(self) -> str:
        # What `activate` shows; the default would be the temporary directory's name.
        return f"matrix-{self.target.label}"

    def progress(self, what: str) -> None:
        self.step += 1
        elapsed = time.monotonic() - self.started
        self.echo(f"{self.target.label}: step {self.step}/{self.total} {what} ({elapsed:.1f}s)")

    def run(self, argv: Sequence[str], *, capture: bool = False) -> str:
        """Run one command, its output appended to the log (or returned when `capture`); uv gets the pip
        configuration's environment (certificates, timeout, proxy)."""
        with self.log.open("a") as log:
            log.write(f"$ {shlex.join(argv)}\n")
            log.flush()
            out: int | IO[str] = subprocess.PIPE if capture else log
            try:
                done = run_command(
                    argv,
                    stdout=out,
                    stderr=log,
                    env={**build_env(self.tmp), **self.installer.env},
                    timeout_s=STEP_TIMEOUT_S,
                    stop=self.stop,
                )
            except subprocess.TimeoutExpired:
                raise ProvisionError(f"`{shlex.join(argv)}` did not finish within {STEP_TIMEOUT_S:.0f} s") from None
            except OSError as exc:
                raise ProvisionError(f"`{shlex.join(argv)}` could not run: {exc}") from None
            log.write(f"[exit {done.returncode}]\n")
        if done.returncode != 0:
            raise ProvisionError(f"`{shlex.join(argv)}` failed with exit code {done.returncode}")
        return str(done.stdout) if capture else ""

    def create(self) -> None:
        """Step 1: an empty environment of the wanted Python (with pip in it when pip builds it).

        Both installers start from the same interpreter, found here: uv is never left to fetch one."""
        self.progress(f"create a Python {self.target.python_version} environment with {'uv' if self.uv else 'venv'}")
        base = self._base_python(self.target.recipe.python)
        if self.uv:
            # No --seed: uv installs from outside the environment, which needs no pip of its own.
            # --allow-existing: the directory already holds the build log.
            argv = [self.uv, "venv", "--allow-existing", *self.offline, "--python", base, "--prompt", self.prompt]
            self.run([*argv, str(self.tmp)])
        else:
            self.run([base, "-m", "venv", "--prompt", self.prompt, str(self.tmp)])
        version = self.run([self.python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture=True)
        if version.strip() != self.target.python_version:
            raise ProvisionError(
                f"asked for Python {self.target.python_version}, the environment got Python {version.strip()}"
            )

    def _base_python(self, spec: str) -> str:
        if not spec or spec == THIS_PYTHON:
            return sys.executable
        if MAJOR_MINOR.match(spec):
            # Each python3.X on PATH is asked for its version: a shim that cannot run (pyenv's, exit 127)
            # is passed over and named, and uv is handed the path of one that runs.
            candidates = find_python(f"python{spec}", version=spec)
            if candidates.path is None:
                passed = f" ({candidates.why_not()})" if candidates.passed_over else ""
                raise HostCannotBuild(
                    f"no Python {spec} interpreter on PATH that runs (looked for python{spec}{passed}); install one"
                )
            return candidates.path
        found = resolve_interpreter(spec)
        if found is None:
            raise HostCannotBuild(f"interpreter {spec} is not on this host")
        return found

    @property
    def find_links(self) -> list[str]:
        return ["--find-links", str(self.source.find_links)] if self.source.find_links else []

    def pip_install(self, args: Sequence[str]) -> None:
        """`pip install ARGS` into the environment (by uv with the pip configuration's options, or by pip),
        also from --find-links."""
        args = [*self.find_links, *args]
        if self.uv:
            argv = [self.uv, "pip", "install", "--python", self.python, *self.offline, *self.installer.args, *args]
            self.run(once(argv, _UV_SWITCHES))
        else:
            self.run([self.python, "-m", "pip", "install", "--no-compile", *args])

    def pip_uninstall(self, names: Sequence[str]) -> None:
        if self.uv:
            self.run([self.uv, "pip", "uninstall", "--python", self.python, *self.offline, *names])
        else:
            self.run([self.python, "-m", "pip", "uninstall", "-y", *names])

    def install_locked(self) -> None:
        """Offline: the locked step's files, exactly (checked against the manifest before the build)."""
        assert self.lock is not None and self.current is not None and self.source.find_links is not None
        files = [str(self.source.find_links / f.filename) for f in self.current.install]
        for name in self.current.excluded:
            self.note(f"offline: {name} is provided by the host")
        for name in self.current.omitted:
            self.note(f"offline: {name} is left out (the wheelhouse omits it: not imported here)")
        if files:
            self.pip_install(["--no-index", "--no-deps", *files])
        else:
            self.note("offline: nothing to install in this step")

    @contextmanager
    def wheel_of(self, requirement: str) -> Iterator[WheelFiles]:
        """The files of one pinned distribution's wheel (no dependencies), not installed: the wheelhouse's
        wheel when offline; else downloaded by pip, or unpacked by uv (from its cache) into a scratch
        directory; removed afterwards."""
        if self.lock is not None:
            assert self.current is not None and self.current.source is not None and self.source.find_links
            yield WheelFile(self.source.find_links / self.current.source.filename)
            return
        with fetched_wheel(
            self.run, self.tmp / ".download", requirement, python=self.python, uv=self.uv,
            uv_args=[*self.installer.args, *self.find_links], pip_args=self.find_links,
        ) as wheel:  # fmt: skip
            yield wheel

    def requirements_of(self, step: RequirementsOfStep) -> None:
        """Install what the step's distribution requires here, read from its wheel's METADATA."""
        with self.wheel_of(step.requirement) as wheel:
            metadata = wheel.metadata()
        environment = json.loads(self.run([self.python, "-c", _MARKER_ENV_SCRIPT], capture=True))
        selected = select_requirements(metadata, environment, step.exclude)
        with self.log.open("a") as log:
            for requirement in selected.install:
                log.write(f"requirements_of: install {requirement}\n")
            for requirement, why in selected.skipped:
                log.write(f"requirements_of: skip {requirement} ({why})\n")
        if self.lock is not None:
            self.install_locked()
        elif selected.install or step.also:
            self.pip_install([*selected.install, *step.also])

    @property
    def site_packages(self) -> Path:
        return self.tmp / "lib" / f"python{self.target.python_version}" / "site-packages"

    def note(self, line: str) -> None:
        with self.log.open("a") as log:
            log.write(line + "\n")

    def expose(self, step: ExposeStep) -> None:
        """Link an installed package's file into bin/ (relative, so the link survives the final rename)."""
        source = self.site_packages / step.member
        if not source.is_file():
            raise ProvisionError(f"expose: {step.member} is not in the environment's site-packages")
        link = self.tmp / "bin" / source.name
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(source, link.parent))
        source.chmod(source.stat().st_mode | 0o111)
        self.note(f"expose: bin/{source.name} -> {step.member}")

    def extract(self, step: ExtractStep) -> None:
        """Copy one member of a wheel into bin/ as an executable, without installing the wheel (linked from
        the member kept by an earlier build, `members`; never offline, where the wheelhouse's wheel rules)."""
        target = self.tmp / "bin" / PurePosixPath(step.member).name
        key = member_key(step.requirement, step.member, self.target.python_version, self.target.platform)
        if self.lock is None and link_member(self.target.root, key, target):
            self.note(f"extract: bin/{target.name} linked from the member kept for {step.describe()}")
            return
        with self.wheel_of(step.requirement) as wheel:
            try:
                data = wheel.read(step.member)
            except KeyError:
                raise ProvisionError(f"extract: {wheel.name} has no member {step.member}") from None
        # Never write through a link an earlier step made: that would overwrite an installed package's file.
        target.unlink(missing_ok=True)
        target.write_bytes(data)
        target.chmod(0o755)
        self.note(f"extract: bin/{target.name} from {wheel.name} ({len(data)} bytes)")
        if self.lock is None:
            keep_member(self.target.root, key, target)

    def alias(self, step: AliasStep) -> None:
        """A METADATA-only dist-info that names distribution `of` also `name`, at `of`'s version."""
        found = distribution_versions(self.python, [step.of], build_env(self.tmp)).get(step.of)
        if found is None:
            raise ProvisionError(f"alias: {step.of} is not installed, so {step.name} cannot stand for it")
        version = f"{found}+{step.local}" if step.local else found
        folder = self.site_packages / f"{canonicalize_name(step.name).replace('-', '_')}-{version}.dist-info"
        folder.mkdir(exist_ok=True)
        (folder / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {step.name}\nVersion: {version}\nSummary: matrix alias of {step.of}\n"
        )
        (folder / "INSTALLER").write_text("matrix\n")
        self.note(f"alias: {folder.name} stands for {step.of} {found}")

    def verify(self) -> dict[str, str]:
        """The runtime's components as built; `ProvisionError` unless they are the catalog's versions."""
        env = {**build_env(self.tmp), **self.target.recipe.env}
        try:
            detected = detect(self.python, list(self.runtime.components), env)
        except ProbeError as exc:
            raise ProvisionError(str(exc)) from None
        problems = mismatches(self.runtime.components, detected, "venv")
        if problems:
            raise ProvisionError(f"the built environment does not match the catalog: {'; '.join(problems)}")
        return dict(detected.versions)

    def freeze(self) -> list[str]:
        """`pip freeze` of the environment, recorded in env.json."""
        if self.uv:
            text = self.run([self.uv, "pip", "freeze", "--python", self.python], capture=True)
        else:
            text = self.run([self.python, "-m", "pip", "freeze", "--all"], capture=True)
        return [line for line in text.splitlines() if line.strip()]

    def load_lock(self) -> dict[str, Any]:
        """Offline: this recipe's lock in the wheelhouse, its files checked, before anything is built; what
        env.json records about the source. `ConfigError` naming what is missing and the command making it."""
        directory = self.source.find_links
        if not self.source.offline or directory is None:
            return {"find_links": str(directory)} if directory else {}
        manifest = self.source.manifest()
        remake = wheelhouse_command(
            self.runtime.backend, self.runtime.version, self.target.python_version, this_host().platforms[0], directory
        )
        lock = manifest.lock_for(self.target.recipe_key)
        if lock is None or len(lock.steps) != len(self.target.recipe.steps):
            why = (
                "its lock there was made for another recipe or target"
                if self.runtime.label in manifest.runtimes
                else "it has no lock of this runtime"
            )
            raise ConfigError(
                f"wheelhouse {directory} cannot build {self.runtime.label} for Python {self.target.python_version} "
                f"{self.target.platform} (recipe key {self.target.name}): {why}; make it with `{remake}`"
            )
        check_files(directory, lock.files(), remake)
        if lock.excluded and self.target.python_version != THIS_PYTHON:
            raise ConfigError(
                f"the wheelhouse leaves {', '.join(lock.excluded)} to the host, but {self.runtime.label} runs Python "
                f"{self.target.python_version} and matrix runs Python {THIS_PYTHON}: the host's packages would not "
                "fit; make the wheelhouse without --exclude"
            )
        self.lock = lock
        return {"wheelhouse": str(directory), "manifest_sha256": manifest_digest(directory)}

    def add_host_site(self) -> dict[str, str]:
        """Offline with distributions left to the host: this interpreter's site-packages go after the
        environment's own (its copies win), and the host must really have them; name -> version there."""
        assert self.lock is not None
        # Written after every step: seen earlier, the host's copies would make pip skip the environment's own.
        directories = [d for d in site.getsitepackages() if os.path.isdir(d)]
        (self.site_packages / HOST_SITE_PTH).write_text("".join(f"{d}\n" for d in directories))
        self.note(f"offline: host site-packages after the environment's own: {', '.join(directories)}")
        try:
            found = distribution_versions(self.python, list(self.lock.excluded), build_env(self.tmp))
        except ProbeError as exc:
            raise ProvisionError(str(exc)) from None
        missing = sorted(name for name, version in found.items() if version is None)
        if missing:
            raise ConfigError(
                f"the wheelhouse leaves {', '.join(missing)} to the host (--exclude), but {sys.executable} has "
                f"no such distribution in {', '.join(directories) or 'its site-packages'}: install it there, or make "
                "the wheelhouse without excluding it"
            )
        provided = {name: str(version) for name, version in found.items()}
        self.note("offline: provided by the host: " + ", ".join(f"{n} {v}" for n, v in sorted(provided.items())))
        return provided

    def build(self) -> dict[str, Any]:
        """Every step, in the temporary directory; returns the env.json written there."""
        source = self.load_lock()
        self.tmp.mkdir(parents=True)
        self.log.write_text(f"# {self.target.label}: {self.target.recipe.summary()}\n")
        if self.lock is not None:
            self.note(f"# offline from wheelhouse {source['wheelhouse']} (manifest sha256 {source['manifest_sha256']})")
        self.create()
        for index, step in enumerate(self.target.recipe.steps):
            self.current = self.lock.steps[index] if self.lock else None
            self.progress(step.describe())
            if isinstance(step, PipStep):
                if self.lock is not None:
                    self.install_locked()
                else:
                    self.pip_install(step.args)
            elif isinstance(step, UninstallStep):
                self.pip_uninstall(step.names)
            elif isinstance(step, ExposeStep):
                self.expose(step)
            elif isinstance(step, ExtractStep):
                self.extract(step)
            elif isinstance(step, AliasStep):
                self.alias(step)
            elif isinstance(step, PluginStep):
                # Copied out first: building in place would leave build/ and *.egg-info in the package.
                path = self.tmp / ".plugin" / step.name
                shutil.copytree(plugin_path(step.name), path)
                # Offline, pip's isolated build takes the build backend from the wheelhouse (--find-links).
                self.pip_install([*(["--no-index"] if self.lock else []), "--no-deps", str(path)])
                shutil.rmtree(path.parent)
            else:
                self.requirements_of(step)
        # Before the host's site-packages are added: the freeze lists what the environment itself holds.
        freeze = self.freeze()
        if self.lock is not None and self.lock.excluded:
            source["from_host"] = self.add_host_site()
        if self.lock is not None and self.lock.omitted:
            source["omitted"] = list(self.lock.omitted)
        self.progress("verify components and finish")
        components = self.verify()
        relocate(self.tmp, self.target.path, self.site_packages)
        info = {
            "key": self.target.key,
            "name": self.target.name,
            "recipe": {
                "python": self.target.recipe.python,
                "steps": [s.canonical() for s in self.target.recipe.steps],
                "summary": self.target.recipe.summary(),
            },
            "python_version": self.target.python_version,
            "platform": self.target.platform,
            "created": now(),
            "created_for": self.target.label,
            "tool": self.installer.name,
            "installer": self.installer.name,
            "build_s": round(time.monotonic() - self.started, 1),
            "components": components,
            "freeze": freeze,
            "size_bytes": 0,
        }
        if source:
            info["source"] = source
        info["size_bytes"] = tree_size(self.tmp)
        (self.tmp / INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
        return info
