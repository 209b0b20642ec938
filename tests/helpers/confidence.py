"""The timed reference catalog of the confidence tests: a synth backend, one timed case, flake and speed gates."""

from __future__ import annotations

from tests.helpers.cli import DATA, Matrix

CASE = """
[[case]]
name = "ref_timed"
backend = "synth"
arm = "reference"
model = "tiny"
markers = ["gpu_0", "e2e", "pre_merge"]
startup_timeout_s = 20
request_timeout_s = 10
# 16 tokens at 10 ms each: a request of ~170 ms, long enough that a 15 % change stands above the jitter.
# A timing study of the primary request: the streaming, cancel and orphan checks would only add time.
launch = { token_delay_ms = 10, lifecycle = false }
payload = { max_tokens = 16 }
"""

GATES = """
[[gate]]
name = "flake"
expression = "e2e"
rules = { min_pass_rate = 0.95, min_samples = 10 }

[[gate]]
name = "speed"
expression = "e2e"
rules = { max_slowdown = 0.10 }
"""


def runtime(version: str, env: str = "") -> str:
    extra = f", env = {{ {env} }}" if env else ""
    return f'[[runtime]]\nbackend = "synth"\nversion = "{version}"\nprovider = {{ kind = "builtin"{extra} }}\n'


def setup_catalog(m: Matrix, runtimes: str) -> None:
    directory = m.home / "catalog"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "synth.toml").write_text('[[backend]]\nname = "synth"\n' + runtimes + CASE + GATES)
    result = m("catalog", "sync", str(directory / "synth.toml"), str(DATA / "markers.toml"))
    assert result.exit_code == 0, result.output


def run(m: Matrix, *versions: str, repeat: int, jobs: int = 2) -> None:
    """One campaign over the versions: their repeats interleave, so both sides share the host's load."""
    chosen = [arg for version in versions for arg in ("--runtime", f"synth={version}")]
    result = m.subprocess("run", *chosen, "--repeat", str(repeat), "--no-report", "-q", "-j", str(jobs), timeout=900)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    for version in versions:
        rows = m.sql(f"SELECT count(*) FROM cell_run JOIN runtime ON runtime.id = cell_run.runtime_id "
                     f"WHERE runtime.version = '{version}' AND cell_run.status IN ('passed', 'failed')")  # fmt: skip
        assert rows[0][0] >= repeat
