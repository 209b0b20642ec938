"""A variant's environment is made from its base's (hard links, relocation, only the differing steps),
built for real with the installer (uv, or pip) from wheels made here; the base is never written through a
shared link."""

from __future__ import annotations

import json
import marshal
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from matrix.cells import RuntimeInfo
from matrix.launch.providers.buildprocs import never
from matrix.launch.providers.venv import TMP_PREFIX, choose_installer, locked, provision_target, resolve_target
from matrix.launch.providers.venv.target import venv_environment
from matrix.launch.providers.venv.variant import build_from_base, find_base
from tests.helpers.wheels import make_wheel

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def variant_wheels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One base environment for the module (the one full build here); each test's variant has its own key."""
    folder = tmp_path_factory.mktemp("wheels")
    make_wheel(folder, "mtoolpkg", "1.0", "1.2.3")
    for version in ("2.0", "3.0", "4.0", "5.0"):
        make_wheel(folder, "othertool", version, f"{version}.1")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MATRIX_HOME", str(tmp_path_factory.mktemp("variant-home")))
        patch.setenv("PIP_CONFIG_FILE", os.devnull)
        patch.setenv("PIP_NO_INDEX", "1")
        patch.setenv("PIP_FIND_LINKS", str(folder))
        # uv keys a flat index's wheel by the folder's path, and pytest reuses temporary paths from one run to
        # the next: a cache shared with earlier runs handed out an older run's wheel of the same name.
        patch.setenv("UV_CACHE_DIR", str(tmp_path_factory.mktemp("uv-cache")))
        yield folder


def _runtime(tool: str, version: str, pkg: str = "mtoolpkg==1.0") -> RuntimeInfo:
    steps: list[Any] = [[pkg], {"extract": f"othertool=={tool}", "member": "othertool/mtool"}]
    return RuntimeInfo(backend="toolbox", version=version, tag=f"v{version}",
                       provider={"kind": "venv", "steps": steps}, components={"mtool": f"{tool}.1"})  # fmt: skip


def _unshared_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            total += st.st_size if st.st_nlink == 1 else 0
    return total


def info_text(path: Path) -> bytes:
    return (path / "env.json").read_bytes()


def _tool(path: Path) -> str:
    return subprocess.run([str(path / "bin" / "mtool"), "--version"], capture_output=True, text=True, check=True).stdout


def test_a_build_compiles_no_byte_code_and_a_cells_first_import_writes_it_at_the_final_path(
    variant_wheels: Path,
) -> None:
    runtime = _runtime("2.0", "1.0")
    base = provision_target(runtime, echo=lambda _line: None)
    assert not list((base.path / "lib").rglob("*.pyc"))  # nothing compiled in the temporary directory
    # A cell's environment, even under a runner that set PYTHONDONTWRITEBYTECODE (an empty value unsets it).
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **venv_environment(resolve_target(runtime))}
    subprocess.run([str(base.path / "bin" / "python"), "-c", "import mtoolpkg"], env=env, check=True)
    (pyc,) = (base.path / "lib").rglob("mtoolpkg/__pycache__/__init__.*.pyc")
    code = marshal.loads(pyc.read_bytes()[16:])
    assert code.co_filename == str(pyc.parent.parent / "__init__.py") and code.co_filename.startswith(str(base.path))


