"""`matrix discover` against a real PEP 691 index on loopback (files served by http.server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.catalogs import DISCOVER_CATALOG
from tests.helpers.cli import DATA, Matrix
from tests.helpers.pep691 import sdist, serve_index, wheel, write_project


def index_files(root: Path) -> None:
    write_project(root, "ref-pkg", [
        wheel("ref-pkg", "0.9.0"),
        wheel("ref-pkg", "1.0.0"), sdist("ref-pkg", "1.0.0"),
        # One file yanked, the other not: the version is not yanked (PEP 592).
        wheel("ref-pkg", "1.1.0", yanked=True), sdist("ref-pkg", "1.1.0"),
        wheel("ref-pkg", "1.2.0", yanked="broken NIXL pin"), sdist("ref-pkg", "1.2.0", yanked=True),
        wheel("ref-pkg", "1.3.0rc1"),
        wheel("ref-pkg", "1.3.0.dev2"),
        wheel("ref-pkg", "1.3.0"),
        {"filename": "ref_pkg-notaversion!.tar.gz", "url": "x", "hashes": {}},
        {"filename": "README.txt", "url": "x", "hashes": {}},
        {"url": "no-filename", "hashes": {}},
        "not even a table",
    ])  # fmt: skip


@pytest.fixture
def catalog(matrix: Matrix, tmp_path: Path) -> Matrix:
    path = tmp_path / "refpkg.toml"
    path.write_text(DISCOVER_CATALOG)
    result = matrix("catalog", "sync", str(path), str(DATA / "markers.toml"))
    assert result.exit_code == 0, result.output
    return matrix


@pytest.fixture
def index(tmp_path: Path) -> str:
    index_files(tmp_path / "index")
    with serve_index(tmp_path / "index") as url:
        yield url


def runtimes(m: Matrix, backend: str = "refpkg") -> dict[str, tuple[str, str, str, str]]:
    rows = m.sql(
        "SELECT runtime.version, runtime.source, runtime.channel, runtime.provider, runtime.retired FROM runtime "
        "JOIN backend ON backend.id = runtime.backend_id WHERE backend.name = ?",
        backend,
    )
    return {str(v): (str(s), str(c), str(p), str(r)) for v, s, c, p, r in rows}


def test_dry_run_lists_new_versions_skips_yanked_and_malformed_and_changes_nothing(catalog: Matrix, index: str) -> None:
    before = catalog.dump()
    result = catalog("discover", "refpkg", "--index-url", index, "--dry-run")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "1.1.0" in out and "1.3.0" in out and "would add" in out
    assert "yanked, skipped: broken NIXL pin" in out  # 1.2.0: every file yanked, the reason shown
    assert "1.3.0rc1" not in out and "1.3.0.dev2" not in out and "0.9.0" not in out  # release channel, older
    assert "notaversion" in out and "README.txt" in out  # malformed entries are said, not fatal
    assert "2 version(s) would be added" in out
    assert catalog.dump() == before
    # The index was asked for the JSON API at the normalized project name.
    assert serve_index.requests[-1] == {"path": "/simple/ref-pkg/", "accept": "application/vnd.pypi.simple.v1+json"}  # type: ignore[attr-defined]


def test_discover_adds_discovered_runtimes_from_the_template(catalog: Matrix, index: str) -> None:
    result = catalog("discover", "refpkg", "--index-url", index, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert {v["version"]: v["action"] for v in data["versions"]} == {
        "1.1.0": "added", "1.2.0": "yanked", "1.3.0": "added"
    }  # fmt: skip
    assert data["newest_known"] == "1.0.0" and len(data["malformed"]) == 4
    rows = runtimes(catalog)
    assert set(rows) == {"1.0.0", "1.1.0", "1.3.0"}
    assert rows["1.3.0"][0] == "discovered" and rows["1.3.0"][1] == "release"
    assert json.loads(rows["1.3.0"][2]) == {"kind": "builtin", "env": {"REF_PKG": "1.3.0"}}
    components = catalog.sql(
        "SELECT runtime_component.name, runtime_component.version FROM runtime_component "
        "JOIN runtime ON runtime.id = runtime_component.runtime_id WHERE runtime.version = ?", "1.1.0"
    )  # fmt: skip
    assert components == [("ref-pkg", "1.1.0")]
    # Nothing newer now: a second discover adds nothing.
    again = catalog("discover", "refpkg", "--index-url", index)
    assert again.exit_code == 0 and "no new version" in again.output
    assert set(runtimes(catalog)) == {"1.0.0", "1.1.0", "1.3.0"}


def test_channels_take_pre_and_dev_releases(catalog: Matrix, index: str) -> None:
    rc = catalog("discover", "refpkg", "--index-url", index, "--channel", "rc", "--json")
    assert rc.exit_code == 0, rc.output
    added = {v["version"] for v in json.loads(rc.output)["versions"] if v["action"] == "added"}
    assert added == {"1.1.0", "1.3.0rc1", "1.3.0"}
    assert runtimes(catalog)["1.3.0rc1"][1] == "rc"


def test_dev_channel_takes_dev_releases(catalog: Matrix, index: str) -> None:
    dev = catalog("discover", "refpkg", "--index-url", index, "--channel", "dev", "--json")
    added = {v["version"] for v in json.loads(dev.output)["versions"] if v["action"] == "added"}
    assert added == {"1.1.0", "1.3.0.dev2", "1.3.0rc1", "1.3.0"}


def test_discovered_runtimes_survive_catalog_sync(catalog: Matrix, index: str, tmp_path: Path) -> None:
    assert catalog("discover", "refpkg", "--index-url", index).exit_code == 0
    # The same file again, then the same file with --prune: discovered rows are nobody's file's rows.
    for extra in ((), ("--prune",)):
        result = catalog("catalog", "sync", str(tmp_path / "refpkg.toml"), str(DATA / "markers.toml"), *extra)
        assert result.exit_code == 0, result.output
        rows = runtimes(catalog)
        assert rows["1.1.0"][3] in ("0", "False") and rows["1.3.0"][3] in ("0", "False"), rows
        assert "retired" not in result.output or "1.3.0" not in result.output


def test_index_url_comes_from_pip_env_then_pip_config(
    catalog: Matrix, index: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    config = tmp_path / "pip.conf"
    config.write_text(f"[global]\nindex-url = {index}\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    result = catalog("discover", "refpkg", "--dry-run")
    assert result.exit_code == 0, result.output
    assert index in result.output
    monkeypatch.setenv("PIP_INDEX_URL", index.replace("/simple", "/html"))  # the env wins over the file
    result = catalog("discover", "refpkg", "--dry-run")
    assert result.exit_code == 2 and "not the JSON simple API" in result.output


def test_credentials_in_the_index_url_are_not_printed(catalog: Matrix, index: str) -> None:
    with_secret = index.replace("http://", "http://user:s3cr3t-token@")
    result = catalog("discover", "refpkg", "--index-url", with_secret, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "s3cr3t-token" not in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("nosuch",), "unknown backend 'nosuch'"),
        (("plain",), "declares no runtime_template"),
        (("refpkg", "--package", "other-pkg"), "'other-pkg' is not on the index"),
        (("refpkg", "--html"), "not the JSON simple API"),
        (("refpkg", "--dead"), "cannot read"),
    ],
)
def test_bad_input_is_one_message_exit_2_database_unchanged(
    catalog: Matrix, index: str, args: tuple[str, ...], message: str
) -> None:
    url = index
    if "--html" in args:
        url, args = index.replace("/simple", "/html"), args[:1]
    if "--dead" in args:
        url, args = "http://127.0.0.1:9/simple", args[:1]
    before = catalog.dump()
    result = catalog("discover", *args, "--index-url", url)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert catalog.dump() == before


def test_a_template_with_an_unknown_placeholder_fails_the_sync(matrix: Matrix, tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[[backend]]\nname = "x"\nruntime_template = { provider = { kind = "builtin" }, '
                    'components = { x = "{vresion}" } }\n')  # fmt: skip
    result = matrix("catalog", "sync", str(path))
    assert result.exit_code == 2
    assert "unknown placeholder {vresion}" in result.output


PYTHON_CATALOG = """
[[backend]]
name = "pyref"
runtime_template = { package = "py-ref", provider = { kind = "venv", python = "3.11", \
steps = [["py-ref=={version}"]] }, components = { py-ref = "{version}" } }

