"""Synthetic runtimes of the built-in reference server for bisect and discover tests: from a planted version on
the recipe carries a fault, so its pair really fails."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.cli import DATA, Matrix


def synthetic_catalog(path: Path, n: int, break_at: int, *, fault: str = "crash-at-start", fix: bool = False) -> str:
    """n runtimes 1.0.0 .. 1.{n-1}.0 of backend `synth`; versions from `break_at` on fail (before it, with fix)."""
    lines = ['[[backend]]\nname = "synth"\n']
    for i in range(n):
        broken = (i < break_at) if fix else (i >= break_at)
        env = f', env = {{ MATRIX_REFERENCE_FAULTS = "{fault}" }}' if broken else ""
        lines.append(f'[[runtime]]\nbackend = "synth"\nversion = "1.{i}.0"\nprovider = {{ kind = "builtin"{env} }}\n')
    lines.append('[[case]]\nname = "synth_pair"\nbackend = "synth"\narm = "reference"\nmodel = "tiny"\n'
                 'markers = ["gpu_0"]\nstartup_timeout_s = 20\nrequest_timeout_s = 10\n'
                 'launch = {}\n')  # fmt: skip
    path.write_text("\n".join(lines))
    return str(path)


def sync_synth(m: Matrix, *files: str) -> None:
    result = m.subprocess("catalog", "sync", *files, str(DATA / "markers.toml"))
    assert result.returncode == 0, result.stdout + result.stderr


def campaign_rows(m: Matrix, campaign: int) -> list[tuple[str, str]]:
    rows = m.sql(
        "SELECT runtime.version, cell_run.status FROM cell_run JOIN runtime ON runtime.id = cell_run.runtime_id "
        "WHERE cell_run.campaign_id = ? ORDER BY cell_run.id",
        campaign,
    )
    return [(str(v), str(s)) for v, s in rows]
