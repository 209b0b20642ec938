"""Images for the `container` provider, made here without a registry.

* `build_base_image`: a Debian root filesystem from Debian packages (`mmdebstrap`), turned into an image
  by `docker import`. It holds Debian's Python and CA certificates, nothing else.
* `build_runtime_image`: a runtime's built environment copied into a base image at the very path it has
  on this host (a venv is not relocatable: its scripts and `pyvenv.cfg` name that path), together with
  the interpreter it was made from when the base image lacks it. The components are then checked inside
  the new image, by the same probe the `container` provider runs before a cell, and the image is labelled
  with the runtime, its recipe key and what the check found.

What the image holds is therefore exactly what the `venv` cells of that runtime ran, which is what makes a
container cell comparable with the venv cell of the same runtime.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from matrix.cells import RuntimeInfo
from matrix.errors import ConfigError, MatrixError
from matrix.launch.providers.base import Environment, Mismatch, Unavailable
from matrix.launch.providers.container import (
    COMPONENTS_LABEL,
    PYTHON_LABEL,
    RECIPE_LABEL,
    RUNTIME_LABEL,
    check_image_components,
    default_engine,
    engine_problem,
    engine_run,
)
from matrix.text import excerpt

Echo = Callable[[str], None]

BASE_SUITE = "bookworm"
# Debian's Python and CA certificates, and the shared libraries engine wheels load from the system rather
# than bundle: vLLM CPU's kernels need libnuma (without it `vllm._C` fails to import and the engine never
# gets ready), PyTorch CPU builds libgomp.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "libnuma1", "libgomp1")
DEFAULT_BASE_TAG = "matrix-base:bookworm"
BUILD_TIMEOUT_S = 1800.0
INSPECT_S = 30.0
# The PATH of a Debian image: what the environment's own bin directory is put in front of.
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# apt's deb822 sources of this host: mmdebstrap reads them on stdin (the host's mirror and keyring choice).
HOST_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")


class ImageError(MatrixError):
    """An image could not be built (the engine, mmdebstrap or the copy failed)."""

    exit_code = 1


@dataclass(frozen=True)
class RuntimeImage:
    """What `build_runtime_image` made: the tag, the provider entry of a container runtime running it."""

    tag: str
    provider: Mapping[str, object]
    components: Mapping[str, str]
    recipe_key: str
    copied: tuple[str, ...]
    bytes_copied: int



def _engine(engine: str | None) -> str:
    chosen = engine or default_engine()
    if chosen is None:
        raise ConfigError("no container engine (docker or podman) on this host: install docker.io")
    problem = engine_problem(chosen, use_cache=False)
    if problem is not None:
        raise ConfigError(f"{problem}; start it (or set DOCKER_HOST to a running one) and retry")
    return chosen


def _run(argv: Sequence[str], *, what: str, timeout: float = BUILD_TIMEOUT_S, stdin: int | None = None) -> str:
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False,
            stdin=subprocess.DEVNULL if stdin is None else stdin,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ImageError(f"{what} did not finish within {timeout:.0f} s") from None
    except OSError as exc:
        raise ImageError(f"{what} could not run: {exc}") from None
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()]
        raise ImageError(f"{what} failed (exit {done.returncode}): {lines[-1] if lines else 'no output'}")
    return done.stdout


def build_base_image(
    tag: str = DEFAULT_BASE_TAG, *, suite: str = BASE_SUITE, engine: str | None = None, echo: Echo = print
) -> str:
    """Make a base image from Debian packages with mmdebstrap and import it as `tag`; its image id."""
    engine = _engine(engine)
    mmdebstrap = shutil.which("mmdebstrap")
    if mmdebstrap is None:
        raise ConfigError("mmdebstrap is not installed: `apt-get install mmdebstrap` (it builds the base image)")
    with tempfile.TemporaryDirectory(prefix="matrix-base-") as scratch:
        rootfs = Path(scratch) / "rootfs.tar"
        argv = [mmdebstrap, "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", suite, str(rootfs)]
        echo(f"building a Debian {suite} root filesystem with mmdebstrap ({', '.join(BASE_PACKAGES)})")
        if HOST_SOURCES.is_file():
            with HOST_SOURCES.open("rb") as sources:
                _run(argv, what="mmdebstrap", stdin=sources.fileno())
        else:
            _run(argv, what="mmdebstrap")
        echo(f"importing {rootfs.stat().st_size / 2**20:.0f} MiB as {tag}")
        changes = ["--change", 'CMD ["/bin/bash"]', "--change", f"LABEL matrix.base={suite}"]
        image_id = _run([engine, "import", *changes, str(rootfs), tag], what=f"{engine} import").strip()
    return image_id


def _interpreter_home(python: Path) -> Path | None:
    """The installation the environment's interpreter comes from, when the base image cannot have it.

    A venv's `pyvenv.cfg` names the directory of its base interpreter (`home`); one under /usr is Debian's,
    which a Debian base image of the same release ships itself.
    """
    cfg = python.parent.parent / "pyvenv.cfg"
    home = None
    try:
        for line in cfg.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home":
                home = Path(value.strip())
    except OSError:
        return None
    if home is None:
        return None
    real = Path(os.path.realpath(home))
    if real.parts[:2] == ("/", "usr"):
        return None
    return real.parent if real.name == "bin" else real


@dataclass(frozen=True)
class Payload:
    """What goes into the image: directories under `root` (relative), minus `exclude` patterns."""

    root: Path
    paths: tuple[str, ...]
    exclude: tuple[str, ...]
    python: str
    env: Mapping[str, str]


def _venv_payload(environment: Environment) -> Payload:
    venv = Path(environment.python).parent.parent
    env = {k: v for k, v in environment.env.items() if k != "PATH"}
    env["PATH"] = f"{venv / 'bin'}:{IMAGE_PATH}"
    paths, exclude = [venv], []
    home = _interpreter_home(Path(environment.python))
    if home is not None:
        paths.append(home)
        # A venv never reads its base interpreter's own site-packages (nor runs its test suite).
        rel = home.relative_to("/")
        exclude += [f"{rel}/lib/python*/site-packages", f"{rel}/lib/python*/test"]
    return Payload(Path("/"), tuple(str(p.relative_to("/")) for p in paths), tuple(exclude), environment.python, env)


# Where the reference server's package lands in the image, run by the image's own Debian Python.
REFERENCE_ROOT = "opt/matrix-reference"


def _reference_payload(environment: Environment, staging: Path) -> Payload:
    """The reference server is matrix's own package, on the standard library alone: the package and a
    distribution record `matrix-reference` of its version, so the component probe finds it as it finds
    any distribution."""
    from matrix import __version__

    target = staging / REFERENCE_ROOT
    shutil.copytree(Path(__file__).resolve().parents[2], target / "matrix",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))  # fmt: skip
    info = target / f"matrix_reference-{__version__}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: matrix-reference\nVersion: {__version__}\n")
    env = {**environment.env, "PYTHONPATH": f"/{REFERENCE_ROOT}", "PATH": IMAGE_PATH}
    return Payload(staging, (REFERENCE_ROOT,), (), "python3", env)


def _payload(runtime: RuntimeInfo, environment: Environment, staging: Path) -> Payload:
    if environment.container is not None:
        raise ConfigError(f"runtime {runtime.label} already runs in an image ({environment.container.image})")
    kind = runtime.provider.get("kind", "host")
    if kind == "venv":
        return _venv_payload(environment)
    if kind == "builtin":
        return _reference_payload(environment, staging)
    raise ConfigError(
        f"runtime {runtime.label} has provider kind {kind!r}: images are made from venv runtimes (built by "
        "`matrix runtime provision`) and from the builtin reference"
    )


def _tree_bytes(payload: Payload) -> int:
    total = 0
    for rel in payload.paths:
        for directory, _, files in os.walk(payload.root / rel):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(directory, name)).st_size
    return total


def build_runtime_image(
    runtime: RuntimeInfo,
    environment: Environment,
    *,
    base: str,
    tag: str,
    recipe_key: str,
    engine: str | None = None,
    echo: Echo = print,
) -> RuntimeImage:
    """Copy the runtime's built environment into `base`, check its components inside, tag it `tag`."""
    engine = _engine(engine)
    code, _, _ = engine_run([engine, "image", "inspect", base], INSPECT_S)
    if code != 0:
        raise ConfigError(f"base image {base} is not on this host: make it with `matrix runtime base-image`")
    with tempfile.TemporaryDirectory(prefix="matrix-image-") as staging:
        payload = _payload(runtime, environment, Path(staging))
        size = _tree_bytes(payload)
        where = ", ".join(f"/{p}" for p in payload.paths)
        echo(f"copying {size / 2**20:.0f} MiB ({where}) and {base} into one image layer")
        scratch = _import_with(engine, base, payload)
    echo("checking the components inside the image")
    try:
        found = check_image_components(engine, scratch, payload.python, payload.env, runtime.components)
        if isinstance(found, Unavailable):
            kind = "do not match" if isinstance(found, Mismatch) else "could not be checked"
            raise ImageError(f"the components of {runtime.label} in the image {kind}: {found.reason}")
        labels = {
            RUNTIME_LABEL: runtime.label,
            RECIPE_LABEL: recipe_key,
            COMPONENTS_LABEL: json.dumps(dict(found), sort_keys=True),
            PYTHON_LABEL: payload.python,
        }
        dockerfile = f"FROM {scratch}\n" + "".join(f"LABEL {k}={json.dumps(v)}\n" for k, v in labels.items())
        _build_from_stdin(engine, tag, dockerfile)
    finally:
        # The tag now holds the layers; untagging the intermediate commit frees nothing but its name.
        subprocess.run([engine, "rmi", scratch], capture_output=True, timeout=60, check=False)
    provider: dict[str, object] = {"kind": "container", "image": tag, "python": payload.python,
                                   "env": dict(payload.env)}  # fmt: skip
    if engine != "docker":
        provider["engine"] = engine
    return RuntimeImage(tag, provider, dict(found), recipe_key, tuple(f"/{p}" for p in payload.paths), size)


