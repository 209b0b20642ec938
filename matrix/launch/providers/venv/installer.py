"""The installer of venv runtimes: uv (the default), or pip (`MATRIX_INSTALLER=pip`, or a pip setting uv
cannot take), and the user's pip configuration translated for uv.

uv resolves and installs several times faster than pip and needs no pip inside the environment. It does not
read pip's configuration, but that configuration is what the user's builds obey (a private index, a local
directory of wheels that keeps a CPU build of torch, constraint files), so it is read here the way pip
reads it and handed to uv as arguments; a setting that changes what pip installs and has no uv equivalent
makes the build fall back to pip, with one line naming it. uv also picks the best version over all indexes
(`unsafe-best-match`), as pip does, instead of its default of stopping at the first index that has a name.
"""

from __future__ import annotations

import configparser
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from matrix.errors import ConfigError

INSTALLER_VARIABLE = "MATRIX_INSTALLER"
INSTALLERS = ("uv", "pip")
# pip reads these sections for `pip install`, later ones winning; PIP_* variables win over both.
_SECTIONS = ("global", "install")
# Read after the XDG ones, as pip does (a module constant, so a test can move it).
LEGACY_GLOBAL_CONFIG = Path("/etc/pip.conf")
# pip's site configuration: the one of the interpreter matrix runs in (e.g. its virtual environment's
# index), read after the user's files and before PIP_CONFIG_FILE's, as pip does.
SITE_CONFIG = Path(sys.prefix) / "pip.conf"
_TRUE = frozenset({"1", "y", "yes", "t", "true", "on"})
_FALSE = frozenset({"0", "n", "no", "f", "false", "off", ""})

