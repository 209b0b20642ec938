"""Benchmark: gate, compare, show, export junit and report on 10^3, 10^4 and 10^5 attempts, old against new.

A long history (a year of nightlies) must not slow the commands that print the latest attempts.

1. Real results: a synthetic backend with two builtin runtimes (1.0.0 and 1.1.0) and --cases reference
   cases (one with the planted fault `crash-at-start`, so some attempts fail) runs once through
   `matrix run --results-out` (real processes and HTTP on 127.0.0.1), and that file is merged into a
   fresh central database with `matrix import`: one campaign of 2 x --cases attempts.
2. History: the imported campaign is copied, through the models' tables in one bulk insert per size,
   until the database holds each wanted number of attempts (a campaign row per copy, new attempt uids,
   the timing columns scaled by a seeded lognormal factor, sigma 0.05, so the samples are not all ties;
   statuses, checks, messages and log directories are the real ones).
3. Each command runs as a child process (`python -m matrix`) against each database, with this tree and,
   with --old REF, with the tree of commit REF (`git archive`), the two back to back; a command past --limit
   seconds is stopped and shown as `> LIMIT`. The report's largest page is measured too. Last, a `matrix run`
   of 10 cells refreshes that report ([M33] item 3): its wall time, and the refresh's own line ("5 pages
   refreshed in 0.9 s") where the tree prints one.

Run: python tests/bench/bench_history_scale.py [--cases 20] [--sizes 1000,10000,100000] [--old REF]
     [--limit 300] [--old-report-below 100000]   (appends to docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.results import append_section  # noqa: E402

TIMING_COLUMNS = ("ready_s", "request_s", "total_s")
RUN_TEN = "run of 10 cells, report refreshed"
# What `matrix run` says of its report refresh ("... (5 pages refreshed in 0.9 s)").
REFRESH = re.compile(r"report: .*\((\d+) pages (refreshed|written) in ([\d.]+) s\)")

CATALOG_HEAD = """
[[backend]]
name = "synth"

[[runtime]]
backend = "synth"
version = "1.0.0"
provider = { kind = "builtin" }

[[runtime]]
backend = "synth"
version = "1.1.0"
provider = { kind = "builtin" }

