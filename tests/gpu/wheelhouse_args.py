"""Derive the `matrix runtime wheelhouse` arguments for a GPU host from that host's package list.

    python tests/gpu/wheelhouse_args.py derive --family vllm|sglang|vllm-new|sglang-new
                                               [--image tests/gpu/image-h200-packages.txt]
        resolve every step of the family's GPU runtimes for the host (Python 3.12, manylinux_2_39_x86_64;
        no download), compare each locked distribution with the host's `pip list --format=freeze`, and
        write tests/gpu/wheelhouse-FAMILY.args (one argument per line, read by the GPU scripts) and
        print why each name is excluded or omitted.

    matrix runtime wheelhouse $(grep -v '^#' tests/gpu/wheelhouse-vllm.args) --out WH
        what the GPU scripts' docs say to run with the file.

    python tests/gpu/wheelhouse_args.py build -- ARGS...
        exactly `matrix runtime wheelhouse ARGS...` (the same command, in this process), after resolving the
        selected runtimes' steps with pip in parallel, one thread per runtime (pip's resolution is CPU-bound
        and a loaded 2-core host runs one runtime's steps for minutes); the command then reads every
        resolution from that memo, so its lock and downloads are the ones it would have made alone.

The rules (the same for every family):
  --exclude NAME  the host has NAME at exactly the locked version; or NAME is one of the CUDA user-space
                  libraries (nvidia-*, cuda-*) the host has in the same major version as the lock (the
                  CUDA 13 libraries keep their ABI within a major release; torch loads them by soname),
                  except NCCL, whose 2.28/2.29 versions differ in what torch 2.13 calls, so it travels;
                  or NAME is in KEEP_HOST (numba/llvmlite: the host's pair works together and vLLM only
                  imports numba for an optional n-gram speculator).
  --omit NAME     NAME is in tests/gpu/omit-FAMILY.txt (each line says why the runtime never imports it on
                  this host); a name there that the lock does not have is reported and ignored.
Everything else (torch 2.13.0, triton, NCCL, the engines, Dynamo, NIXL...) is downloaded.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import Version

from matrix.catalog.template import render
from matrix.cells import RuntimeInfo
from matrix.launch.providers.venv.installer import find_uv
from matrix.launch.providers.wheelresolve import PlannedRuntime, plan_runtime
from matrix.launch.providers.wheeltarget import WheelTarget

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PYTHON = "3.12"
PLATFORM = "manylinux_2_39_x86_64"
# family -> (backend, versions). The seed families are runtimes of data/runtimes.toml; the "-new" ones are the
# releases after them (catalogued too since [M31]; `matrix discover` makes the same runtimes from the backend's
# runtime_template, data/backends.toml): derive renders them from that template, so their wheelhouse comes from
# the repository alone. A family's
# omit list is tests/gpu/omit-BACKEND.txt.
FAMILIES = {
    "vllm": ("vllm", ["0.29.0", "0.30.0", "0.31.0"]),
    "sglang": ("sglang", ["0.5.18", "0.5.19", "0.5.21"]),
    "vllm-new": ("vllm", ["0.32.0", "0.33.0", "0.34.0"]),
    "sglang-new": ("sglang", ["0.5.22", "0.5.23"]),
}
KEEP_HOST = {"numba", "llvmlite"}
TRAVELS = {"nvidia-nccl-cu13"}


def _image(path: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            found[canonicalize_name(name)] = version.strip()
    return found


def _omit_list(path: Path) -> dict[str, str]:
    reasons: dict[str, str] = {}
    for line in path.read_text().splitlines():
        body, _, why = line.partition("#")
        if body.strip():
            reasons[canonicalize_name(body.strip())] = why.strip()
    return reasons


def _runtimes(backend: str, versions: list[str]) -> list[RuntimeInfo]:
    """The catalog's runtime of each version, else the one `matrix discover` would add from the template."""
    entries = tomllib.loads((ROOT / "data" / "runtimes.toml").read_text())["runtime"]
    catalogued = {e["version"]: e for e in entries if e["backend"] == backend}
    backends = tomllib.loads((ROOT / "data" / "backends.toml").read_text())["backend"]
    template = next(b for b in backends if b["name"] == backend).get("runtime_template")
    chosen = []
    for version in versions:
        if version in catalogued:
            provider, components = catalogued[version]["provider"], catalogued[version].get("components", {})
        elif template is not None:
            provider, components, _notes = render(template, version, f"backend {backend}")
        else:
            raise SystemExit(f"{backend} {version}: not in data/runtimes.toml and the backend has no runtime_template")
        chosen.append(RuntimeInfo(backend, version, "v" + version, provider=provider, components=components))
    return chosen


