"""Benchmark: locking the three vLLM GPU runtimes of the seed catalog for a wheelhouse, pip vs uv.

The lock is the resolution `matrix runtime wheelhouse` does before it downloads anything: every step of each
recipe resolved for Python 3.12 on manylinux_2_39_x86_64 (`plan_runtime`). pip's side is the code before
uv (pip's `install --dry-run --report` with the target-marker patch), taken from a git revision of this
repository (`--pip-rev`); uv's side is this tree (`uv pip compile` for the target). Each side runs in a
process of its own with an empty cache of its own (cold), then again with that cache (warm), in the order
uv, pip, pip, uv, so a drifting load on the shared host hits both alike. Nothing is downloaded.

Run: python tests/bench/bench_wheelhouse_lock.py [--pip-rev REV] [--runtime vllm=0.29.0 ...] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# Runs in the side's own process, with that side's matrix first on sys.path.
LOCK = """
import json, sys, time, tomllib
from pathlib import Path
from matrix.launch.providers.wheelresolve import plan_runtime
from matrix.launch.providers.wheeltarget import WheelTarget
try:
    from matrix.cells import RuntimeInfo
except ImportError:  # a revision before the core types left matrix.plan
    from matrix.plan import RuntimeInfo
specs = json.loads(sys.argv[1])
entries = tomllib.loads(Path(sys.argv[2]).read_text())["runtime"]
target = WheelTarget.of("3.12", ["manylinux_2_39_x86_64"])
found = {}
started = time.monotonic()
for spec in specs:
    backend, version = spec.split("=", 1)
    (entry,) = [e for e in entries if e["backend"] == backend and e["version"] == version]
    runtime = RuntimeInfo(backend=backend, version=version, tag="v" + version, provider=entry["provider"])
    planned = plan_runtime(runtime, target, [], lambda line: None)
    found[spec] = sorted({f"{r.canonical}=={r.version}" for s in planned.steps for r in s.install})
import matrix
print(json.dumps(matrix.__file__))
print(json.dumps({"seconds": time.monotonic() - started, "locked": found}))
"""


def side_root(rev: str, scratch: Path) -> Path:
    """The matrix package of git revision `rev`, unpacked under `scratch`."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "matrix"], capture_output=True, check=True)
    root = scratch / f"rev-{rev}"
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(root, filter="data")
    return root


def lock(root: Path, specs: list[str], cache: Path, installer: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(root), "UV_CACHE_DIR" if installer == "uv" else "PIP_CACHE_DIR": str(cache)}
    started = time.monotonic()
    # cwd: not this repository, whose matrix/ `python -c` would put first on sys.path for both sides.
    done = subprocess.run([sys.executable, "-c", LOCK, json.dumps(specs), str(REPO / "data" / "runtimes.toml")],
                          env=env, capture_output=True, text=True, check=False, timeout=3600,
                          cwd=cache.parent)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{installer} lock failed:\n{done.stderr[-3000:]}")
    lines = done.stdout.strip().splitlines()
    result: dict[str, object] = json.loads(lines[-1])
    result["matrix"] = json.loads(lines[-2])  # which tree's matrix ran
    result["wall"] = time.monotonic() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pip-rev", default="53387eb", help="a revision whose wheelhouse lock is pip's")
    parser.add_argument("--runtime", action="append", help="BACKEND=VERSION (repeatable)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    specs = args.runtime or ["vllm=0.29.0", "vllm=0.30.0", "vllm=0.31.0"]
    scratch = Path(tempfile.mkdtemp(prefix="matrix-bench-lock-"))
    from tests.bench.results import append_section

    roots = {"pip": side_root(args.pip_rev, scratch), "uv": REPO}
    caches = {name: Path(tempfile.mkdtemp(prefix=f"cache-{name}-", dir=scratch)) for name in roots}
    seconds: dict[tuple[str, str], float] = {}
    locked: dict[str, dict[str, list[str]]] = {}
    try:
        for installer, temperature in (("uv", "cold"), ("pip", "cold"), ("pip", "warm"), ("uv", "warm")):
            result = lock(roots[installer], specs, caches[installer], installer)
            seconds[(installer, temperature)] = float(result["wall"])  # type: ignore[arg-type]
            locked[installer] = result["locked"]  # type: ignore[assignment]
            print(f"{installer} {temperature}: {result['wall']:.1f} s ({result['matrix']})", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    lines = [
        f"\n## Wheelhouse lock of {', '.join(specs)}: pip vs uv (tests/bench/bench_wheelhouse_lock.py, "
        f"{dt.date.today().isoformat()}, 2 cores)\n\n",
        f"Python 3.12, manylinux_2_39_x86_64, resolution only (nothing downloaded); pip = revision {args.pip_rev}, "
        "uv = this tree; order uv, pip, pip, uv; one process each, wall seconds.\n\n",
        "| cache | pip s | uv s | pip / uv |\n|---|---:|---:|---:|\n",
    ]
    for temperature in ("cold", "warm"):
        pip_s, uv_s = seconds[("pip", temperature)], seconds[("uv", temperature)]
        lines.append(f"| {temperature} | {pip_s:.1f} | {uv_s:.1f} | {pip_s / uv_s:.1f} |\n")
    lines.append("\nWhat each locked (distributions a step installs, over all steps):\n\n")
    for spec in specs:
        by_pip, by_uv = set(locked["pip"][spec]), set(locked["uv"][spec])
        lines.append(f"- {spec}: {len(by_pip)} with pip, {len(by_uv)} with uv; only pip: "
                     f"{', '.join(sorted(by_pip - by_uv)) or 'none'}; only uv: "
                     f"{', '.join(sorted(by_uv - by_pip)) or 'none'}\n")  # fmt: skip
    report = "".join(lines)
    print(report)
    if not args.no_write:
        append_section(report)


if __name__ == "__main__":
    main()