[[gate]]
name = "bench"
expression = "gpu_0"
rules = { max_slowdown = 0.10, flaky_blocks = false }
"""


def catalog(n_cases: int) -> str:
    cases = []
    for i in range(n_cases):
        fault = '["crash-at-start"]' if i == 0 else "[]"
        cases.append(
            f'[[case]]\nname = "case_{i:02d}"\nbackend = "synth"\narm = "reference"\nmodel = "tiny"\n'
            f'markers = ["gpu_0"]\nstartup_timeout_s = 20\nrequest_timeout_s = 10\n'
            f"payload = {{ max_tokens = 16 }}\nlaunch = {{ faults = {fault}, token_delay_ms = 2, "
            f"teardown_grace_s = 0.5 }}\n"
        )
    return CATALOG_HEAD + "\n" + "\n".join(cases)


def matrix(tree: Path, home: Path, *args: str, timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MATRIX_HOME": str(home), "MATRIX_DB": str(home / "matrix.db"), "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-m", "matrix", *args], env=env, capture_output=True, text=True,
                          check=False, timeout=timeout, cwd=tree)  # fmt: skip


def real_results(work: Path, n_cases: int, tree: Path = REPO) -> Path:
    """Run the cells for real and import the results file into a fresh central database; return its home.
    `tree` makes the central database (the oldest tree timed: a newer one upgrades its copy, never the reverse)."""
    runner, central = work / "runner", work / "central"
    for home, syncing in ((runner, REPO), (central, tree)):
        home.mkdir()
        (home / "synth.toml").write_text(catalog(n_cases))
        sync = matrix(syncing, home, "catalog", "sync", str(home / "synth.toml"), str(REPO / "data" / "markers.toml"))
        assert sync.returncode == 0, sync.stdout + sync.stderr
    out = work / "results.json"
    run = matrix(REPO, runner, "run", "--runtime", "synth=1.0.0", "--runtime", "synth=1.1.0", "--results-out",
                 str(out), "--no-report", "-q", "-j", "2")  # fmt: skip
    assert run.returncode in (0, 1), run.stdout + run.stderr  # 1: the planted crash failed
    imported = matrix(tree, central, "import", str(out))
    assert imported.returncode == 0, imported.stdout + imported.stderr
    return central


def grow(source: Path, target: Path, attempts: int, seed: int) -> int:
    """Copy the source database and repeat its campaign until `attempts` attempt rows; return the count."""
    from sqlalchemy import func, insert, select

    from matrix.db.engine import create_db_engine
    from matrix.db.models import Campaign, CellRun

    shutil.copy(source, target)
    engine = create_db_engine(f"sqlite:///{target}")
    rng = random.Random(seed)
    campaign_table, run_table = Campaign.__table__, CellRun.__table__
    with engine.begin() as conn:
        (campaign,) = conn.execute(select(campaign_table)).mappings().all()
        rows = [dict(r) for r in conn.execute(select(run_table).order_by(run_table.c.id)).mappings()]
        copies = max(0, attempts // len(rows) - 1)
        next_campaign = int(campaign["id"]) + 1
        next_row = max(int(r["id"]) for r in rows) + 1
        new_campaigns, new_rows = [], []
        for _ in range(copies):
            new_campaigns.append({**dict(campaign), "id": next_campaign})
            for row in rows:
                factor = rng.lognormvariate(0, 0.05)
                copy = {**row, "id": next_row, "campaign_id": next_campaign, "uid": uuid.uuid4().hex[:16]}
                for column in TIMING_COLUMNS:
                    if copy.get(column) is not None:
                        copy[column] = copy[column] * factor
                new_rows.append(copy)
                next_row += 1
            next_campaign += 1
        for start in range(0, len(new_campaigns), 2000):
            conn.execute(insert(campaign_table), new_campaigns[start : start + 2000])
        for start in range(0, len(new_rows), 2000):
            conn.execute(insert(run_table), new_rows[start : start + 2000])
        count = int(conn.execute(select(func.count()).select_from(run_table)).scalar_one())
    engine.dispose()
    return count


def timed(tree: Path, home: Path, limit: float, *args: str) -> tuple[float | None, str]:
    """Wall seconds of one command (None past the limit) and its exit status; for a run that says how long
    its report refresh took, the status is that line's "N pages refreshed in S s"."""
    start = time.perf_counter()
    try:
        done = matrix(tree, home, *args, timeout=limit)
    except subprocess.TimeoutExpired:
        return None, "timeout"
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 1, 3):
        return elapsed, f"rc {done.returncode}: {done.stderr}"
    said = REFRESH.search(done.stdout)
    return elapsed, f"{done.returncode}; {said.group(1)} pages {said.group(2)} in {said.group(3)} s" if said else str(
        done.returncode)


def largest_page(directory: Path) -> tuple[int, int, int]:
    """(pages, total bytes, largest page bytes) of a written report."""
    sizes = [p.stat().st_size for p in directory.rglob("*.html")]
    return len(sizes), sum(sizes), max(sizes, default=0)


