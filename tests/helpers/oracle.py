"""The equivalence oracle's reference cells run through the real runner (the oracle tests and its benchmark)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.cli import DATA

CASES = {
    "oracle_clean": "[]",
    "oracle_kv_corrupt": '["kv-corrupt-after-checksum"]',
}


@dataclass(frozen=True)
class Run:
    case: str
    status: str
    failed_checks: tuple[str, ...]
    message: str
    aggregated_s: float | None
    total_s: float | None
    identical: int
    prompts: int
    ports: tuple[int, ...]


def oracle_catalog(directory: Path) -> list[Path]:
    data = DATA
    lines = []
    for name, faults in CASES.items():
        lines += [
            "[[case]]",
            f'name = "{name}"',
            'backend = "reference"\narm = "reference"\nmodel = "tiny"\nmarkers = ["gpu_0"]',
            "startup_timeout_s = 20\nrequest_timeout_s = 20",
            f"launch = {{ faults = {faults}, equivalence = {{ prompts = 16, tokens = 64 }} }}",
            "",
        ]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "oracle.toml").write_text("\n".join(lines))
    return [
        directory / "oracle.toml",
        *(data / n for n in ("backends.toml", "markers.toml", "fixes.toml", "runtimes.toml")),
    ]


def run_oracle_cells(home: Path, runs: int, baselines: object = None) -> list[Run]:
    """`runs` attempts of each case, alternating, through `run_cell`; MATRIX_HOME must already be `home`.
    `baselines` (a `matrix.check.baselines.OracleBaselines`) lets later attempts reuse the aggregated answers."""
    from matrix.catalog.load import load_catalog
    from matrix.catalog.queries import plan_from_db
    from matrix.catalog.sync import sync_catalog
    from matrix.check.baselines import OracleBaselines
    from matrix.db.engine import create_db_engine, session_factory, transaction
    from matrix.db.migrate import ensure_schema
    from matrix.hardware.ports import PortAllocator
    from matrix.paths import port_registry_path
    from matrix.plan import Selection
    from matrix.runner import Resources, run_cell

    engine = create_db_engine(f"sqlite:///{home / 'oracle.db'}")
    ensure_schema(engine)
    factory = session_factory(engine)
    with transaction(factory) as session:
        sync_catalog(session, load_catalog(oracle_catalog(home / "catalog")))
        cells = {c.case.name: c for c in plan_from_db(session, Selection(cases=tuple(CASES))).cells}
    allocator = PortAllocator(port_registry_path())
    results = []
    for i in range(runs):
        for name, cell in cells.items():
            log_dir = home / "runs" / f"{name}-{i}"
            store = baselines if isinstance(baselines, OracleBaselines) else None
            outcome = run_cell(cell, f"oracle-{name}-{i}", log_dir, allocator, Resources(baselines=store))
            artifact = log_dir / "equivalence.json"
            document = json.loads(artifact.read_text()) if artifact.is_file() else {}
            kinds = [r["kind"] for r in document.get("results", [])]
            results.append(
                Run(
                    case=name,
                    status=outcome.status,
                    failed_checks=tuple(c.name for c in outcome.checks),
                    message=outcome.message,
                    aggregated_s=document.get("aggregated_s"),
                    total_s=outcome.total_s,
                    identical=kinds.count("identical"),
                    prompts=len(kinds),
                    ports=tuple(outcome.ports.values()),
                )
            )
    return results
