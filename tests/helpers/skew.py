"""The version-skew grid's shared pieces: its case, catalog, outcome classes and a seeded grid campaign."""

from __future__ import annotations

import json
from pathlib import Path

from matrix.campaign import RunOptions, _selected_cells
from matrix.db.engine import create_db_engine, session_factory, transaction
from matrix.plan import Selection
from tests.helpers.cli import DATA, Matrix


def grid_campaign(m: Matrix) -> None:
    engine = create_db_engine(m.url)
    try:
        with transaction(session_factory(engine)) as session:
            selection = Selection(cases=("dynamo_mocker_disaggregated",), skew=True)
            _selected_cells(session, RunOptions(selection=selection), lambda _: None)
    finally:
        engine.dispose()
    m.sql("UPDATE cell_run SET status = 'passed' WHERE roles_key = ''")
    m.sql("UPDATE cell_run SET status = 'failed', failure_kind = 'startup', message = ?, exit_codes = ? "
          "WHERE roles_key = 'prefill=1.4.2,decode=1.6.1'", f"decode exited\n{NIXL}", '{"decode": 1}')  # fmt: skip
    m.sql("UPDATE cell_run SET status = 'timeout', failure_kind = 'request', message = 'no answer in 60 s' "
          "WHERE roles_key = 'prefill=1.6.1,decode=1.4.2'")  # fmt: skip


NIXL = ("NIXL compatibility hash mismatch. Local: 1a2b, Remote: 3c4d. Prefill and decode instances have "
        "incompatible configurations")  # fmt: skip


def skew_classes(m: Matrix) -> dict[tuple[str, str], str]:
    result = m.subprocess("skew", SKEW_CASE, "--json")
    assert result.returncode == 0, result.stderr
    return {(c["prefill"], c["decode"]): c["class"] for c in json.loads(result.stdout)["cells"]}


def skew_catalog(directory: Path) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cases.toml").write_text(
        f'[[case]]\nname = "{SKEW_CASE}"\nbackend = "reference"\narm = "reference"\nmodel = "tiny"\n'
        'markers = ["gpu_0", "e2e", "post_merge"]\nstartup_timeout_s = 30\nrequest_timeout_s = 15\n'
        "launch = {}\n"
    )
    (directory / "runtimes.toml").write_text(
        '[[runtime]]\nbackend = "reference"\nversion = "0.1.0"\nchannel = "release"\nprovider = { kind = "builtin" }\n'
        'components = { matrix-reference = "0.1.0" }\n\n'
        '[[runtime]]\nbackend = "reference"\nversion = "0.2.0"\nchannel = "release"\n'
        'provider = { kind = "builtin", env = { MATRIX_REFERENCE_FAULTS = "kv-transfer-dropped" } }\n'
        'components = { matrix-reference = "0.2.0" }\n'
    )
    shared = [DATA / n for n in ("backends.toml", "markers.toml", "fixes.toml", "gates.toml")]
    return [str(directory / "cases.toml"), str(directory / "runtimes.toml"), *map(str, shared)]


SKEW_CASE = "ref_skew"
