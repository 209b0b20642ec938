"""The host a wheelhouse is made for: its interpreter, its platform tags and its PEP 508 marker environment.

pip matches platform tags exactly, so ``--platform manylinux_2_39_x86_64`` alone would miss a wheel built
for an older glibc (llguidance ships only ``manylinux_2_31``, cryptography ``manylinux_2_34``): a target's
tag is expanded into every tag a pip running there would accept, most specific first.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from matrix.errors import ConfigError

_MANYLINUX = re.compile(r"^manylinux_2_(\d+)_([a-z0-9_]+)$")
_LEGACY = re.compile(r"^manylinux(1|2010|2014)_([a-z0-9_]+)$")
_MUSLLINUX = re.compile(r"^musllinux_1_(\d+)_([a-z0-9_]+)$")
_LINUX = re.compile(r"^linux_([a-z0-9_]+)$")
_PYTHON = re.compile(r"^3\.(\d+)$")
# glibc minor versions of the legacy manylinux names (PEP 600), and the architectures each was defined for.
_LEGACY_GLIBC = {"1": 5, "2010": 12, "2014": 17}
_LEGACY_ARCHES = {
    "2014": {"x86_64", "i686", "aarch64", "armv7l", "ppc64", "ppc64le", "s390x"},
    "2010": {"x86_64", "i686"},
    "1": {"x86_64", "i686"},
}


def _manylinux_tags(minor: int, arch: str) -> list[str]:
    """manylinux_2_<minor> down to the oldest glibc pip accepts for `arch`, the legacy names in their place."""
    # pip's own floor: manylinux wheels for other architectures start with manylinux2014 (glibc 2.17).
    floor = 5 if arch in ("x86_64", "i686") else 17
    tags = []
    for glibc in range(minor, floor - 1, -1):
        tags.append(f"manylinux_2_{glibc}_{arch}")
        for legacy, legacy_glibc in _LEGACY_GLIBC.items():
            if glibc == legacy_glibc and arch in _LEGACY_ARCHES[legacy]:
                tags.append(f"manylinux{legacy}_{arch}")
    return tags


def _expand_one(platform: str) -> tuple[str, list[str]]:
    """(architecture, compatible tags) of one `--platform` value."""
    if match := _MANYLINUX.match(platform):
        return match.group(2), _manylinux_tags(int(match.group(1)), match.group(2))
    if match := _LEGACY.match(platform):
        return match.group(2), _manylinux_tags(_LEGACY_GLIBC[match.group(1)], match.group(2))
    if match := _MUSLLINUX.match(platform):
        minor, arch = int(match.group(1)), match.group(2)
        return arch, [f"musllinux_1_{m}_{arch}" for m in range(minor, -1, -1)]
    if match := _LINUX.match(platform):
        return match.group(1), [platform]
    raise ConfigError(
        f"--platform {platform!r} is not a Linux wheel platform tag: give one like manylinux_2_39_x86_64, "
        "musllinux_1_2_x86_64 or linux_x86_64 (environments are built on Linux hosts only)"
    )


def expand_platforms(platforms: Iterable[str]) -> tuple[str, ...]:
    """Every platform tag compatible with the given ones, most specific first, each once."""
    expanded: list[str] = []
    for platform in platforms:
        for tag in _expand_one(platform)[1]:
            if tag not in expanded:
                expanded.append(tag)
    return tuple(expanded)


def check_python(version: str) -> str:
    """A target interpreter is written major.minor (3.8 or newer): `ConfigError` otherwise."""
    match = _PYTHON.match(version.strip())
    if match is None or int(match.group(1)) < 8:
        raise ConfigError(f"--python {version!r} is not a Python version: write major.minor, e.g. --python 3.12")
    return version.strip()


@dataclass(frozen=True)
class WheelTarget:
    """A target host: CPython `python` (major.minor) on Linux `platforms` (as given; `tags` expands them)."""

    python: str
    platforms: tuple[str, ...]

    @classmethod
    def of(cls, python: str, platforms: Iterable[str]) -> WheelTarget:
        """Checked: a valid version, at least one platform, all of one architecture (`ConfigError`)."""
        platforms = tuple(dict.fromkeys(platforms))
        if not platforms:
            raise ConfigError("give the target's platform, e.g. --platform manylinux_2_39_x86_64")
        arches = {_expand_one(p)[0] for p in platforms}
        if len(arches) != 1:
            raise ConfigError(f"--platform values name several architectures ({', '.join(sorted(arches))}): "
                              "make one wheelhouse per architecture")  # fmt: skip
        return cls(check_python(python), platforms)

    @property
    def arch(self) -> str:
        return _expand_one(self.platforms[0])[0]

    @property
    def tags(self) -> tuple[str, ...]:
        return expand_platforms(self.platforms)

    @property
    def abi(self) -> str:
        return "cp" + self.python.replace(".", "")

    @property
    def key_platform(self) -> str:
        """The platform part of a recipe's key on the target: what `sysconfig.get_platform()` answers on a
        Linux host (``linux-x86_64``), whatever its glibc, so a key made here matches the one made there."""
        return f"linux-{self.arch}"

    def marker_environment(self) -> dict[str, str]:
        """PEP 508 marker values of CPython `python` on Linux `arch`. The patch level is unknown: X.Y.0; the
        kernel fields are empty (no requirement should depend on them)."""
        return {
            "implementation_name": "cpython",
            "implementation_version": f"{self.python}.0",
            "os_name": "posix",
            "platform_machine": self.arch,
            "platform_release": "",
            "platform_system": "Linux",
            "platform_version": "",
            "python_full_version": f"{self.python}.0",
            "platform_python_implementation": "CPython",
            "python_version": self.python,
            "sys_platform": "linux",
        }

    def describe(self) -> str:
        return f"Python {self.python} on {', '.join(self.platforms)}"


def this_host() -> WheelTarget:
    """This interpreter and the most specific platform tag of this host (the defaults of the command)."""
    from packaging.tags import platform_tags

    if not sys.platform.startswith("linux"):
        raise ConfigError("this host is not Linux: give the target with --python and --platform")
    tags = [t for t in platform_tags() if t.startswith(("manylinux_", "musllinux_"))]
    return WheelTarget.of(f"{sys.version_info.major}.{sys.version_info.minor}", tags[:1] or list(platform_tags())[:1])
