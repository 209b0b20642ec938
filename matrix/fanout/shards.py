"""CI fan-out: stable cell ids, shards balanced by expected duration, and the GitHub Actions matrix.

`matrix plan --format github-matrix` turns a plan into `{"include": [...]}` for `strategy.matrix`:
one entry (one job) per shard. GitHub runs at most 256 jobs per matrix, so when a plan has more cells
than `max_jobs`, cells are packed into `max_jobs` shards, longest expected first onto the least loaded
shard (LPT), which keeps the longest shard within 4/3 of the best possible packing.

Cells are named by a *stable id*: a short hash of the cell key (case name, backend, version; a skew cell's key
names each role's version, `CASE@BACKEND[prefill=A,decode=B]`, so its id differs from every other). Database
ids change when a catalog is synced into a fresh database, as every CI runner does; the key does not.
Everything here is pure (no database), so the same plan and history always give the same matrix.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from matrix.cells import Cell, cell_id
from matrix.errors import ConfigError
from matrix.plan import Plan

GITHUB_MAX_JOBS = 256


def index_cells(cells: Iterable[Cell]) -> dict[str, Cell]:
    """Stable id -> cell; two cells with one id (a hash collision) are an error, never merged."""
    by_id: dict[str, Cell] = {}
    for cell in cells:
        cid = cell_id(cell.key)
        if cid in by_id and by_id[cid].key != cell.key:
            raise ConfigError(
                f"cells {by_id[cid].key} and {cell.key} share the id {cid}: rename one of the cases "
                "(ids are hashes of the cell key)"
            )
        by_id[cid] = cell
    return by_id


# A comma between cells, not one inside a skew key's brackets (`CASE@BACKEND[prefill=A,decode=B]`).
_CELL_SEPARATOR = re.compile(r",(?![^\[\]]*\])")


def split_cell_args(values: Iterable[str]) -> tuple[str, ...]:
    """`--cell a,b --cell c` -> ("a", "b", "c"), blanks dropped, first occurrence kept."""
    seen: dict[str, None] = {}
    for value in values:
        for part in _CELL_SEPARATOR.split(value):
            if part := part.strip():
                seen.setdefault(part, None)
    return tuple(seen)


def pick_cells(plan: Plan, wanted: Sequence[str]) -> list[Cell]:
    """The plan's cells named by stable id or full key, in plan order; any unknown name is an error."""
    by_id = index_cells(plan.cells)
    by_key = {cell.key: cell for cell in plan.cells}
    if any(name not in by_id and name not in by_key for name in wanted):
        # A shard of a `plan --skew` matrix runs `matrix run --cell IDS` without --skew: its skew cells are
        # made from the plan's diagonal cells, only when a name is not one of those (a grid is N^2 or N^3).
        from matrix.skew import every_skew_cell

        skew = every_skew_cell(plan.cells)
        by_id.update(index_cells(skew))
        by_key.update({cell.key: cell for cell in skew})
    chosen: dict[str, Cell] = {}
    unknown: list[str] = []
    for name in wanted:
        cell = by_id.get(name) or by_key.get(name)
        if cell is None:
            unknown.append(name)
        else:
            chosen.setdefault(cell.key, cell)
    if unknown:
        excluded = {cell_id(f"{e.case}@{e.runtime}"): e for e in plan.excluded}
        excluded.update({f"{e.case}@{e.runtime}": e for e in plan.excluded})
        reasons = []
        for name in unknown[:10]:
            if (exclusion := excluded.get(name)) is not None:
                reasons.append(f"{name} ({exclusion.case}@{exclusion.runtime}) is excluded: {exclusion.reason}")
            else:
                reasons.append(f"{name} is not a cell of this catalog")
        more = f"; and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        raise ConfigError(
            f"--cell names cells this plan does not have: {'; '.join(reasons)}{more}. "
            "Cell ids are listed by `matrix plan --json` (field "
            "`id`) and `matrix plan --format github-matrix`; a full key CASE@BACKEND-VERSION (or a skew cell's "
            "CASE@BACKEND[prefill=A,decode=B]) works too. A shard "
            "must run against the catalog the plan was made from (`matrix catalog sync` with the same files)"
        )
    planned = [cell for cell in plan.cells if cell.key in chosen]
    in_plan = {cell.key for cell in planned}
    return planned + [cell for key, cell in chosen.items() if key not in in_plan]