def test_matrix_bytecode_compile_compiles_the_environment_in_place_after_the_rename(
    variant_wheels: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MATRIX_BYTECODE", "compile")
    lines: list[str] = []
    built = provision_target(_runtime("3.0", "9.0", pkg="mtoolpkg>=0.1"), echo=lines.append)  # a full build
    (pyc,) = (built.path / "lib").rglob("mtoolpkg/__pycache__/__init__.*.pyc")
    assert marshal.loads(pyc.read_bytes()[16:]).co_filename.startswith(str(built.path))
    assert any("byte code compiled" in line for line in lines), lines
    assert "compileall" in (built.path / "provision.log").read_text()


def test_a_variant_is_the_base_hard_linked_plus_its_one_differing_step(variant_wheels: Path) -> None:
    lines: list[str] = []
    base = provision_target(_runtime("2.0", "1.0"), echo=lines.append)
    # Scripts that name the environment's path: activate always, and pip's entry point where pip built it
    # (uv's environments have no pip).
    scripts = ["activate", *(["pip"] if (base.path / "bin" / "pip").exists() else [])]
    assert choose_installer().name == "uv" or "pip" in scripts
    before = {name: (base.path / "bin" / name).read_bytes() for name in scripts}
    assert all(str(base.path).encode() in content for content in before.values())
    variant = provision_target(_runtime("3.0", "1.0+othertool.3.0"), echo=lines.append)
    assert variant.built and variant.path != base.path
    info = json.loads((variant.path / "env.json").read_text())
    assert info["tool"] == "variant" and info["derived_from"]["name"] == base.path.name
    assert info["components"] == {"mtool": "3.0.1"}  # asked from the environment itself
    assert any("ready from" in line for line in lines), lines
    # Only the differing file is new; the packages are the base's very inodes.
    site = Path("lib") / next(p.name for p in (base.path / "lib").iterdir()) / "site-packages"
    init = site / "mtoolpkg" / "__init__.py"
    assert os.stat(base.path / init).st_ino == os.stat(variant.path / init).st_ino
    # What it records as written is what it added: the bytes of every file no other entry shares.
    assert info["extra_bytes"] < 2**20
    assert _unshared_bytes(variant.path) == info["extra_bytes"] + len(info_text(variant.path))
    # Each answers with its own tool; the base's scripts and tool are untouched.
    assert _tool(variant.path).startswith("mtool 3.0.1") and _tool(base.path).startswith("mtool 2.0.1")
    for name in scripts:
        assert (base.path / "bin" / name).read_bytes() == before[name]
        relocated = (variant.path / "bin" / name).read_bytes()
        assert str(variant.path).encode() in relocated and str(base.path).encode() not in relocated, name
    if "pip" in scripts:
        assert (variant.path / "bin" / "pip").read_bytes().startswith(f"#!{variant.path}/bin/".encode())
    # The variant's interpreter is its own prefix: it imports the packages, run from the final path.
    probe = "import sys, mtoolpkg; print(sys.prefix); print(mtoolpkg.__file__)"
    done = subprocess.run([str(variant.path / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                          check=True)  # fmt: skip
    prefix, module = done.stdout.splitlines()
    assert prefix == str(variant.path) and module.startswith(str(variant.path)), done.stdout
    assert not list(variant.path.parent.glob(f"{TMP_PREFIX}*"))


def test_a_variant_differing_in_a_pip_step_has_no_base(variant_wheels: Path) -> None:
    provision_target(_runtime("2.0", "1.0"), echo=lambda _line: None)
    assert find_base(resolve_target(_runtime("4.0", "1.1", pkg="mtoolpkg"))) is None  # the pip step differs too
    assert find_base(resolve_target(_runtime("4.0", "1.0+othertool.4.0"))) is not None


def test_a_base_whose_lock_is_held_is_not_copied(variant_wheels: Path) -> None:
    base = provision_target(_runtime("2.0", "1.0"), echo=lambda _line: None)
    runtime = _runtime("4.0", "1.0+othertool.4.0")
    target = resolve_target(runtime)
    lines: list[str] = []
    # Held: the base is being removed (prune) or rebuilt; its files may vanish under a copy.
    with locked(base.path.parent / f"{base.path.name}.lock"):
        # The caller builds from scratch.
        assert build_from_base(runtime, target, lines.append, never, choose_installer()) is None
    assert any("building from scratch" in line for line in lines), lines
    assert not target.path.exists() and not list(target.root.glob(f"{TMP_PREFIX}{target.name}-*"))


def test_a_variant_build_killed_midway_leaves_only_a_temporary_directory_the_next_build_removes(
    variant_wheels: Path,
) -> None:
    base = provision_target(_runtime("2.0", "1.0"), echo=lambda _line: None)
    target = resolve_target(_runtime("5.0", "1.0+othertool.5.0"))
    # What a SIGKILL after the copy leaves: a hard-linked temporary directory under the variant's name.
    stale = target.root / f"{TMP_PREFIX}{target.name}-999999-abcdef"
    subprocess.run(["cp", "-a", "-l", str(base.path), str(stale)], check=True)
    assert not target.path.exists()
    variant = provision_target(_runtime("5.0", "1.0+othertool.5.0"), echo=lambda _line: None)
    assert not stale.exists() and _tool(variant.path).startswith("mtool 5.0.1")
    assert json.loads((variant.path / "env.json").read_text())["tool"] == "variant"
    assert _tool(base.path).startswith("mtool 2.0.1")


def test_a_file_another_environment_took_from_the_same_wheel_is_hard_linked_not_downloaded(
    variant_wheels: Path,
) -> None:
    provision_target(_runtime("2.0", "1.0"), echo=lambda _line: None)
    # Another engine version whose recipe extracts othertool 4.0's tool: built from scratch (its pip step differs).
    donor = provision_target(_runtime("4.0", "2.0", pkg="mtoolpkg"), echo=lambda _line: None)
    variant = provision_target(_runtime("4.0", "1.0+othertool.4.0"), echo=lambda _line: None)
    assert os.stat(variant.path / "bin" / "mtool").st_ino == os.stat(donor.path / "bin" / "mtool").st_ino
    log = (variant.path / "provision.log").read_text()
    # The donor's build kept the file it extracted (`venv.members`): the variant links it from there.
    assert "linked from the member kept for extract othertool/mtool from othertool==4.0" in log.split("made from")[-1]
    assert "pip download" not in log.split("made from")[-1] and "--target" not in log.split("made from")[-1]
    assert _tool(variant.path).startswith("mtool 4.0.1")


def test_a_kept_member_serves_the_next_variant_and_prune_drops_it_once_no_environment_links_it(
    variant_wheels: Path,
) -> None:
    from matrix.launch.providers.store import prune
    from matrix.launch.providers.venv.members import MEMBERS_DIR

    base = provision_target(_runtime("2.0", "1.0"), echo=lambda _line: None)
    runtime = _runtime("5.0", "1.0+othertool.5.0")
    first = provision_target(runtime, echo=lambda _line: None)
    assert "from othertool-5.0" in (first.path / "provision.log").read_text().split("made from")[-1]  # the wheel
    inode = os.stat(first.path / "bin" / "mtool").st_ino
    kept = [p for p in (base.path.parent / MEMBERS_DIR).iterdir() if p.stat().st_ino == inode]
    assert len(kept) == 1
    subprocess.run(["rm", "-rf", str(first.path)], check=True)
    again = provision_target(runtime, echo=lambda _line: None)
    assert os.stat(again.path / "bin" / "mtool").st_ino == inode and _tool(again.path).startswith("mtool 5.0.1")
    assert "linked from the member kept" in (again.path / "provision.log").read_text().split("made from")[-1]
    # Nothing references the variant: prune removes it, then the member only it linked.
    report = prune({base.path.name}, root=base.path.parent)
    assert again.path in [r.path for r in report.removed] and not kept[0].exists()
    assert _tool(base.path).startswith("mtool 2.0.1")
