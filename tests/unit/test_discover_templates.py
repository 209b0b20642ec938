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

from matrix.catalog.template import render
from tests.helpers.catalogs import discovered, host_platform
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
    assert [e["version"] for e in catalogued] == ["0.29.0", "0.30.0", "0.31.0"]
    for entry in catalogued:
        provider, components, _notes = render(_template("vllm"), entry["version"], "test")
        assert provider == entry["provider"], entry["version"]
        assert components == entry["components"], entry["version"]


def test_the_sglang_template_rendered_for_a_catalogued_release_is_that_runtime_less_the_kernel() -> None:
    """Same recipe; the components lack only sglang-kernel, whose pin each release chooses (0.4.6.post1 for
    0.5.18/0.5.19, 0.4.7 for 0.5.21), which a template filling in {version} cannot know."""
    catalogued = _catalogued_venv_runtimes("sglang")
    assert [e["version"] for e in catalogued] == ["0.5.18", "0.5.19", "0.5.21"]
    for entry in catalogued:
        provider, components, _notes = render(_template("sglang"), entry["version"], "test")
        assert provider == entry["provider"], entry["version"]
        expected = {k: v for k, v in entry["components"].items() if k != "sglang-kernel"}
        assert components == expected and "sglang-kernel" in entry["components"], entry["version"]


def pypi_like_index(root: Path) -> None:
    """vLLM and SGLang as PyPI lists them (one abi3 wheel per vLLM release for Python >= 3.10/3.11, one
    cp312 wheel per SGLang release, sdists for vLLM), with this host's platform tag."""
    host = host_platform()
    write_project(root, "vllm", [
        entry
        for version, python in (("0.29.0", ">=3.10,<3.15"), ("0.30.0", ">=3.10,<3.15"), ("0.31.0", ">=3.10,<3.15"),
                                ("0.32.0", ">=3.11,<3.15"), ("0.33.0", ">=3.11,<3.15"))
        for entry in (wheel("vllm", version, requires_python=python, tags=f"cp38-abi3-{host}"),
                      {**sdist("vllm", version), "requires-python": python})
    ])  # fmt: skip
    write_project(root, "sglang", [
        wheel("sglang", version, requires_python=">=3.10", tags=f"cp312-cp312-{host}")
        for version in ("0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
    ])  # fmt: skip


def test_discover_turns_the_releases_after_the_catalogued_ones_into_runtimes(
    catalogued: Matrix, tmp_path: Path
) -> None:
    pypi_like_index(tmp_path / "index")
    before = catalogued.dump()
    with serve_index(tmp_path / "index") as url:
        listed = {backend: catalogued("discover", backend, "--index-url", url, "--dry-run", "--json")
                  for backend in ("vllm", "sglang")}  # fmt: skip
        assert catalogued.dump() == before
        added = {backend: catalogued("discover", backend, "--index-url", url, "--json")
                 for backend in ("vllm", "sglang")}  # fmt: skip
    for result in (*listed.values(), *added.values()):
        assert result.exit_code == 0, result.output
    # Newer than the catalog's newest only: sglang 0.5.20 sits between catalogued releases and stays out.
    assert {v["version"]: v["action"] for v in json.loads(listed["vllm"].output)["versions"]} == {
        "0.32.0": "would add", "0.33.0": "would add"
    }  # fmt: skip
    assert {v["version"]: v["action"] for v in json.loads(added["sglang"].output)["versions"]} == {
        "0.5.22": "added", "0.5.23": "added"
    }  # fmt: skip
    assert json.loads(added["vllm"].output)["target"]["python"] == "3.12"

    vllm = discovered(catalogued, "vllm")
    assert sorted(vllm) == ["0.32.0", "0.33.0"]
    provider, components = vllm["0.33.0"]
    assert provider == {
        "kind": "venv", "python": "3.12", "env": {"VLLM_USE_FLASHINFER_SAMPLER": "0"},
        "steps": [
            ["vllm==0.33.0", "ai-dynamo-runtime==1.6.1"],
            {"requirements_of": "ai-dynamo==1.6.1", "exclude": ["aisimulate"]},
            ["--no-deps", "ai-dynamo==1.6.1"],
            ["--no-deps", "nixl==1.4.1", "nixl-cu13==1.4.1"],
            {"expose": "vllm/vllm-rs"},
        ],
    }  # fmt: skip
    assert components == {"vllm": "0.33.0", "vllm-rs": "0.33.0", "ai-dynamo": "1.6.1", "nixl": "1.4.1"}

    sglang = discovered(catalogued, "sglang")
    assert sorted(sglang) == ["0.5.22", "0.5.23"]
    provider, components = sglang["0.5.22"]
    assert provider["steps"][0] == {"requirements_of": "sglang==0.5.22", "exclude": ["cuda-tile"],
                                    "with": ["ai-dynamo-runtime==1.6.1"]}  # fmt: skip
    assert provider["steps"][2] == ["--no-deps", "sglang==0.5.22", "ai-dynamo==1.6.1"]
    assert provider["steps"][4] == {"alias": "sglang-grpc-bridge", "of": "sglang"}
    assert components == {"sglang": "0.5.22", "sglang-grpc-bridge": "0.5.22", "ai-dynamo": "1.6.1", "nixl": "1.5.0"}

    # The new runtimes are cells of the backends' cases, and the ones nobody has run yet.
    plan = catalogued("plan", "--runtime", "vllm=0.33.0", "--runtime", "sglang=0.5.23", "--json")
    assert plan.exit_code == 0, plan.output
    cells = {c["cell"] for c in json.loads(plan.output)["cells"]}
    assert {"vllm_disaggregated@vllm-0.33.0", "vllm_native_disaggregated@vllm-0.33.0",
            "sglang_disaggregated@sglang-0.5.23", "sglang_native_disaggregated@sglang-0.5.23"} <= cells  # fmt: skip

