"""[M11] items 5 and 6: NUL and control characters in catalog text, on SQLite and PostgreSQL.

A NUL cannot be stored as text on PostgreSQL: in a catalog file or a hand edit it is a clear exit-2 error
that writes nothing; in what a process produced it is kept as a visible escape. Other control characters
are stored as written, and every terminal output shows them as visible escapes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.cli import Matrix, toml_value

RAW_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


@pytest.mark.all_databases
def test_a_nul_in_a_catalog_file_is_exit_2_and_writes_nothing(seeded: Matrix, tmp_path: Path) -> None:
    before = seeded.dump()
    bad = tmp_path / "bad.toml"
    bad.write_text('[[backend]]\nname = "reference"\ndescription = "a\\u0000b"\n', encoding="utf-8")
    result = seeded("catalog", "sync", str(bad))
    assert result.exit_code == 2, result.output
    assert "backend[0].description contains a NUL character" in result.output
    assert "Traceback" not in result.output
    assert seeded.dump() == before


@pytest.mark.all_databases
def test_a_nul_in_a_hand_edit_is_exit_2_and_writes_nothing(seeded: Matrix) -> None:
    before = seeded.dump()
    result = seeded("runtime", "add", "reference", "0.7.0", "--notes", "bad\x00note")
    assert result.exit_code == 2, result.output
    assert "runtime.notes contains a NUL byte" in result.output
    assert seeded.dump() == before


@pytest.mark.all_databases
def test_a_nul_a_process_wrote_is_stored_as_a_visible_escape(seeded: Matrix) -> None:
    """The guard under every write: evidence with a NUL is kept, escaped, on both databases."""
    from matrix.db.engine import create_db_engine, session_factory, transaction
    from matrix.db.models import Campaign

    factory = session_factory(create_db_engine(seeded.url))
    with transaction(factory) as session:
        session.add(Campaign(status="finished", selection={"note": "x\x00y"}, host="h\x00st"))
    assert seeded.sql("SELECT host FROM campaign") == [("h\\x00st",)]


def test_control_characters_in_catalog_text_reach_no_terminal(matrix: Matrix, tmp_path: Path) -> None:
    nasty = "\x1b]0;pwned\x07\x1b[2J\x08\x9b"
    catalog = tmp_path / "c.toml"
    catalog.write_text(
        f'[[backend]]\nname = {toml_value("be" + nasty)}\ndescription = {toml_value(nasty)}\n'
        f'[[marker]]\nname = "gpu_0"\nkind = "hardware"\n'
        f'[[runtime]]\nbackend = {toml_value("be" + nasty)}\nversion = "1.0"\nprovider = {{ kind = "builtin" }}\n'
        f"notes = {toml_value(nasty)}\n"
        f'[[case]]\nname = {toml_value("case" + nasty)}\nbackend = {toml_value("be" + nasty)}\narm = "reference"\n'
        f'model = "m"\nmarkers = ["gpu_0"]\ndescription = {toml_value(nasty)}\n',
        encoding="utf-8",
    )
    outputs = [matrix("catalog", "sync", str(catalog)).output]
    for args in (("plan",), ("plan", "--explain"), ("cases", "list"), ("runtimes", "list"), ("backends", "list"),
                 ("cases", "list", "--json"), ("plan", "--json"), ("show", "case" + nasty + "@x")):  # fmt: skip
        outputs.append(matrix(*args).output)
    for output in outputs:
        assert not RAW_CONTROL.search(output), repr(output)
    assert "case\\x08\\x9b" in outputs[1]
