"""Offline provisioning for real: `matrix runtime wheelhouse` downloads small wheels from the index, then
`matrix runtime provision --find-links DIR --offline` builds the environment with no index reachable (pip's
index points at a closed port and every pip configuration file is ignored). A missing or altered wheel and
a runtime the wheelhouse lacks are config errors that name what to run; a foreign target's resolution
picks its own wheels and honours its environment markers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from matrix.cells import RuntimeInfo
from matrix.launch.providers import Environment, NotProvisioned, ensure_provisioned, prepare
from matrix.launch.providers.recipe import parse_venv
from matrix.launch.providers.venv import resolve_target
from matrix.launch.providers.venv.installer import find_uv
from matrix.launch.providers.wheelhouse import ProvisionSource
from matrix.launch.providers.wheeltarget import this_host
from tests.helpers.cli import Matrix, toml_value

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

# six; requests' requirements without two of them (idna, certifi), resolved together with an idna pin older
# than the newest; requests itself; a file of a wheel.
TOY = {
    "kind": "venv",
    "steps": [
        ["six==1.16.0"],
        {"requirements_of": "requests==2.32.3", "exclude": ["urllib3", "charset-normalizer"], "with": ["idna==3.10"]},
        ["--no-deps", "requests==2.32.3"],
        {"extract": "six==1.16.0", "member": "six.py"},
    ],
}
SMALL = {"kind": "venv", "steps": [["six==1.16.0"], ["--no-deps", "idna==3.10"]]}
BINARY = {"kind": "venv", "steps": [["markupsafe==3.0.2"]]}
# pytest 8.3.3 needs tomli and exceptiongroup below Python 3.11 only.
MARKERS = {"kind": "venv", "steps": [{"requirements_of": "pytest==8.3.3"}]}
CATALOG = """
[[backend]]
name = "toy"

[[runtime]]
backend = "toy"
version = "1.0"
provider = @TOY@
components = { six = "1.16.0", requests = "2.32.3" }

[[runtime]]
backend = "toy"
version = "2.0"
provider = @SMALL@
components = { six = "1.16.0", idna = "3.10" }

[[runtime]]
backend = "toy"
version = "3.0"
provider = @BINARY@

[[runtime]]
backend = "toy"
version = "4.0"
provider = @MARKERS@

