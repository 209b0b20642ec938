"""Benchmark: the README's test command (`pytest`, the fast suite) at two git revisions, side by side.

Each revision is checked out into a temporary worktree (`git worktree add --detach`) and its fast suite runs
there as its own `pytest` process, with the revision's own pyproject.toml (so its own addopts: workers or
none) and the revision's own code first on PYTHONPATH. The runs alternate, baseline first, so both share the
host's load as evenly as a shared host allows. Recorded per run: wall time, the summary line, and the exit
status; medians per revision, and the slowest tests of the last run of each (`--durations`).

Extra pytest arguments after `--` go to both sides (a subset: `-- tests/unit`), e.g. to compare a directory.

Run: python tests/bench/bench_fast_suite.py [--baseline REF] [--candidate REF] [--rounds 1] [--no-write] [-- ARGS]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.results import append_section  # noqa: E402

# The last line, with or without the bars around it (-q drops them).
SUMMARY = re.compile(r"^(?:=+ )?(.*(?:passed|failed|error).*) in [\d.]+s")
SLOW = re.compile(r"^(\d+\.\d+)s (call|setup|teardown)\s+(\S+)")


@dataclass(frozen=True)
class Run:
    revision: str
    wall_s: float
    status: int
    summary: str
    slowest: tuple[str, ...]
    failed: tuple[str, ...]


def _worktree(ref: str, parent: Path) -> Path:
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                         check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    path = parent / sha[:12]
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), sha],
                   check=True, capture_output=True)  # fmt: skip
    return path


def _run(label: str, tree: Path, extra: list[str]) -> Run:
    # The tree's own code: an editable install of another checkout must not answer its imports.
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10", *extra],
                          cwd=tree, env=env, capture_output=True, text=True, check=False)  # fmt: skip
    wall = time.monotonic() - start
    lines = done.stdout.splitlines()
    summary = next((m.group(1) for line in reversed(lines) if (m := SUMMARY.match(line))), "no summary line")
    slowest = tuple(f"{m.group(1)} s {m.group(2)} {m.group(3)}" for line in lines if (m := SLOW.match(line)))
    failed = tuple(line for line in lines if line.startswith(("FAILED ", "ERROR ")))
    print(f"{label}: {wall:.0f} s, exit {done.returncode}, {summary}", *failed, sep="\n  ", flush=True)
    return Run(label, wall, done.returncode, summary, slowest, failed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="HEAD~1", help="the revision to compare against (default HEAD~1)")
    parser.add_argument("--candidate", default="HEAD", help="the revision measured (default HEAD)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each side, alternated (default 1)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest on both sides, after `--`")
    args = parser.parse_args()

    parent = Path(tempfile.mkdtemp(prefix="matrix-fast-suite-"))
    trees = {args.baseline: _worktree(args.baseline, parent), args.candidate: _worktree(args.candidate, parent)}
    runs: list[Run] = []
    try:
        for _ in range(args.rounds):
            for ref, tree in trees.items():
                runs.append(_run(ref, tree, args.pytest_args))
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(parent, ignore_errors=True)  # the worktrees' parent, empty by now

    load = os.getloadavg()
    rows = []
    for ref in trees:
        mine = [r for r in runs if r.revision == ref]
        median = statistics.median(r.wall_s for r in mine)
        statuses = ", ".join(str(r.status) for r in mine)
        rows.append(f"| `{ref}` | {median:.0f} s ({median / 60:.1f} min) | {statuses} | {mine[-1].summary} |")
    slow = []
    for ref in trees:
        last = [r for r in runs if r.revision == ref][-1]
        slow.append(f"\nSlowest of `{ref}` (last run):\n\n" + "\n".join(f"- {s}" for s in last.slowest[:10]))
        if last.failed:
            slow.append(f"\nFailed in `{ref}` (last run):\n\n" + "\n".join(f"- {s}" for s in last.failed))
    subset = " ".join(args.pytest_args) or "the whole fast suite"
    report = (
        f"\n## The fast suite at two revisions (tests/bench/bench_fast_suite.py, {dt.date.today()}, "
        f"{os.cpu_count()} cores, load average at the end {load[0]:.2f})\n\n"
        f"`pytest` ({subset}), {args.rounds} run(s) of each side alternated, each in a fresh worktree of its "
        f"revision.\n\n| revision | wall time (median) | exit | summary (last run) |\n|---|---|---|---|\n"
        + "\n".join(rows) + "\n" + "\n".join(slow) + "\n"
    )
    print(report)
    if not args.no_write:
        append_section(report)


if __name__ == "__main__":
    main()
