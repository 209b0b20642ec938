"""Benchmark: locking the three vLLM GPU runtimes of the seed catalog for a wheelhouse, side by side.

The lock is the resolution `matrix runtime wheelhouse` does before it downloads anything: every step of each
recipe resolved for Python 3.12 on manylinux_2_39_x86_64 (`plan_runtime`). Each side is this repository's
matrix package at one git revision (`tree` = the working tree): by default `pip` = 53387eb (pip's
`install --dry-run --report` with the target-marker patch), `uv-sequential` = 1a784cb (uv, one step after
the other) and `uv` = this tree (uv, runtimes and independent steps at once). Per round, each side runs in a
process of its own with an empty cache of its own (cold), then again with that cache (warm); the order of the
sides alternates between rounds so a drifting load on the shared host hits all alike; medians, and each
side's ratio to the last. Nothing is downloaded.

Run: python tests/bench/bench_wheelhouse_lock.py [--side NAME=REV ...] [--rounds 3] [--runtime vllm=0.29.0 ...]
     [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
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
runtimes = []
for spec in specs:
    backend, version = spec.split("=", 1)
    (entry,) = [e for e in entries if e["backend"] == backend and e["version"] == version]
    runtimes.append(RuntimeInfo(backend=backend, version=version, tag="v" + version, provider=entry["provider"]))
started = time.monotonic()
try:
    from matrix.launch.providers.wheelresolve import plan_runtimes
    plans = plan_runtimes(runtimes, target, [], lambda line: None)
except ImportError:  # a revision that locks one runtime after the other
    plans = [plan_runtime(runtime, target, [], lambda line: None) for runtime in runtimes]
found = {spec: sorted({f"{r.canonical}=={r.version}" for s in p.steps for r in s.install})
         for spec, p in zip(specs, plans)}
import matrix
print(json.dumps(matrix.__file__))
print(json.dumps({"seconds": time.monotonic() - started, "locked": found}))
"""


def side_root(rev: str, scratch: Path) -> Path:
    """The matrix package of git revision `rev` (`tree`: this working tree), unpacked under `scratch`."""
    if rev == "tree":
        return REPO
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "matrix"], capture_output=True, check=True)
    root = scratch / f"rev-{rev}"
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(root, filter="data")
    return root


def lock(root: Path, specs: list[str], cache: Path) -> dict[str, object]:
    # Both caches point at the side's own directory: pip's side uses PIP_CACHE_DIR, uv's UV_CACHE_DIR.
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "UV_CACHE_DIR": str(cache / "uv"),
        "PIP_CACHE_DIR": str(cache / "pip"),
    }
    started = time.monotonic()
    # cwd: not this repository, whose matrix/ `python -c` would put first on sys.path for every side.
    done = subprocess.run([sys.executable, "-c", LOCK, json.dumps(specs), str(REPO / "data" / "runtimes.toml")],
                          env=env, capture_output=True, text=True, check=False, timeout=3600,
                          cwd=cache.parent)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"lock of {root} failed:\n{done.stderr[-3000:]}")
    lines = done.stdout.strip().splitlines()
    result: dict[str, object] = json.loads(lines[-1])
    result["matrix"] = json.loads(lines[-2])  # which tree's matrix ran
    result["wall"] = time.monotonic() - started
    return result


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", action="append", help="NAME=REV, REV a git revision or `tree` (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runtime", action="append", help="BACKEND=VERSION (repeatable)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    specs = args.runtime or ["vllm=0.29.0", "vllm=0.30.0", "vllm=0.31.0"]
    sides = dict(s.split("=", 1) for s in (args.side or ["pip=53387eb", "uv-sequential=1a784cb", "uv=tree"]))
    names = list(sides)
    scratch = Path(tempfile.mkdtemp(prefix="matrix-bench-lock-"))
    from tests.bench.results import append_section

    roots = {name: side_root(rev, scratch) for name, rev in sides.items()}
    seconds: dict[tuple[str, str], list[float]] = {}
    locked: dict[str, dict[str, list[str]]] = {}
    loads = [load()]
    try:
        for number in range(args.rounds):
            order = names if number % 2 == 0 else names[::-1]
            caches = {name: Path(tempfile.mkdtemp(prefix=f"cache-{name}-", dir=scratch)) for name in names}
            for temperature in ("cold", "warm"):
                for name in order:
                    result = lock(roots[name], specs, caches[name])
                    seconds.setdefault((name, temperature), []).append(float(result["wall"]))  # type: ignore[arg-type]
                    locked[name] = result["locked"]  # type: ignore[assignment]
                    loads.append(load())
                    print(f"round {number + 1} {name} {temperature}: {result['wall']:.1f} s ({result['matrix']}), "
                          f"load {loads[-1]}", flush=True)  # fmt: skip
            for cache in caches.values():
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    last = names[-1]
    med = {key: statistics.median(values) for key, values in seconds.items()}
    lines = [
        f"\n## Wheelhouse lock of {', '.join(specs)} (tests/bench/bench_wheelhouse_lock.py, "
        f"{dt.date.today().isoformat()}, {args.rounds} round(s) alternated, "
        f"load average {min(loads)}-{max(loads)})\n\n",
        "Python 3.12, manylinux_2_39_x86_64, resolution only (nothing downloaded); sides: "
        + ", ".join(f"{n} = {'this tree' if r == 'tree' else 'revision ' + r}" for n, r in sides.items())
        + "; one process each, medians of wall seconds.\n\n",
        "| cache | " + " | ".join([f"{n} s" for n in names] + [f"{n} / {last}" for n in names[:-1]]) + " |\n",
        "|---|" + "---:|" * (2 * len(names) - 1) + "\n",
    ]
    for temperature in ("cold", "warm"):
        cells = [f"{med[(n, temperature)]:.1f}" for n in names]
        ratios = [f"{med[(n, temperature)] / med[(last, temperature)]:.1f}" for n in names[:-1]]
        lines.append(f"| {temperature} | " + " | ".join(cells + ratios) + " |\n")
    lines.append(f"\nWhat each locked, compared with {last} (distributions a step installs, over all steps):\n\n")
    for spec in specs:
        ours = set(locked[last][spec])
        for name in names[:-1]:
            theirs = set(locked[name][spec])
            lines.append(f"- {spec}: {len(theirs)} with {name}, {len(ours)} with {last}; only {name}: "
                         f"{', '.join(sorted(theirs - ours)) or 'none'}; only {last}: "
                         f"{', '.join(sorted(ours - theirs)) or 'none'}\n")  # fmt: skip
    report = "".join(lines)
    print(report)
    if not args.no_write:
        append_section(report)


if __name__ == "__main__":
    main()