[[runtime]]
backend = "toy"
version = "9.0"
provider = { kind = "host" }
"""
# No index and no local mirror: pip fails rather than fetch anything.
OFFLINE = {"PIP_INDEX_URL": "http://127.0.0.1:9/", "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "",
           "PIP_CONFIG_FILE": os.devnull, "PIP_EXTRA_INDEX_URL": ""}  # fmt: skip


def _matrix(tmp: Path) -> Matrix:
    home = tmp / "home"
    home.mkdir(parents=True)
    m = Matrix(home=home, db_path=home / "matrix.db")
    text = CATALOG
    for name, provider in (("TOY", TOY), ("SMALL", SMALL), ("BINARY", BINARY), ("MARKERS", MARKERS)):
        text = text.replace(f"@{name}@", toml_value(provider))
    (tmp / "toy.toml").write_text(text)
    result = m("catalog", "sync", str(tmp / "toy.toml"))
    assert result.exit_code == 0, result.output
    return m


def _run(m: Matrix, *args: str, offline: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**m.env, **(OFFLINE if offline else {})}
    return subprocess.run([sys.executable, "-m", "matrix", *args], env=env, capture_output=True, text=True,
                          timeout=150, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """toy-1.0 locked for this host, certifi left to the host (the test's own interpreter has it)."""
    tmp = tmp_path_factory.mktemp("wheelhouse")
    host = this_host()
    m = _matrix(tmp)
    out = tmp / "wh"
    done = _run(m, "runtime", "wheelhouse", "--runtime", "toy=1.0", "--python", host.python, "--platform",
                host.platforms[0], "--out", str(out), "--exclude", "certifi")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "[3/3] " in done.stderr and "3 file(s)" in done.stderr  # six, idna, requests; one line each
    return out


def _copy(wheelhouse: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(wheelhouse, tmp_path / "wh"))


def test_manifest_locks_each_step_and_leaves_excluded_names_to_the_host(wheelhouse: Path) -> None:
    manifest = json.loads((wheelhouse / "wheelhouse.json").read_text())
    host = this_host()
    assert manifest["target"] == {"python": host.python, "platforms": [host.platforms[0]],
                                  "key_platform": host.key_platform}  # fmt: skip
    lock = manifest["runtimes"]["toy-1.0"]
    runtime = RuntimeInfo(backend="toy", version="1.0", tag="v1.0", provider=TOY)
    assert lock["key"] == resolve_target(runtime).recipe_key  # what provisioning on this host looks for
    steps = lock["steps"]
    assert [f["name"] for f in steps[0]["install"]] == ["six"]
    assert [f["name"] for f in steps[1]["install"]] == ["idna"] and steps[1]["source"]["name"] == "requests"
    assert steps[1]["install"][0]["version"] == "3.10"  # the step's `with` pin, resolved in the same call
    assert steps[1]["excluded"] == ["certifi"] and lock["excluded"] == ["certifi"]
    assert [f["name"] for f in steps[2]["install"]] == ["requests"]
    assert steps[3]["install"] == [] and steps[3]["source"]["filename"] == "six-1.16.0-py2.py3-none-any.whl"
    files = sorted(p.name for p in wheelhouse.iterdir() if p.suffix == ".whl")
    assert len(files) == 3 and not any(name.startswith("certifi") for name in files)
    for step in steps:
        for file in step["install"]:
            assert (wheelhouse / file["filename"]).stat().st_size == file["size"]
    # The command that made it, every option spelled out: the upload can be rebuilt from the manifest alone.
    assert manifest["commands"] == [
        f"matrix runtime wheelhouse --runtime toy=1.0 --python {host.python} --platform {host.platforms[0]} "
        f"--out {wheelhouse} --exclude certifi"
    ]


def test_each_runtime_gets_a_pep751_lock_that_uv_installs_offline(wheelhouse: Path, tmp_path: Path) -> None:
    pylock = wheelhouse / "pylock.toy-1_0.toml"
    document = tomllib.loads(pylock.read_text())
    assert document["lock-version"] == "1.0" and document["created-by"] == "matrix"
    manifest = json.loads((wheelhouse / "wheelhouse.json").read_text())
    installed = {f["filename"]: f for s in manifest["runtimes"]["toy-1.0"]["steps"] for f in s["install"]}
    assert {p["name"] for p in document["packages"]} == {"six", "idna", "requests"}  # certifi: the host's
    for package in document["packages"]:
        (wheel,) = package["wheels"]
        assert wheel["hashes"]["sha256"] == installed[wheel["path"]]["sha256"]
    # A standard installer takes it as it is, with no index: uv installs exactly those files.
    uv = find_uv()
    assert uv is not None
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(tmp_path / "env")], check=True)
    done = subprocess.run(
        [uv, "pip", "install", "--offline", "--no-index", "--python", str(tmp_path / "env" / "bin" / "python"),
         "-r", str(pylock)],
        capture_output=True, text=True, env={**os.environ, **OFFLINE}, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    frozen = subprocess.run([uv, "pip", "freeze", "--python", str(tmp_path / "env" / "bin" / "python")],
                            capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert sorted(frozen) == ["idna==3.10", "requests==2.32.3", "six==1.16.0"]


def test_offline_provision_builds_from_the_wheelhouse(
    wheelhouse: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = _matrix(tmp_path)
    directory = _copy(wheelhouse, tmp_path)
    done = _run(m, "runtime", "provision", "--runtime", "toy=1.0", "--find-links", str(directory), "--offline",
                offline=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 of 1 runtime(s) provisioned" in done.stdout
    runtime = RuntimeInfo(backend="toy", version="1.0", tag="v1.0", provider=TOY,
                          components={"six": "1.16.0", "requests": "2.32.3"})  # fmt: skip
    monkeypatch.setenv("MATRIX_HOME", str(m.home))  # prepare() looks in this test's data directory
    environment = prepare(runtime)
    assert isinstance(environment, Environment), environment
    path = Path(environment.env["VIRTUAL_ENV"])
    info = json.loads((path / "env.json").read_text())
    assert info["components"] == {"six": "1.16.0", "requests": "2.32.3"}
    assert info["source"]["wheelhouse"] == str(directory)
    assert set(info["source"]["from_host"]) == {"certifi"}
    frozen = {line.split(" ")[0].split("==")[0].lower() for line in info["freeze"]}
    assert {"six", "idna", "requests"} <= frozen and "certifi" not in frozen  # the host's, not the env's
    assert any(line.startswith("idna @ ") and "/idna-3.10-" in line for line in info["freeze"])
    assert "offline: provided by the host: certifi" in (path / "provision.log").read_text()
    assert (path / "bin" / "six.py").is_file()
    code = "import requests.certs, idna; print(requests.certs.where())"  # certifi comes from the host
    ran = subprocess.run([environment.python, "-c", code], capture_output=True, text=True, check=False,
                         env={**os.environ, **environment.env})  # fmt: skip
    assert ran.returncode == 0 and ran.stdout.strip(), ran.stderr


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_missing_or_altered_wheel_is_a_config_error_and_builds_nothing(
    wheelhouse: Path, tmp_path: Path, damage: str
) -> None:
    m = _matrix(tmp_path)
    directory = _copy(wheelhouse, tmp_path)
    wheel = next(directory.glob("idna-*.whl"))
    if damage == "missing":
        wheel.unlink()
    else:
        wheel.write_bytes(wheel.read_bytes() + b"x")
    done = _run(m, "runtime", "provision", "--runtime", "toy=1.0", "--find-links", str(directory), "--offline",
                offline=True)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    expected = f"lacks {wheel.name} (idna" if damage == "missing" else f"{wheel} does not match its checksum"
    assert expected in done.stderr
    assert f"matrix runtime wheelhouse --runtime toy=1.0 --python {this_host().python}" in done.stderr
    envs = m.home / "envs"
    assert not [p for p in envs.iterdir() if p.is_dir()]  # no environment, no build leftovers


def test_a_runtime_the_wheelhouse_lacks_and_merging_another_into_it(
    wheelhouse: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = _matrix(tmp_path)
    directory = _copy(wheelhouse, tmp_path)
    small = RuntimeInfo(backend="toy", version="2.0", tag="v2.0", provider=SMALL,
                        components={"six": "1.16.0", "idna": "3.10"})  # fmt: skip
    source = ProvisionSource.of(directory, offline=True)
    monkeypatch.setenv("MATRIX_HOME", str(m.home))
    # What `matrix run --offline` does before its cells: the failure becomes the cells' skip reason.
    failures = ensure_provisioned([small], lambda _line: None, source)
    assert "it has no lock of this runtime; make it with `matrix runtime wheelhouse --runtime toy=2.0" in (
        failures["toy-2.0"]
    )
    skipped = prepare(small)
    assert isinstance(skipped, NotProvisioned) and "has no lock of this runtime" in skipped.reason

    host = this_host()
    done = _run(m, "runtime", "wheelhouse", "--runtime", "toy=2.0", "--python", host.python, "--platform",
                host.platforms[0], "--out", str(directory))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "already there" in done.stderr  # six is kept, not downloaded again
    manifest = json.loads((directory / "wheelhouse.json").read_text())
    assert set(manifest["runtimes"]) == {"toy-1.0", "toy-2.0"}  # added, the earlier one kept
    assert manifest["runtimes"]["toy-2.0"]["key"] == resolve_target(small).recipe_key


def test_bad_wheelhouse_input_exits_2(tmp_path: Path) -> None:
    m = _matrix(tmp_path)
    before = m.dump()
    cases = {
        ("runtime", "wheelhouse", "--runtime", "toy=9.0", "--out", str(tmp_path / "x")): "toy-9.0 is a host runtime",
        ("runtime", "wheelhouse", "--runtime", "toy=7.0", "--out", str(tmp_path / "x")): "unknown runtime toy=7.0",
        ("runtime", "wheelhouse", "--python", "3", "--platform", "manylinux_2_39_x86_64", "--out", str(tmp_path)):
            "--python '3' is not a Python version",
        ("runtime", "wheelhouse", "--runtime", "toy=2.0", "--out", "/proc/matrix-no"): "cannot write there",
        ("runtime", "provision", "--offline"): "--offline needs --find-links DIR",
        ("run", "--offline", "--find-links", str(tmp_path)): f"--find-links {tmp_path} has no wheelhouse.json",
    }  # fmt: skip
    for args, message in cases.items():
        result = m(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
    assert m.dump() == before


def test_a_foreign_target_gets_its_own_wheels_and_markers(tmp_path: Path) -> None:
    m = _matrix(tmp_path)
    cp312 = tmp_path / "cp312"
    done = _run(m, "runtime", "wheelhouse", "--runtime", "toy=3.0", "--python", "3.12", "--platform",
                "manylinux_2_39_x86_64", "--out", str(cp312))  # fmt: skip
    assert done.returncode == 0, done.stderr
    lock = json.loads((cp312 / "wheelhouse.json").read_text())["runtimes"]["toy-3.0"]
    (wheel,) = lock["steps"][0]["install"]
    assert wheel["filename"].startswith("MarkupSafe-3.0.2-cp312-cp312-manylinux")  # not this host's cp3XY
    assert lock["key"] == parse_venv(BINARY, "toy-3.0").key("3.12", "linux-x86_64")

    py310 = tmp_path / "py310"  # older than any Python matrix runs on: markers must be the target's
    done = _run(m, "runtime", "wheelhouse", "--runtime", "toy=4.0", "--python", "3.10", "--platform",
                "manylinux_2_28_x86_64", "--out", str(py310))  # fmt: skip
    assert done.returncode == 0, done.stderr
    lock = json.loads((py310 / "wheelhouse.json").read_text())["runtimes"]["toy-4.0"]
    names = {f["name"].lower() for f in lock["steps"][0]["install"]}
    assert {"tomli", "exceptiongroup", "pluggy", "iniconfig"} <= names