def _cuda_library(name: str) -> bool:
    return name.startswith(("nvidia-", "cuda-")) and name not in TRAVELS


def _upload(planned: PlannedRuntime, left_out: set[str]) -> dict[str, int | None]:
    """The files the runtime's wheelhouse carries (filename -> bytes, None where the lock gives no size):
    what each step installs less what is excluded or omitted, plus the wheels a step reads (the source of
    `requirements_of` and `extract`, build requirements), as `matrix runtime wheelhouse` downloads them."""
    files: dict[str, int | None] = {}
    for step in planned.steps:
        for item in step.downloads():
            if item not in step.install or item.canonical not in left_out:
                files[item.filename] = item.size
    return files


def _fill_sizes(plans: list[PlannedRuntime]) -> dict[str, int]:
    """Sizes the lock lacks (uv gives none for a wheel of a local index or find-links directory, which
    pip's configuration may name besides PyPI), asked of the file itself: `stat` for a file URL, the
    Content-Length of a HEAD request otherwise; filename -> bytes, for what could be asked."""
    found: dict[str, int] = {}
    for item in {i.filename: i for p in plans for s in p.steps for i in s.downloads() if i.size is None}.values():
        parts = urllib.parse.urlsplit(item.url)
        try:
            if parts.scheme == "file":
                found[item.filename] = Path(urllib.request.url2pathname(parts.path)).stat().st_size
            else:
                request = urllib.request.Request(item.url, method="HEAD")
                with urllib.request.urlopen(request, timeout=60) as answer:
                    found[item.filename] = int(answer.headers["Content-Length"])
        except (OSError, TypeError, ValueError) as exc:
            print(f"# no size for {item.filename}: {exc}", file=sys.stderr)
    return found


def _weight(files: dict[str, int | None]) -> str:
    known = sum(size for size in files.values() if size is not None)
    unknown = sum(1 for size in files.values() if size is None)
    return f"{len(files)} files, {known / 2**20:.0f} MiB" + (f" (+{unknown} without a size)" if unknown else "")