[[runtime]]
backend = "pyref"
version = "1.0.0"
provider = { kind = "builtin" }
"""


def test_versions_whose_files_all_refuse_the_templates_python_are_skipped_and_said(
    matrix: Matrix, tmp_path: Path
) -> None:
    (tmp_path / "pyref.toml").write_text(PYTHON_CATALOG)
    assert matrix("catalog", "sync", str(tmp_path / "pyref.toml"), str(DATA / "markers.toml")).exit_code == 0
    write_project(tmp_path / "index", "py-ref", [
        wheel("py-ref", "1.1.0", requires_python=">=3.10"),
        wheel("py-ref", "1.2.0", requires_python=">=3.12"),
        # One file for 3.12+, one without the field: pip may take the second, so the version stays.
        wheel("py-ref", "1.3.0", requires_python=">=3.12"), sdist("py-ref", "1.3.0"),
        wheel("py-ref", "1.4.0", requires_python="not a specifier"),
        wheel("py-ref", "1.5.0", requires_python=">=3.11,<3.11.5"),
    ])  # fmt: skip
    with serve_index(tmp_path / "index") as url:
        result = matrix("discover", "pyref", "--index-url", url)
    assert result.exit_code == 0, result.output
    assert "Requires-Python >=3.12 excludes the template's interpreter" in result.output
    assert sorted(runtimes(matrix, "pyref")) == ["1.0.0", "1.1.0", "1.3.0", "1.4.0", "1.5.0"]


def _host_platform() -> str:
    """A platform tag of this host that pip accepts (the most specific manylinux one where there is one)."""
    from packaging.tags import platform_tags

    tags = list(platform_tags())
    return next((t for t in tags if t.startswith("manylinux_")), tags[0])


def platform_index(root: Path) -> None:
    """py-ref releases whose files pip could or could not install into a Python 3.11 venv on this host."""
    host = _host_platform()
    write_project(root, "py-ref", [
        wheel("py-ref", "1.1.0", tags="cp312-cp312-manylinux_2_28_aarch64"),  # another Python and machine only
        wheel("py-ref", "1.2.0", tags="cp311-cp311-macosx_11_0_arm64"),  # other systems only
        wheel("py-ref", "1.2.0", tags="cp311-cp311-win_amd64"),
        wheel("py-ref", "1.3.0", tags=f"cp312-cp312-{host}"),  # this platform, another Python
        wheel("py-ref", "1.4.0", tags=f"cp311-cp311-{host}"),  # exactly this host
        wheel("py-ref", "1.5.0", tags="cp311-cp311-macosx_11_0_arm64"), sdist("py-ref", "1.5.0"),  # pip builds it
        wheel("py-ref", "1.6.0", tags=f"cp38-abi3-{host}"),  # the stable ABI: any CPython from 3.8
        wheel("py-ref", "1.7.0", tags="py2.py3-none-any"),
        # A wheel for this host that refuses 3.11, and a foreign one that accepts it: nothing installable.
        wheel("py-ref", "1.8.0", tags=f"cp311-cp311-{host}", requires_python=">=3.12"),
        wheel("py-ref", "1.8.0", tags="cp311-cp311-win_amd64"),
    ])  # fmt: skip


def test_versions_without_a_wheel_for_this_host_or_an_sdist_are_skipped_and_said(
    matrix: Matrix, tmp_path: Path
) -> None:
    """A release whose only wheels are for another platform or Python is not a runtime pip could build here:
    listed with its wheels, not added. The venv's interpreter is the template's `python` (3.11)."""
    (tmp_path / "pyref.toml").write_text(PYTHON_CATALOG)
    assert matrix("catalog", "sync", str(tmp_path / "pyref.toml"), str(DATA / "markers.toml")).exit_code == 0
    platform_index(tmp_path / "index")
    with serve_index(tmp_path / "index") as url:
        listed = matrix("discover", "pyref", "--index-url", url, "--dry-run", "--json")
        result = matrix("discover", "pyref", "--index-url", url)
    assert listed.exit_code == 0, listed.output
    data = json.loads(listed.output)
    assert {v["version"]: v["action"] for v in data["versions"]} == {
        "1.1.0": "platform", "1.2.0": "platform", "1.3.0": "platform", "1.4.0": "would add",
        "1.5.0": "would add", "1.6.0": "would add", "1.7.0": "would add", "1.8.0": "platform",
    }  # fmt: skip
    assert data["target"] == {"python": "3.11", "platform": _host_platform()}
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert f"skipped: no sdist and no wheel pip could install into Python 3.11 on {_host_platform()}" in out
    assert "(wheels: cp312-cp312-manylinux_2_28_aarch64)" in out
    assert "(wheels: cp311-cp311-macosx_11_0_arm64, cp311-cp311-win_amd64)" in out
    assert sorted(runtimes(matrix, "pyref")) == ["1.0.0", "1.4.0", "1.5.0", "1.6.0", "1.7.0"]


def test_bisect_from_index_leaves_out_versions_pip_could_not_install_here(matrix: Matrix, tmp_path: Path) -> None:
    """`bisect --from-index` walks the same versions with the same checks (`fill_between`)."""
    from matrix.db.engine import create_db_engine, session_factory, transaction
    from matrix.discover import fill_between

    (tmp_path / "pyref.toml").write_text(PYTHON_CATALOG)
    assert matrix("catalog", "sync", str(tmp_path / "pyref.toml"), str(DATA / "markers.toml")).exit_code == 0
    platform_index(tmp_path / "index")
    engine = create_db_engine(matrix.url)
    try:
        with serve_index(tmp_path / "index") as url, transaction(session_factory(engine)) as session:
            found = fill_between(session, "pyref", "1.2.0", "1.8.0", index_url=url)
    finally:
        engine.dispose()
    assert {f.version: f.action for f in found.found} == {
        "1.2.0": "platform", "1.3.0": "platform", "1.4.0": "added", "1.5.0": "added", "1.6.0": "added",
        "1.7.0": "added", "1.8.0": "platform",
    }  # fmt: skip
    assert sorted(runtimes(matrix, "pyref")) == ["1.0.0", "1.4.0", "1.5.0", "1.6.0", "1.7.0"]