def expected_seconds(cell: Cell, history: Mapping[int, float]) -> float:
    """The median duration of the case's earlier attempts, else its timeouts (what the scheduler uses)."""
    if cell.case.id is not None and cell.case.id in history:
        return history[cell.case.id]
    return cell.case.startup_timeout_s + cell.case.request_timeout_s


@dataclass(frozen=True)
class Shard:
    index: int  # 1-based, in matrix order
    total: int
    cells: tuple[Cell, ...]  # sorted by key
    expected_s: float

    @property
    def cell_ids(self) -> tuple[str, ...]:
        return tuple(cell_id(cell.key) for cell in self.cells)

    @property
    def id(self) -> str:
        digest = hashlib.sha256(",".join(self.cell_ids).encode("ascii")).hexdigest()[:8]
        return f"s{self.index:03d}-{digest}"

    @property
    def name(self) -> str:
        # A one-cell shard is named by its cell; GitHub shows the name in the job list.
        if len(self.cells) == 1:
            return self.cells[0].key
        return f"shard {self.index}/{self.total} ({len(self.cells)} cells)"

    @property
    def gpus(self) -> int:
        """The most GPUs any of its cells needs: a workflow can pick `runs-on` by it."""
        return max((cell.case.gpus_needed for cell in self.cells), default=0)

    def matrix_entry(self) -> dict[str, Any]:
        return {
            "shard": self.id,
            "name": self.name,
            "cells": ",".join(self.cell_ids),
            "count": len(self.cells),
            "expected_s": round(self.expected_s),
            "gpus": self.gpus,
        }


def shard_cells(cells: Sequence[Cell], expected: Mapping[str, float], max_jobs: int) -> list[Shard]:
    """Pack cells into at most `max_jobs` shards balanced by expected seconds (cell key -> seconds).

    Longest-processing-time first: cells sorted by expected time (longest first, then key) each go to
    the least loaded shard (lowest index on a tie). With no more cells than `max_jobs` every cell gets
    its own shard. Shards come back longest first, so GitHub starts the long jobs first.
    """
    if not 1 <= max_jobs <= GITHUB_MAX_JOBS:
        raise ConfigError(f"--max-jobs must be between 1 and {GITHUB_MAX_JOBS} (GitHub's limit per matrix)")
    index_cells(cells)
    order = sorted(cells, key=lambda c: (-expected[c.key], c.key))
    n = min(max_jobs, len(order))
    heap = [(0.0, i) for i in range(n)]
    members: list[list[Cell]] = [[] for _ in range(n)]
    for cell in order:
        load, i = heapq.heappop(heap)
        members[i].append(cell)
        heapq.heappush(heap, (load + expected[cell.key], i))
    packed = [(sum(expected[c.key] for c in group), sorted(group, key=lambda c: c.key)) for group in members]
    packed.sort(key=lambda item: (-item[0], item[1][0].key))
    return [
        Shard(index=i, total=n, cells=tuple(group), expected_s=load) for i, (load, group) in enumerate(packed, start=1)
    ]


def github_matrix(shards: Sequence[Shard]) -> dict[str, list[dict[str, Any]]]:
    """`{"include": [...]}`: with only `include`, GitHub runs one job per entry."""
    return {"include": [shard.matrix_entry() for shard in shards]}


def default_campaign_key() -> str:
    """Shards of one CI run share a key so that `matrix import` merges them into one campaign.

    On GitHub Actions the run is named by repository and run id (a re-run of failed jobs keeps the run
    id, so its attempts join the same campaign); elsewhere every run gets a fresh key.
    """
    run_id, repository = os.environ.get("GITHUB_RUN_ID"), os.environ.get("GITHUB_REPOSITORY")
    if run_id and repository:
        return f"github:{repository}/{run_id}"
    return f"run:{uuid.uuid4().hex}"


def check_campaign_key(key: str) -> str:
    key = key.strip()
    if not key or len(key) > 200 or not key.isprintable():
        raise ConfigError(f"invalid campaign key {key!r}: use 1 to 200 printable characters, e.g. the CI run id")
    return key