def derive(family: str, image_path: Path) -> int:
    backend, versions = FAMILIES[family]
    image = _image(image_path)
    omit_path = HERE / f"omit-{backend}.txt"
    omit = _omit_list(omit_path)
    target = WheelTarget.of(PYTHON, (PLATFORM,))
    locked: dict[str, set[str]] = {}
    runtimes = _runtimes(backend, versions)
    # Found once before the threads start: the first sysconfig lookup (uv's finder makes one) is not safe
    # to race, and three threads at once failed on it.
    find_uv()
    # One thread per runtime: each step is a `uv pip compile` child process, so they overlap.
    with ThreadPoolExecutor(len(runtimes) or 1) as pool:
        plans = list(pool.map(lambda r: plan_runtime(r, target, (), lambda line: print(line, file=sys.stderr)),
                              runtimes))  # fmt: skip
    for planned in plans:
        for step in planned.steps:
            for item in step.install:
                locked.setdefault(item.canonical, set()).add(item.version)
    exclude: dict[str, str] = {}
    for name, found in sorted(locked.items()):
        have = image.get(name)
        if have is None or name in omit:
            continue
        if found == {have}:
            exclude[name] = f"host has {have} = locked"
        elif name in KEEP_HOST:
            exclude[name] = f"host's {have} kept (locked {', '.join(sorted(found))})"
        elif _cuda_library(name) and {Version(v).major for v in found} == {Version(have).major}:
            exclude[name] = f"CUDA library, host {have}, locked {', '.join(sorted(found))}: same major"
    omitted = {name: why for name, why in omit.items() if name in locked}
    for name in sorted(set(omit) - set(locked)):
        print(f"# omit list names {name}, which no lock has: ignored", file=sys.stderr)
    left_out = set(exclude) | set(omitted)
    asked = _fill_sizes(plans)
    sizes = {
        label: {name: size if size is not None else asked.get(name) for name, size in _upload(plan, left_out).items()}
        for label, plan in zip(versions, plans, strict=True)
    }
    union: dict[str, int | None] = {name: size for files in sizes.values() for name, size in files.items()}
    lines = [
        f"# matrix runtime wheelhouse arguments for the {family} GPU runtimes, derived by",
        f"# `python tests/gpu/wheelhouse_args.py derive --family {family}` from {image_path.name}",
        f"# ({len(locked)} locked distributions; {len(exclude)} excluded, {len(omitted)} omitted: "
        f"tests/gpu/{omit_path.name} says why).",
        f"# The upload, from the lock's sizes: {_weight(union)}; per runtime: "
        + "; ".join(f"{backend}={v} {_weight(files)}" for v, files in sizes.items())
        + ".",
        *(f"--runtime\n{backend}={v}" for v in versions),
        f"--python\n{PYTHON}\n--platform\n{PLATFORM}",
        *(f"--exclude\n{name}" for name in exclude),
        *(f"--omit\n{name}" for name in omitted),
    ]
    out = HERE / f"wheelhouse-{family}.args"
    out.write_text("\n".join(lines) + "\n")
    for name, why in exclude.items():
        print(f"exclude {name}: {why}")
    for name, why in omitted.items():
        print(f"omit    {name}: {why}")
    carried = sorted(set(locked) - set(exclude) - set(omitted))
    print(f"carried ({len(carried)}): {' '.join(carried)}")
    for version, files in sizes.items():
        print(f"upload {backend}={version}: {_weight(files)}")
    print(f"upload, all {len(versions)} runtime(s) in one wheelhouse: {_weight(union)}")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


def build(argv: list[str]) -> int:
    import threading
    from concurrent.futures import Future, ThreadPoolExecutor

    import click

    from matrix.cli import cli
    from matrix.cli.app import App
    from matrix.cli.runtime import catalog_view
    from matrix.launch.providers import wheelresolve

    real = wheelresolve.uv_report
    memo: dict[str, Future[list[wheelresolve.Resolved]]] = {}
    lock = threading.Lock()
    # A loaded host needs more than the default resolution timeout for vLLM's first step.
    wheelresolve.RESOLVE_TIMEOUT_S = 3600.0

    def remembered(args, target, constraints={}, *, what=""):  # type: ignore[no-untyped-def]
        key = repr((list(args), target, sorted(dict(constraints).items())))
        with lock:
            mine = key not in memo
            if mine:
                memo[key] = Future()
            future = memo[key]
        if mine:  # the first asker resolves; the same question from another runtime waits for its answer
            try:
                future.set_result(real(args, target, constraints, what=what))
            except BaseException as exc:
                future.set_exception(exc)
        return future.result()

    wheelresolve.uv_report = remembered  # type: ignore[assignment]
    wanted = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--runtime"]
    python = argv[argv.index("--python") + 1]
    platforms = tuple(argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--platform")
    target = WheelTarget.of(python, platforms)
    _cases, runtimes, _markers, _backends = catalog_view(App(None))
    chosen = [r for r in runtimes if f"{r.backend}={r.version}" in wanted]
    print(f"resolving {len(chosen)} runtime(s) in parallel: {', '.join(r.label for r in chosen)}", file=sys.stderr)
    find_uv()  # before the threads, as in derive
    with ThreadPoolExecutor(len(chosen) or 1) as pool:
        list(pool.map(lambda r: plan_runtime(r, target, (), lambda line: print(line, file=sys.stderr)), chosen))
    try:
        cli.main(["runtime", "wheelhouse", *argv], prog_name="matrix", standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        return 2
    return 0


def main() -> int:
    if sys.argv[1:2] == ["build"]:
        rest = sys.argv[2:]
        return build(rest[1:] if rest[:1] == ["--"] else rest)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("derive")
    run.add_argument("--family", choices=sorted(FAMILIES), required=True)
    run.add_argument("--image", type=Path, default=HERE / "image-h200-packages.txt")
    args = parser.parse_args()
    return derive(args.family, args.image)


if __name__ == "__main__":
    sys.exit(main())
