"""Reference cells a test breaks and heals between campaigns: a catalog with the builtin reference runtime,
whose cases plant the reference server's `missing-usage` fault (the `usage_object` check fails) while
`broken`, synced beside the seed's backends and markers. The episode, notification and quarantine tests use
them."""

from __future__ import annotations

from tests.helpers.cli import DATA, Matrix

RUNTIME = """
[[runtime]]
backend = "reference"
version = "0.1.0"
provider = { kind = "builtin" }
components = { matrix-reference = "0.1.0" }
"""
BROKEN = 'faults = ["missing-usage"], '


def case(name: str, *, broken: bool) -> str:
    """A quick reference case; `broken` plants the missing usage object."""
    return f"""
[[case]]
name = "{name}"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0"]
startup_timeout_s = 30
request_timeout_s = 10
launch = {{ {BROKEN if broken else ""}lifecycle = false }}
"""


def sync(m: Matrix, *parts: str) -> None:
    """Sync the reference runtime and `parts` (cases, gates, waivers) as the test's catalog."""
    path = m.home / "catalog.toml"
    path.write_text(RUNTIME + "".join(parts))
    result = m("catalog", "sync", str(DATA / "backends.toml"), str(DATA / "markers.toml"), str(path))
    assert result.exit_code == 0, result.output
