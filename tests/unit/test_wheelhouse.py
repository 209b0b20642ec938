"""Wheelhouse pieces without the network: a target's platform tags and marker environment, the manifest
(written, read, merged), its file checks and the --find-links/--offline options."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from matrix.errors import ConfigError
from matrix.launch.providers.recipe import VenvRecipe, select_requirements
from matrix.launch.providers.venv import host_platform
from matrix.launch.providers.wheelhouse import (
    MANIFEST_NAME,
    LockedFile,
    LockedStep,
    Manifest,
    ProvisionSource,
    RuntimeLock,
    check_files,
    file_sha256,
    read_manifest,
    write_manifest,
)
from matrix.launch.providers.wheeltarget import WheelTarget, expand_platforms, this_host


def test_manylinux_expands_to_every_older_glibc_and_the_legacy_names() -> None:
    tags = expand_platforms(["manylinux_2_39_x86_64"])
    assert tags[0] == "manylinux_2_39_x86_64"
    # llguidance 1.7.6 ships only manylinux_2_31, cryptography manylinux_2_34: both must be accepted.
    assert {"manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_5_x86_64"} <= set(tags)
    assert tags.index("manylinux2014_x86_64") == tags.index("manylinux_2_17_x86_64") + 1
    assert tags.index("manylinux2010_x86_64") == tags.index("manylinux_2_12_x86_64") + 1
    assert tags[-2:] == ("manylinux_2_5_x86_64", "manylinux1_x86_64")
    assert len(tags) == len(set(tags)) == 35 + 3


def test_other_architectures_and_spellings() -> None:
    arm = expand_platforms(["manylinux_2_28_aarch64"])
    assert arm[-2:] == ("manylinux_2_17_aarch64", "manylinux2014_aarch64")  # no older manylinux for aarch64
    assert expand_platforms(["manylinux2014_x86_64"])[0] == "manylinux_2_17_x86_64"
    assert expand_platforms(["musllinux_1_2_x86_64"]) == (
        "musllinux_1_2_x86_64", "musllinux_1_1_x86_64", "musllinux_1_0_x86_64",
    )  # fmt: skip
    assert expand_platforms(["linux_x86_64"]) == ("linux_x86_64",)
    both = expand_platforms(["manylinux_2_17_x86_64", "manylinux_2_28_x86_64"])  # repeated --platform
    assert len(both) == len(set(both)) and set(both) == set(expand_platforms(["manylinux_2_28_x86_64"]))


@pytest.mark.parametrize(
    ("python", "platforms", "message"),
    [
        ("3", ["manylinux_2_39_x86_64"], "--python '3' is not a Python version: write major.minor"),
        ("3.12", [], "give the target's platform"),
        ("3.12", ["macosx_11_0_arm64"], "--platform 'macosx_11_0_arm64' is not a Linux wheel platform tag"),
        ("3.12", ["manylinux_2_39_x86_64", "manylinux_2_28_aarch64"], "several architectures (aarch64, x86_64)"),
    ],
)
def test_bad_targets_say_what_to_write(python: str, platforms: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        WheelTarget.of(python, platforms)


def test_target_marker_environment_selects_requirements_for_the_target() -> None:
    metadata = (
        'Requires-Dist: tomli>=1; python_version < "3.11"\n'
        'Requires-Dist: pywin32; sys_platform == "win32"\n'
        'Requires-Dist: uvloop; platform_machine == "x86_64"\n'
        "Requires-Dist: six\n"
    )
    old = WheelTarget.of("3.10", ["manylinux_2_28_x86_64"]).marker_environment()
    new = WheelTarget.of("3.12", ["manylinux_2_28_aarch64"]).marker_environment()
    assert old["python_version"] == "3.10" and old["platform_machine"] == "x86_64"
    assert select_requirements(metadata, old).install == ("tomli>=1", "uvloop", "six")
    assert select_requirements(metadata, new).install == ("six",)


def test_key_platform_is_what_the_target_host_computes() -> None:
    host = this_host()
    assert host.python == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert host.key_platform == host_platform()  # on a Linux host, whatever its glibc
    recipe = VenvRecipe(python="", steps=())
    assert recipe.key(host.python, host.key_platform) == recipe.key(host.python, host_platform())


def _file(name: str, data: bytes, directory: Path) -> LockedFile:
    filename = f"{name}-1.0-py3-none-any.whl"
    (directory / filename).write_bytes(data)
    return LockedFile(filename, name, "1.0", file_sha256(directory / filename), len(data))


def _lock(label: str, key: str, *files: LockedFile) -> RuntimeLock:
    return RuntimeLock(label, key, (LockedStep("pip install x", install=files, excluded=("torch",)),), ("torch",))


def test_manifest_round_trip_and_merge(tmp_path: Path) -> None:
    a = _file("a", b"a", tmp_path)
    first = Manifest("3.12", ("manylinux_2_39_x86_64",), "linux-x86_64", "2026-11-30T10:00:00+00:00",
                     {"toy-1.0": _lock("toy-1.0", "k1", a)})  # fmt: skip
    write_manifest(tmp_path, first)
    assert read_manifest(tmp_path) == first
    document = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert document["format"] == 1
    assert document["target"] == {"python": "3.12", "platforms": ["manylinux_2_39_x86_64"],
                                  "key_platform": "linux-x86_64"}  # fmt: skip
    assert document["runtimes"]["toy-1.0"]["steps"][0]["install"][0] == {
        "filename": a.filename, "name": "a", "version": "1.0", "sha256": a.sha256, "size": 1,
    }  # fmt: skip

    second = Manifest("3.12", ("manylinux_2_28_x86_64",), "linux-x86_64", "later",
                      {"toy-2.0": _lock("toy-2.0", "k2"), "toy-1.0": _lock("toy-1.0", "k1b")})  # fmt: skip
    merged = first.merged(second)
    assert set(merged.runtimes) == {"toy-1.0", "toy-2.0"}  # added and replaced, none dropped
    assert merged.runtimes["toy-1.0"].key == "k1b"
    assert merged.created == first.created
    assert merged.platforms == ("manylinux_2_39_x86_64", "manylinux_2_28_x86_64")
    assert merged.lock_for("k2") is not None and merged.lock_for("k1") is None

    other = Manifest("3.11", ("manylinux_2_39_x86_64",), "linux-x86_64", "now")
    with pytest.raises(ConfigError, match=r"holds wheels for Python 3.12 linux-x86_64 .*give another --out"):
        first.merged(other)


def test_unreadable_manifest_is_a_config_error(tmp_path: Path) -> None:
    assert read_manifest(tmp_path) is None
    (tmp_path / MANIFEST_NAME).write_text('{"format": 1}')
    with pytest.raises(ConfigError, match=r"is not a wheelhouse manifest .*matrix runtime wheelhouse"):
        read_manifest(tmp_path)


def test_check_files_names_the_missing_or_corrupt_wheel(tmp_path: Path) -> None:
    a, b = _file("a", b"a", tmp_path), _file("b", b"b", tmp_path)
    check_files(tmp_path, [a, b], "REMAKE")
    (tmp_path / b.filename).unlink()
    with pytest.raises(ConfigError) as missing:
        check_files(tmp_path, [a, b], "REMAKE")
    assert str(missing.value) == f"wheelhouse {tmp_path} lacks {b.filename} (b 1.0): make it again with `REMAKE`"
    (tmp_path / a.filename).write_bytes(b"changed")
    with pytest.raises(ConfigError, match=f"{a.filename} does not match its checksum .*`REMAKE`"):
        check_files(tmp_path, [a], "REMAKE")


def test_source_options(tmp_path: Path) -> None:
    assert ProvisionSource.of(None, False) == ProvisionSource()
    with pytest.raises(ConfigError, match="--offline needs --find-links DIR"):
        ProvisionSource.of(None, True)
    with pytest.raises(ConfigError, match="no such directory"):
        ProvisionSource.of(tmp_path / "nope", True)
    with pytest.raises(ConfigError, match=f"has no {MANIFEST_NAME}: make the wheelhouse with"):
        ProvisionSource.of(tmp_path, True)
    assert ProvisionSource.of(tmp_path, False) == ProvisionSource(tmp_path.resolve(), False)  # online: extra links


def test_uv_platform_is_the_newest_glibc_of_the_target() -> None:
    from matrix.launch.providers.wheelresolve import uv_platform

    assert uv_platform(WheelTarget.of("3.12", ["manylinux_2_28_x86_64", "manylinux_2_39_x86_64"])) == (
        "x86_64-manylinux_2_39"
    )
    assert uv_platform(WheelTarget.of("3.12", ["manylinux2014_aarch64"])) == "aarch64-manylinux_2_17"
    assert uv_platform(WheelTarget.of("3.11", ["musllinux_1_2_x86_64"])) == "x86_64-unknown-linux-musl"


def test_of_a_locked_package_the_wheel_the_target_would_take_is_kept() -> None:
    from matrix.launch.providers.wheelresolve import _best_wheel, _tag_ranks

    target = WheelTarget.of("3.12", ["manylinux_2_28_x86_64"])
    base = "https://files.example/"
    package = {
        "name": "charset-normalizer",
        "version": "3.5.3",
        "wheels": [
            {"url": base + "charset_normalizer-3.5.3-py3-none-any.whl", "hashes": {"sha256": "a"}},
            {"url": base + "charset_normalizer-3.5.3-cp37-abi3-manylinux_2_28_x86_64.whl", "hashes": {"sha256": "b"}},
            {"url": base + "charset_normalizer-3.5.3-cp312-cp312-manylinux_2_39_x86_64.whl", "hashes": {"sha256": "c"}},
            {"url": base + "charset_normalizer-3.5.3-cp312-cp312-manylinux_2_17_x86_64.whl", "hashes": {"sha256": "d"},
             "size": 153000},
        ],
    }
    # cp312's own ABI over abi3 over pure Python; a glibc newer than the target's never. The size is the
    # chosen wheel's (the lock's `size`), none where the lock gives none.
    assert _best_wheel(package, _tag_ranks(target), "x") == (
        base + package["wheels"][3]["url"][len(base):], "d", 153000
    )
    package["wheels"] = package["wheels"][:2]
    assert _best_wheel(package, _tag_ranks(target), "x")[1:] == ("b", None)
    package["wheels"] = [{"url": base + "charset_normalizer-3.5.3-cp313-cp313-manylinux_2_28_x86_64.whl"}]
    with pytest.raises(ConfigError, match="none of its wheels fits the target"):
        _best_wheel(package, _tag_ranks(target), "x")