def commands(out: Path) -> dict[str, list[str]]:
    return {
        "gate synth 1.1.0 --policy bench": ["gate", "synth", "1.1.0", "--policy", "bench"],
        "compare synth=1.0.0 synth=1.1.0": ["compare", "synth=1.0.0", "synth=1.1.0"],
        "show case_01@synth-1.1.0": ["show", "case_01@synth-1.1.0"],
        "export junit": ["export", "junit", "--out", str(out / "junit.xml")],
        "report": ["report", "--out", str(out / "report")],
        # Last: it adds 10 attempts. Its report refresh finds the full report the line above wrote.
        RUN_TEN: ["run", *[a for i in range(1, 11) for a in ("--case", f"case_{i:02d}")], "--runtime", "synth=1.1.0",
                  "--report-dir", str(out / "report"), "-q", "-j", "2"],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=20, help="cases per runtime (x2 attempts per campaign)")
    parser.add_argument("--sizes", default="1000,10000,100000", help="attempt counts, comma separated")
    parser.add_argument("--old", default="", help="a commit to time side by side (git archive of it)")
    parser.add_argument("--git", default=str(REPO), help="the repository --old is archived from")
    parser.add_argument("--limit", type=float, default=300.0, help="seconds before a command is stopped")
    parser.add_argument("--old-report-below", type=int, default=0, help="time the old report only below this size")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        trees = {"new": REPO}
        if args.old:
            old = work / "old"
            old.mkdir()
            archive = subprocess.run(["git", "-C", args.git, "archive", args.old], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
            trees = {"old": old, "new": REPO}
        start = time.perf_counter()
        central = real_results(work, args.cases, next(iter(trees.values())))
        print(f"real run and import: {time.perf_counter() - start:.0f} s", flush=True)
        results: dict[tuple[str, int, str], tuple[float | None, str]] = {}
        pages: dict[tuple[str, int], tuple[int, int, int]] = {}
        counts: dict[int, int] = {}
        for size in sizes:
            # A database per tree, grown alike (the same seed): a newer tree's schema may be ahead (its
            # `db upgrade` runs first, untimed), and each tree's 10-cell run adds to its own history.
            homes = {label: work / f"h{size}-{label}" for label in trees}
            for label, home in homes.items():
                home.mkdir()
                shutil.copy(central / "synth.toml", home / "synth.toml")
                counts[size] = grow(central / "matrix.db", home / "matrix.db", size, seed=size)
                upgraded = matrix(trees[label], home, "db", "upgrade")
                assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
            outs = {label: work / f"out-{label}-{size}" for label in trees}
            for out in outs.values():
                out.mkdir()
            for name in commands(work):
                for label, tree in trees.items():  # old and new back to back: the same load on the machine
                    if name == "report" and label == "old" and args.old_report_below and size >= args.old_report_below:
                        continue  # the old report at this size takes longer than a run can wait
                    argv = commands(outs[label])[name]
                    results[(label, size, name)] = timed(tree, homes[label], args.limit, *argv)
                    print(label, counts[size], name, results[(label, size, name)], flush=True)
            for label, out in outs.items():
                if (out / "report").is_dir():
                    pages[(label, size)] = largest_page(out / "report")
    report = table(sizes, counts, list(trees), results, pages, args)
    print(report)
    if not args.no_write:
        append_section(report)


def _cell(value: tuple[float | None, str] | None, limit: float) -> str:
    if value is None:
        return "not run"
    seconds, status = value
    if seconds is None:
        return f"> {limit:.0f} s"
    if ";" in status:  # a run that said how long its report took
        return f"{seconds:.2f} s ({status.split('; ', 1)[1]})"
    return f"{seconds:.2f} s" + ("" if status in ("0", "1", "3") else " (error)")


def table(
    sizes: list[int], counts: dict[int, int], trees: list[str], results: dict[Any, Any], pages: dict[Any, Any],
    args: argparse.Namespace,
) -> str:
    lines = [
        "\n## History scale: commands at 10^3 to 10^5 attempts (`tests/bench/bench_history_scale.py`)\n",
        f"`python tests/bench/bench_history_scale.py --cases {args.cases} --sizes {args.sizes}"
        + (f" --old {args.old}" if args.old else "") + f" --limit {args.limit:.0f}"
        + (f" --old-report-below {args.old_report_below}" if args.old_report_below else "")
        + "`: one real campaign of "
        + f"{2 * args.cases} reference cells (`run --results-out`, `import`), copied in bulk up to each size. "
        "Wall seconds of one run, on a shared 2-core machine busy with other work: compare columns of one "
        "row (the same moment), not runs.\n",
        "| command | " + " | ".join(f"{t} @ {counts[s]:,}" for s in sizes for t in trees) + " |",
        "|---|" + "---|" * (len(sizes) * len(trees)),
    ]
    for name in commands(Path(".")):
        cells = [_cell(results.get((t, s, name)), args.limit) for s in sizes for t in trees]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    for (label, size), (n, total, largest) in sorted(pages.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"\nreport {label} @ {counts[size]:,}: {n} pages, {total / 1e6:.1f} MB, "
                     f"largest page {largest / 1e6:.2f} MB")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