# pip setting -> uv option, repeated for every whitespace-separated value.
_LIST_OPTIONS = {
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}
_VALUE_OPTIONS = {"index-url": "--index-url", "only-binary": "--only-binary", "no-binary": "--no-binary"}
_FLAG_OPTIONS = {"no-index": ("--no-index",), "pre": ("--prerelease", "allow")}
# pip setting -> the environment variables uv reads for the same thing.
_ENVIRONMENT = {
    "cert": ("SSL_CERT_FILE",),
    "client-cert": ("SSL_CLIENT_CERT",),
    "timeout": ("UV_HTTP_TIMEOUT",),
    "default-timeout": ("UV_HTTP_TIMEOUT",),
    "proxy": ("HTTP_PROXY", "HTTPS_PROXY"),
}
# Settings about pip's own output, prompts and caches: they change nothing that is installed.
_IGNORED = frozenset(
    {
        "cache-dir", "disable-pip-version-check", "log", "no-cache-dir", "no-color", "no-compile", "no-input",
        "no-python-version-warning", "no-warn-conflicts", "no-warn-script-location", "progress-bar", "quiet",
        "require-virtualenv", "retries", "root-user-action", "verbose", "config-file",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Setting:
    """One pip setting in force for `pip install`, and where it came from (a file or a variable)."""

    name: str
    value: str
    origin: str


@dataclass(frozen=True)
class Installer:
    """How environments are built: `name` is "uv" or "pip"; for uv its binary and the pip configuration as uv
    arguments and environment; `note` says why pip builds when uv was asked for ("" otherwise)."""

    name: str
    uv: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    note: str = ""


def _config_files(environ: Mapping[str, str]) -> list[Path]:
    """pip's configuration files in the order pip loads them (later ones win), as on Linux and macOS."""
    env_file = environ.get("PIP_CONFIG_FILE")
    if env_file == os.devnull:  # pip then loads no file at all
        return []
    dirs = [d for d in (environ.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(os.pathsep) if d]
    files = [*(Path(d) / "pip" / "pip.conf" for d in dirs), LEGACY_GLOBAL_CONFIG]
    # pip skips the user's files when PIP_CONFIG_FILE names a file that exists.
    if not (env_file and os.path.exists(env_file)):
        home = Path.home()
        config_home = Path(environ.get("XDG_CONFIG_HOME") or home / ".config")
        files += [home / ".pip" / "pip.conf", config_home / "pip" / "pip.conf"]
    files.append(SITE_CONFIG)
    if env_file:
        files.append(Path(env_file))
    return files


def pip_settings(environ: Mapping[str, str] | None = None) -> dict[str, Setting]:
    """The settings pip's configuration files (global, user, this interpreter's site one, PIP_CONFIG_FILE)
    and PIP_* variables give `pip install`, by name."""
    environ = os.environ if environ is None else environ
    settings: dict[str, Setting] = {}
    for section in _SECTIONS:
        for path in _config_files(environ):
            parser = configparser.RawConfigParser()
            try:
                parser.read(path, encoding="utf-8")
            except (OSError, configparser.Error):
                continue  # pip refuses a broken file loudly; the pip fallback would say so
            if parser.has_section(section):
                for name, value in parser.items(section):
                    settings[name.replace("_", "-")] = Setting(name, value, f"{path} [{section}]")
    for variable, value in environ.items():
        if variable.startswith("PIP_") and variable != "PIP_CONFIG_FILE":
            name = variable[4:].lower().replace("_", "-")
            settings[name] = Setting(name, value, variable)
    return settings


def _flag(setting: Setting) -> bool | None:
    value = setting.value.strip().lower()
    return True if value in _TRUE else False if value in _FALSE else None


def translate(settings: Mapping[str, Setting]) -> tuple[list[str], dict[str, str], list[Setting]]:
    """uv arguments and environment for pip's settings, and the settings uv cannot take."""
    args = ["--index-strategy", "unsafe-best-match"]
    env: dict[str, str] = {}
    refused: list[Setting] = []
    for name, setting in sorted(settings.items()):
        if name in _IGNORED:
            continue
        if name in _LIST_OPTIONS:
            args += [part for value in setting.value.split() for part in (_LIST_OPTIONS[name], value)]
        elif name in _VALUE_OPTIONS:
            args += [_VALUE_OPTIONS[name], setting.value.strip()]
        elif name in _FLAG_OPTIONS:
            flag = _flag(setting)
            if flag is None:
                refused.append(setting)
            elif flag:
                args += _FLAG_OPTIONS[name]
        elif name in _ENVIRONMENT:
            env.update(dict.fromkeys(_ENVIRONMENT[name], setting.value.strip()))
        else:
            refused.append(setting)
    return args, env, refused


def find_uv() -> str | None:
    """The uv binary of the `uv` distribution matrix depends on (None when it is not installed)."""
    try:
        from uv import find_uv_bin
    except ImportError:
        return None
    try:
        return str(find_uv_bin())
    except FileNotFoundError:
        return None


def uv_path() -> str | None:
    """The uv executable (for `matrix doctor`)."""
    return find_uv()


def choose_installer(environ: Mapping[str, str] | None = None) -> Installer:
    """The installer of the next build: `MATRIX_INSTALLER` (default uv); `ConfigError` for another value."""
    environ = os.environ if environ is None else environ
    wanted = environ.get(INSTALLER_VARIABLE, "").strip() or "uv"
    if wanted not in INSTALLERS:
        raise ConfigError(
            f"{INSTALLER_VARIABLE}={wanted!r} is not an installer matrix knows ({', '.join(INSTALLERS)}): "
            f"unset it, or set {INSTALLER_VARIABLE}=pip"
        )
    if wanted == "pip":
        return Installer("pip")
    uv = find_uv()
    if uv is None:
        return Installer("pip", note="uv is not installed (pip install uv): building with pip")
    args, env, refused = translate(pip_settings(environ))
    if refused:
        first = refused[0]
        return Installer(
            "pip",
            note=f"pip setting {first.name} = {first.value} ({first.origin}) has no uv equivalent: building with pip",
        )
    return Installer("uv", uv, tuple(args), env)
