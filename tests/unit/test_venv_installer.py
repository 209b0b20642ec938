"""The installer of venv runtimes: MATRIX_INSTALLER, pip's configuration read as pip reads it and handed to
uv, the fall back to pip for a setting uv cannot take, and keys that name the installer."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from matrix.errors import ConfigError
from matrix.launch.providers.recipe import parse_venv
from matrix.launch.providers.venv import installer as installer_module
from matrix.launch.providers.venv.build import once
from matrix.launch.providers.venv.installer import choose_installer, pip_settings, translate
from matrix.launch.providers.venv.wheelfiles import UnpackedWheel


@pytest.fixture(autouse=True)
def _no_host_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(installer_module, "LEGACY_GLOBAL_CONFIG", tmp_path / "etc-pip.conf")
    monkeypatch.setattr(installer_module, "SITE_CONFIG", tmp_path / "prefix" / "pip.conf")


def _environ(tmp_path: Path, **variables: str) -> dict[str, str]:
    """A host whose pip configuration lives under tmp_path: /etc-like dirs, a home, no real files."""
    (tmp_path / "etc" / "pip").mkdir(parents=True, exist_ok=True)
    (tmp_path / "home" / ".config" / "pip").mkdir(parents=True, exist_ok=True)
    return {"XDG_CONFIG_DIRS": str(tmp_path / "etc"), "XDG_CONFIG_HOME": str(tmp_path / "home" / ".config"),
            "HOME": str(tmp_path / "home"), **variables}  # fmt: skip


def test_settings_follow_pips_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    environ = _environ(tmp_path, PIP_FIND_LINKS="/from/env")
    monkeypatch.setenv("HOME", environ["HOME"])
    (tmp_path / "etc" / "pip" / "pip.conf").write_text(
        "[global]\nconstraint = /etc/constraints.txt\nindex-url = https://global.example/simple\n"
    )
    (tmp_path / "home" / ".config" / "pip" / "pip.conf").write_text(
        "[global]\nindex-url = https://user.example/simple\nfind-links = /from/file\n"
        "extra-index-url = file:///a/simple file:///b/simple\n[install]\nindex-url = https://install.example/simple\n"
        "[download]\nno-index = yes\n"
    )
    settings = pip_settings(environ)
    # The user's file over the global one, [install] over [global], PIP_* over both; [download] is not read.
    assert settings["index-url"].value == "https://install.example/simple"
    assert settings["find-links"].value == "/from/env" and settings["find-links"].origin == "PIP_FIND_LINKS"
    assert settings["constraint"].value == "/etc/constraints.txt"
    assert "no-index" not in settings
    args, env, refused = translate(settings)
    assert refused == []
    assert args == [
        "--index-strategy", "unsafe-best-match",
        "--constraint", "/etc/constraints.txt",
        "--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple",
        "--find-links", "/from/env",
        "--index-url", "https://install.example/simple",
    ]  # fmt: skip
    assert env == {}


def test_the_interpreters_site_config_is_read_between_the_users_and_pip_config_file(tmp_path: Path) -> None:
    environ = _environ(tmp_path)
    (tmp_path / "home" / ".config" / "pip" / "pip.conf").write_text(
        "[global]\nindex-url = https://user.example/simple\nfind-links = /user\n"
    )
    (tmp_path / "prefix").mkdir()
    (tmp_path / "prefix" / "pip.conf").write_text(
        "[global]\nindex-url = https://site.example/simple\nextra-index-url = https://site-extra.example/simple\n"
    )
    settings = pip_settings(environ)
    assert settings["index-url"].value == "https://site.example/simple"
    assert settings["index-url"].origin == f"{tmp_path / 'prefix' / 'pip.conf'} [global]"
    assert settings["find-links"].value == "/user"
    args, _env, refused = translate(settings)
    assert "https://site-extra.example/simple" in args and not refused
    (tmp_path / "env.conf").write_text("[global]\nindex-url = https://env.example/simple\n")
    settings = pip_settings({**environ, "PIP_CONFIG_FILE": str(tmp_path / "env.conf")})
    assert settings["index-url"].value == "https://env.example/simple"  # PIP_CONFIG_FILE over the site file
    assert settings["extra-index-url"].value == "https://site-extra.example/simple"
    assert "find-links" not in settings  # the user's files are skipped then, the site file is not


def test_pip_config_file_devnull_reads_no_file(tmp_path: Path) -> None:
    environ = _environ(tmp_path, PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_CERT="/ca.pem")
    (tmp_path / "etc" / "pip" / "pip.conf").write_text("[global]\nindex-url = https://global.example/simple\n")
    args, env, refused = translate(pip_settings(environ))
    assert args == ["--index-strategy", "unsafe-best-match", "--no-index"]
    assert env == {"SSL_CERT_FILE": "/ca.pem"}
    assert refused == []


def test_a_setting_uv_cannot_take_makes_pip_build_and_says_which(tmp_path: Path) -> None:
    environ = _environ(tmp_path, PIP_CONFIG_FILE=os.devnull, PIP_USE_DEPRECATED="legacy-resolver")
    installer = choose_installer(environ)
    assert installer.name == "pip" and installer.uv is None
    assert installer.note == (
        "pip setting use-deprecated = legacy-resolver (PIP_USE_DEPRECATED) has no uv equivalent: building with pip"
    )
    # Settings about pip's own output change nothing installed: uv builds.
    quiet = _environ(tmp_path, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    assert choose_installer(quiet).name == "uv"


def test_matrix_installer_picks_and_refuses(tmp_path: Path) -> None:
    base = _environ(tmp_path, PIP_CONFIG_FILE=os.devnull)
    uv = choose_installer(base)
    assert uv.name == "uv" and uv.uv is not None and Path(uv.uv).is_file() and uv.note == ""
    assert choose_installer({**base, "MATRIX_INSTALLER": "pip"}).name == "pip"
    with pytest.raises(ConfigError, match=r"MATRIX_INSTALLER='conda' is not an installer matrix knows \(uv, pip\)"):
        choose_installer({**base, "MATRIX_INSTALLER": "conda"})


def test_the_key_names_the_installer_and_pip_keys_stay() -> None:
    recipe = parse_venv({"kind": "venv", "steps": [["six==1.16.0"]]}, "toy-1.0")
    pip_key = recipe.key("3.11", "linux-x86_64")
    assert recipe.key("3.11", "linux-x86_64", "pip") == pip_key
    assert recipe.key("3.11", "linux-x86_64", "uv") != pip_key
    # The key as it was before the installer was part of it: environments pip built keep their names.
    document = {"layout": 1, "platform": "linux-x86_64", "python": "3.11", "steps": [["six==1.16.0"]]}
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert pip_key == hashlib.sha256(canonical.encode()).hexdigest()


def test_switches_uv_refuses_twice_are_kept_once() -> None:
    argv = ["uv", "pip", "install", "--offline", "--no-index", "--find-links", "d", "--no-index", "--no-deps", "x"]
    assert once(argv, frozenset({"--no-index", "--offline"})) == [
        "uv", "pip", "install", "--offline", "--no-index", "--find-links", "d", "--no-deps", "x",
    ]  # fmt: skip


def test_an_unpacked_wheel_reads_like_the_wheel(tmp_path: Path) -> None:
    dist_info = tmp_path / "tool-2.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: tool\nVersion: 2.0\nRequires-Dist: six\n")
    (dist_info / "WHEEL").write_text("Wheel-Version: 1.0\nTag: py2-none-any\nTag: py3-none-any\n")
    (tmp_path / "tool").mkdir()
    (tmp_path / "tool" / "run").write_bytes(b"#!/bin/sh\n")
    wheel = UnpackedWheel.of(tmp_path, "tool==2.0")
    assert wheel.name == "tool-2.0-py2.py3-none-any.whl"
    assert "Requires-Dist: six" in wheel.metadata()
    assert wheel.read("tool/run") == b"#!/bin/sh\n"
    with pytest.raises(KeyError):
        wheel.read("tool/missing")
