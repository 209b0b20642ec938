"""tests/gpu/wheelhouse_index.py: a wheelhouse served as a PEP 691 index on loopback, read by a real
`matrix discover` process (the GPU host's way to discover releases without a package index)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers.catalogs import discovered, host_platform
from tests.helpers.cli import REPO, Matrix

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _wheel_file(directory: Path, name: str, version: str, tags: str, requires_python: str) -> None:
    """A real (tiny) wheel: a zip with the METADATA an installer reads Requires-Python from."""
    stem = f"{name}-{version}"
    with zipfile.ZipFile(directory / f"{stem}-{tags}.whl", "w") as archive:
        archive.writestr(f"{stem}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                                        f"Requires-Python: {requires_python}\n\n")  # fmt: skip
        archive.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\n")


def test_a_wheelhouse_served_on_loopback_is_the_index_discover_reads_on_a_host_without_one(
    catalogued: Matrix, tmp_path: Path
) -> None:
    """tests/gpu/wheelhouse_index.py: the GPU host's `matrix discover` reads the releases from the wheelhouse
    made for them. Requires-Python comes from each wheel's metadata (here a fabricated 0.37.0 that refuses
    Python 3.12 is listed and not added; 0.35.0 and 0.36.0 stand for releases after the catalogued 0.34.0);
    other projects' wheels are on their own pages."""
    wheelhouse = tmp_path / "wh"
    wheelhouse.mkdir()
    host = host_platform()
    for version, python in (("0.35.0", ">=3.11,<3.15"), ("0.36.0", ">=3.11,<3.15"), ("0.37.0", ">=3.13")):
        _wheel_file(wheelhouse, "vllm", version, f"cp38-abi3-{host}", python)
    _wheel_file(wheelhouse, "torch", "2.14.0", f"cp312-cp312-{host}", ">=3.10")
    (wheelhouse / "manifest.json").write_text("{}")  # not a distribution: not listed
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "gpu" / "wheelhouse_index.py"), str(wheelhouse), "--",
         sys.executable, "-m", "matrix", "discover", "vllm", "--index-url", "{index}", "--json"],
        env=catalogued.env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "serving 4 file(s) of 2 project(s) at http://127.0.0.1:" in done.stderr
    actions = {v["version"]: v["action"] for v in json.loads(done.stdout)["versions"]}
    assert actions == {"0.35.0": "added", "0.36.0": "added", "0.37.0": "python"}
    assert sorted(discovered(catalogued, "vllm")) == ["0.35.0", "0.36.0"]
