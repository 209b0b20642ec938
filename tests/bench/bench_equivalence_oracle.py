"""Acceptance of the equivalence oracle on the reference server ([M16]).

Two reference cases that opt in to `equivalent_to_aggregated` (16 prompts x 64 tokens): one healthy, one
with the fault `kv-corrupt-after-checksum` (decode corrupts the last KV block after the transfer's checksum
passed, so every other check passes). Each runs N times through the real runner (`run_cell`: real
processes, ports from the allocator, the aggregated instance launched and torn down after the pair).
Wanted: the faulty case fails in every run with `equivalent_to_aggregated` as its only failed check; the
healthy case never fails; nothing survives and every port is free again.
Run: python tests/bench/bench_equivalence_oracle.py [--runs 50]   (appends to docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.helpers.oracle import CASES, run_oracle_cells  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="matrix-bench-oracle-"))
    os.environ["MATRIX_HOME"] = str(home)
    from matrix.hardware.ports import port_is_free

    runs = run_oracle_cells(home, args.runs)
    rows = []
    for name in CASES:
        mine = [r for r in runs if r.case == name]
        only_oracle = sum(r.status == "failed" and r.failed_checks == ("equivalent_to_aggregated",) for r in mine)
        failed = sum(r.status != "passed" for r in mine)
        busy = sum(not port_is_free(p, reuse_addr=True) for r in mine for p in r.ports)
        agg = statistics.median(r.aggregated_s for r in mine if r.aggregated_s is not None)
        total = statistics.median(r.total_s for r in mine if r.total_s is not None)
        identical = sum(r.identical for r in mine), sum(r.prompts for r in mine)
        rows.append(
            f"| `{name}` | {len(mine)} | {failed} | {only_oracle} | {identical[0]}/{identical[1]} | "
            f"{total:.2f} | {agg:.2f} | {busy} |"
        )
        if name == "oracle_clean" and failed:
            print("\n".join(r.message for r in mine if r.status != "passed"), file=sys.stderr)
    report = (
        f"\n## Equivalence oracle on the reference server ({dt.date.today()}, {args.runs} runs per case, "
        f"{os.cpu_count()} cores)\n\n"
        f"`python tests/bench/bench_equivalence_oracle.py --runs {args.runs}`: 16 prompts x 64 tokens per run, "
        "the pair then the aggregated instance.\n\n"
        "| case | runs | failed | failed with `equivalent_to_aggregated` only | prompts token-identical | "
        "median total s | median aggregated s | ports still busy |\n|---|---|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\nWanted: `oracle_kv_corrupt` fails in every run with only `equivalent_to_aggregated`; "
        "`oracle_clean` never fails.\n"
    )
    print(report)
    if not args.no_write:
        from tests.bench.results import append_section

        append_section(report)


if __name__ == "__main__":
    main()
