"""The `vllm` and `sglang` backends' runtime templates: what `matrix discover` makes of a new release.

The templates are checked against the catalogued CUDA runtimes (rendered for their versions they must give
those runtimes' recipes), then used through `matrix discover` with the repository's whole catalog against
a real PEP 691 index on loopback that lists the releases as PyPI does.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from matrix.catalog.template import render
from tests.helpers.catalogs import TEMPLATE_CATALOG_FILES, discovered, host_platform
from tests.helpers.cli import DATA, Matrix
from tests.helpers.pep691 import sdist, serve_index, wheel, write_project


def _template(backend: str) -> dict[str, Any]:
    backends = tomllib.loads((DATA / "backends.toml").read_text())["backend"]
    template = next(b for b in backends if b["name"] == backend).get("runtime_template")
    assert template is not None, f"backend {backend} has no runtime_template"
    return dict(template)


def _catalogued_venv_runtimes(backend: str) -> list[dict[str, Any]]:
    entries = tomllib.loads((DATA / "runtimes.toml").read_text())["runtime"]
    return [e for e in entries if e["backend"] == backend and e["provider"]["kind"] == "venv"]


def test_the_vllm_template_rendered_for_a_catalogued_release_is_that_runtime() -> None:
    """A release discovered tomorrow gets exactly the recipe the seed's CUDA runtimes were proven with."""
    catalogued = _catalogued_venv_runtimes("vllm")
    assert [e["version"] for e in catalogued] == ["0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]
    for entry in catalogued:
        provider, components, _notes = render(_template("vllm"), entry["version"], "test")
        assert components == entry["components"], entry["version"]
        if entry["version"] != "0.34.0":
            assert provider == entry["provider"], entry["version"]
            continue
        # 0.34.0 pins flashinfer-python==0.7.3, which PyPI lacks: the catalogue installs vLLM's requirements
        # without it, the rest of the template's recipe held (discover lists the template's 0.34.0 unresolvable).
        assert entry["provider"]["steps"][0] == {"requirements_of": "vllm==0.34.0", "exclude": ["flashinfer-python"],
                                                 "with": ["ai-dynamo-runtime==1.6.1"]}  # fmt: skip
        assert entry["provider"]["steps"][2] == ["--no-deps", "vllm==0.34.0", "ai-dynamo==1.6.1"]
        assert entry["provider"]["steps"][1::2] == provider["steps"][1::2]


def test_the_sglang_template_rendered_for_a_catalogued_release_is_that_runtime_less_the_kernel() -> None:
    """Same recipe; the components lack only sglang-kernel, whose pin each release chooses (0.4.6.post1 for
    0.5.18/0.5.19, 0.4.7 for 0.5.21), which a template filling in {version} cannot know."""
    catalogued = _catalogued_venv_runtimes("sglang")
    assert [e["version"] for e in catalogued] == ["0.5.18", "0.5.19", "0.5.21", "0.5.22", "0.5.23"]
    for entry in catalogued:
        provider, components, _notes = render(_template("sglang"), entry["version"], "test")
        assert provider == entry["provider"], entry["version"]
        expected = {k: v for k, v in entry["components"].items() if k != "sglang-kernel"}
        assert components == expected, entry["version"]
    # The first three were catalogued by hand with their kernel; the later ones as discover makes them.
    assert ["sglang-kernel" in e["components"] for e in catalogued] == [True, True, True, False, False]


def test_the_vllm_template_pins_nixl_1_5_from_0_33_0_on() -> None:
    """vLLM 0.33.0 refuses to start below NIXL 1.5.0 (no wheel metadata says so): the template's `pins`."""
    for version, nixl in (("0.32.0", "1.4.1"), ("0.33.0", "1.5.0"), ("0.34.0", "1.5.0"), ("0.40.0", "1.5.0")):
        provider, components, _notes = render(_template("vllm"), version, "test")
        assert provider["steps"][3] == ["--no-deps", f"nixl=={nixl}", f"nixl-cu13=={nixl}"], version
        assert components["nixl"] == nixl, version


def pypi_like_index(root: Path) -> None:
    """vLLM and SGLang as PyPI lists them (one abi3 wheel per vLLM release for Python >= 3.10/3.11, one
    cp312 wheel per SGLang release, sdists for vLLM), with this host's platform tag."""
    host = host_platform()
    write_project(root, "vllm", [
        entry
        for version, python in (("0.29.0", ">=3.10,<3.15"), ("0.30.0", ">=3.10,<3.15"), ("0.31.0", ">=3.10,<3.15"),
                                ("0.32.0", ">=3.11,<3.15"), ("0.33.0", ">=3.11,<3.15"),
                                ("0.34.0", ">=3.11,<3.15"))
        for entry in (wheel("vllm", version, requires_python=python, tags=f"cp38-abi3-{host}"),
                      {**sdist("vllm", version), "requires-python": python})
    ])  # fmt: skip
    write_project(root, "sglang", [
        wheel("sglang", version, requires_python=">=3.10", tags=f"cp312-cp312-{host}")
        for version in ("0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
    ])  # fmt: skip


NEW_RELEASES = {("vllm", "0.32.0"), ("vllm", "0.33.0"), ("vllm", "0.34.0"), ("sglang", "0.5.22"), ("sglang", "0.5.23")}


def _without_the_new_releases(path: Path) -> Path:
    """data/runtimes.toml as it was before the new releases were catalogued (they are what discover found)."""
    blocks = (DATA / "runtimes.toml").read_text().split("\n[[runtime]]\n")
    kept = [blocks[0]] + [
        b for b in blocks[1:]
        if (tomllib.loads(b)["backend"], tomllib.loads(b)["version"]) not in NEW_RELEASES
    ]  # fmt: skip
    path.write_text("\n[[runtime]]\n".join(kept))
    assert len(kept) == len(blocks) - len(NEW_RELEASES)
    return path


@pytest.fixture
def before_new_releases(matrix: Matrix, tmp_path: Path) -> Matrix:
    files = [str(DATA / f"{name}.toml") for name in TEMPLATE_CATALOG_FILES if name != "runtimes"]
    result = matrix("catalog", "sync", *files, str(_without_the_new_releases(tmp_path / "runtimes.toml")))
    assert result.exit_code == 0, result.output
    return matrix


def test_discover_turns_the_releases_after_the_catalogued_ones_into_runtimes(
    before_new_releases: Matrix, tmp_path: Path
) -> None:
    pypi_like_index(tmp_path / "index")
    before = before_new_releases.dump()
    with serve_index(tmp_path / "index") as url:
        listed = {backend: before_new_releases("discover", backend, "--index-url", url, "--dry-run", "--json")
                  for backend in ("vllm", "sglang")}  # fmt: skip
        assert before_new_releases.dump() == before
        added = {backend: before_new_releases("discover", backend, "--index-url", url, "--json")
                 for backend in ("vllm", "sglang")}  # fmt: skip
    for result in (*listed.values(), *added.values()):
        assert result.exit_code == 0, result.output
    # Newer than the catalog's newest only: sglang 0.5.20 sits between catalogued releases and stays out.
    assert {v["version"]: v["action"] for v in json.loads(listed["vllm"].output)["versions"]} == {
        "0.32.0": "would add", "0.33.0": "would add", "0.34.0": "would add"
    }  # fmt: skip
    assert {v["version"]: v["action"] for v in json.loads(added["sglang"].output)["versions"]} == {
        "0.5.22": "added", "0.5.23": "added"
    }  # fmt: skip
    assert json.loads(added["vllm"].output)["target"]["python"] == "3.12"

    # What discover made is what the seed catalogues for the same releases (NIXL 1.5.0 from vLLM 0.33.0 on).
    vllm = discovered(before_new_releases, "vllm")
    assert sorted(vllm) == ["0.32.0", "0.33.0", "0.34.0"]
    sglang = discovered(before_new_releases, "sglang")
    assert sorted(sglang) == ["0.5.22", "0.5.23"]
    for backend, found in (("vllm", vllm), ("sglang", sglang)):
        for entry in _catalogued_venv_runtimes(backend):
            if (backend, entry["version"]) in NEW_RELEASES - {("vllm", "0.34.0")}:  # 0.34.0: see the test above
                assert found[entry["version"]] == (entry["provider"], entry["components"]), entry["version"]
    assert vllm["0.33.0"][0]["steps"][3] == ["--no-deps", "nixl==1.5.0", "nixl-cu13==1.5.0"]
    assert vllm["0.32.0"][1]["nixl"] == "1.4.1"

    # The new runtimes are cells of the backends' cases, and the ones nobody has run yet.
    plan = before_new_releases("plan", "--runtime", "vllm=0.33.0", "--runtime", "sglang=0.5.23", "--json")
    assert plan.exit_code == 0, plan.output
    cells = {c["cell"] for c in json.loads(plan.output)["cells"]}
    assert {"vllm_disaggregated@vllm-0.33.0", "vllm_native_disaggregated@vllm-0.33.0",
            "sglang_disaggregated@sglang-0.5.23", "sglang_native_disaggregated@sglang-0.5.23"} <= cells  # fmt: skip