def _excluded(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, f"{p}/*") for p in patterns)


def _import_with(engine: str, base: str, payload: Payload) -> str:
    """One `docker import` of the base image's files followed by the payload's: the image's id.

    One stream, written once by the daemon: copying into a container and committing it would write the
    several GiB of an engine's environment three times (copy, commit, removal of the container).
    """
    container = _run([engine, "create", base, "true"], what=f"{engine} create {base}", timeout=60).strip()
    try:
        exporter = subprocess.Popen([engine, "export", container], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        importer = subprocess.Popen(
            [engine, "import", "--change", 'CMD ["/bin/bash"]', "-"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert exporter.stdout is not None and importer.stdin is not None
        try:
            _stream(exporter.stdout, importer.stdin, payload)
        except (OSError, tarfile.TarError) as exc:
            exporter.kill()
            importer.kill()
            raise ImageError(f"copying into the image failed: {exc}") from None
        finally:
            importer.stdin.close()
            importer.stdin = None  # closed: end of the stream (communicate would flush it)
        out, err = importer.communicate(timeout=BUILD_TIMEOUT_S)
        _, export_err = exporter.communicate(timeout=60)
    finally:
        subprocess.run([engine, "rm", "--force", container], capture_output=True, timeout=120, check=False)
    if exporter.returncode != 0:
        said = excerpt(export_err.decode(errors="replace").strip(), 300, end=True)
        raise ImageError(f"{engine} export of {base} failed: {said}")
    if importer.returncode != 0:
        raise ImageError(f"{engine} import failed: {excerpt(err.decode(errors='replace').strip(), 300, end=True)}")
    return out.decode().strip()


def _stream(source: IO[bytes], sink: IO[bytes], payload: Payload) -> None:
    # 1 MiB copies: the 16 KiB default costs a system call per 16 KiB of several GiB.
    with tarfile.open(fileobj=source, mode="r|") as base, tarfile.open(fileobj=sink, mode="w|") as out:
        out.copybufsize = 1 << 20  # type: ignore[attr-defined]  # an attribute CPython's addfile reads
        for member in base:
            out.addfile(member, base.extractfile(member) if member.isreg() else None)

        def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
            return None if _excluded(info.name, payload.exclude) else info

        for rel in payload.paths:
            out.add(str(payload.root / rel), arcname=rel, filter=keep)


def _build_from_stdin(engine: str, tag: str, dockerfile: str) -> None:
    try:
        done = subprocess.run(
            [engine, "build", "--quiet", "--tag", tag, "-"], input=dockerfile, capture_output=True, text=True,
            timeout=300, check=False, env={**os.environ, "DOCKER_BUILDKIT": "0"},
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ImageError(f"{engine} build of {tag} could not finish: {exc}") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise ImageError(f"{engine} build of {tag} failed: {lines[-1] if lines else 'no output'}")


def image_labels(engine: str, image: str) -> dict[str, str]:
    """The labels of a local image ({} when it has none or is not here)."""
    try:
        done = subprocess.run(
            [engine, "image", "inspect", "--format", "{{json .Config.Labels}}", image],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {}
    try:
        labels = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}
