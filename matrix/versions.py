"""PEP 440 versions: parsing, tags, ``--since``/``--until`` windows, catalog constraints and fixes.

Every version in the matrix is a `packaging.version.Version`, so ordering follows PEP 440 exactly, including
the pre-release and dev builds that real runtimes ship::

    0.29.0 < 0.29.1rc0 < 0.29.1rc1.dev347+gdee37d891 < 0.29.1rc1 < 0.30.0

Pre-releases and dev builds are never filtered out here: a nightly that bundles a ``0.29.1rc1.dev347``
component is a real runtime that users run, so it must be selectable, constrainable and gateable like any
release. Tags are written with a leading ``v`` (``v0.30.0``); both spellings are accepted on input.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from matrix.errors import ConfigError

__all__ = [
    "VersionBound",
    "VersionWindow",
    "component_has_fix",
    "parse_bound",
    "parse_specifier",
    "parse_version",
    "specifier_admits",
    "tag_for",
]

# A backend name in a scoped bound (``vllm=0.29.0``): lowercase words joined by ``-`` or ``_`` so that
# names such as ``vllm-rs`` or ``trtllm`` fit, while a stray operator (``vllm>=0.29``) is rejected.
_BACKEND_NAME = re.compile(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")


def parse_version(text: str) -> Version:
    """Parse a PEP 440 version, with or without a leading ``v``/``V`` (``0.30.0``, ``v0.30.0``).

    Raises `ConfigError` naming the bad input and showing valid examples.
    """
    stripped = text.strip()
    try:
        # `Version` itself accepts the optional "v" prefix (PEP 440 normalisation) in either case.
        return Version(stripped)
    except InvalidVersion:
        raise ConfigError(
            f"invalid version {text!r}: not a PEP 440 version (e.g. 0.30.0, v0.29.1rc0)"
        ) from None


def tag_for(version: Version) -> str:
    """The tag spelling of a version: ``v`` plus its normalised PEP 440 form (``v0.30.0``)."""
    return f"v{version}"


@dataclass(frozen=True)
class VersionBound:
    """One ``--since``/``--until`` value: a version, optionally scoped to one backend.

    ``backend=None`` means the bound applies to every runtime's own version.
    """

    backend: str | None
    version: Version

    def __str__(self) -> str:
        # Written back the way the user typed it, so reasons read like the command line.
        return str(self.version) if self.backend is None else f"{self.backend}={self.version}"


def parse_bound(text: str) -> VersionBound:
    """Parse ``VERSION`` (global) or ``BACKEND=VERSION`` (scoped), e.g. ``v0.29.0`` or ``vllm=0.29.0``.

    Backend names are compared case-insensitively and stored in lowercase.
    """
    backend_part, sep, version_part = text.partition("=")
    if not sep:
        return VersionBound(None, parse_version(text))
    backend = backend_part.strip().lower()
    if not _BACKEND_NAME.fullmatch(backend):
        raise ConfigError(
            f"invalid version bound {text!r}: expected VERSION or BACKEND=VERSION (e.g. 0.29.0, vllm=0.29.0)"
        )
    return VersionBound(backend, parse_version(version_part))


def _effective(bounds: tuple[VersionBound, ...], backend: str) -> tuple[VersionBound, ...]:
    """The bounds that apply to `backend`: its scoped ones if it has any, else the global ones."""
    scoped = tuple(b for b in bounds if b.backend == backend)
    return scoped if scoped else tuple(b for b in bounds if b.backend is None)


@dataclass(frozen=True)
class VersionWindow:
    """Inclusive ``--since``/``--until`` selection of runtime versions.

    Each option is repeatable. A global bound (``--since 0.29.0``) applies to every backend; a scoped
    bound (``--since vllm=0.29.0``) applies only to that backend and, for that backend, replaces the global
    bound of the same direction (since and until are resolved independently). Several bounds that apply
    in one direction must all hold, so the strictest one decides.

    Constructing a window whose bounds admit nothing for some backend (since after until) raises
    `ConfigError`, because such a selection is always a typo rather than an intent.
    """

    since: tuple[VersionBound, ...] = ()
    until: tuple[VersionBound, ...] = ()

    def __post_init__(self) -> None:
        backends = {b.backend for b in (*self.since, *self.until) if b.backend is not None}
        # The empty-window check covers the global scope (backend=None stands for "any other backend")
        # and every backend named in a scoped bound.
        for backend in (None, *sorted(backends)):
            since = self._applicable(self.since, backend)
            until = self._applicable(self.until, backend)
            if since and until:
                latest_since = max(since, key=lambda b: b.version)
                earliest_until = min(until, key=lambda b: b.version)
                if latest_since.version > earliest_until.version:
                    scope = "every backend" if backend is None else f"backend {backend!r}"
                    raise ConfigError(
                        f"--since {latest_since} is after --until {earliest_until}: the window admits "
                        f"no version of {scope}; swap or correct the bounds"
                    )

    @staticmethod
    def _applicable(bounds: tuple[VersionBound, ...], backend: str | None) -> tuple[VersionBound, ...]:
        if backend is None:
            return tuple(b for b in bounds if b.backend is None)
        return _effective(bounds, backend)

    def admits(self, backend: str, version: Version) -> tuple[bool, str | None]:
        """Whether `version` of `backend` is inside the window; when not, a reason such as
        ``"0.28.0 is before --since 0.29.0"``.
        """
        name = backend.lower()
        for bound in _effective(self.since, name):
            if version < bound.version:
                return False, f"{version} is before --since {bound}"
        for bound in _effective(self.until, name):
            if version > bound.version:
                return False, f"{version} is after --until {bound}"
        return True, None


def parse_specifier(text: str) -> SpecifierSet:
    """Parse a catalog version constraint such as ``>=0.29.0`` or ``>=1.3.0rc27,<2``.

    An empty constraint is valid and admits every version. Raises `ConfigError` on anything else that is
    not a PEP 440 specifier set (a bare ``0.29.0`` needs an operator: ``==0.29.0`` or ``>=0.29.0``).
    """
    try:
        return SpecifierSet(text.strip())
    except InvalidSpecifier:
        raise ConfigError(
            f"invalid version constraint {text!r}: not a PEP 440 specifier (e.g. >=0.29.0, >=1.3.0rc27,<2)"
        ) from None


def specifier_admits(spec: SpecifierSet, version: Version) -> bool:
    """Whether `spec` admits `version`, always counting pre-releases and dev builds as candidates.

    `packaging` excludes pre-releases by default (a pip resolver concern). Here a dev or rc runtime is a
    real runtime under test, so ``>=0.29.0`` must admit ``0.29.1rc1.dev347+gdee37d891``. PEP 440's other
    rules still apply, e.g. ``<0.30.0`` does not admit ``0.30.0rc1``.
    """
    return spec.contains(version, prereleases=True)


def _release_line(version: Version) -> tuple[int, int, int]:
    """Epoch, major and minor: the release line a version belongs to (``0.29.1rc0`` is on 0.29)."""
    release = (*version.release, 0)
    return (version.epoch, release[0], release[1])


def component_has_fix(component_version: Version, fixed_in: Sequence[str]) -> bool:
    """Whether `component_version` contains a fix first released in the versions `fixed_in`.

    `fixed_in` lists, per release line (same major.minor), the first version on that line that contains the
    fix, e.g. ``["0.29.1rc0", "0.30.0"]`` for vllm#54814 (in v0.30.0 and v0.29.1rc0, not in v0.29.0).

    Why per line rather than one "fixed in" version: fixes are backported. With
    ``["0.28.9", "0.29.1rc0"]`` the fix reached the 0.28 line in 0.28.9, but 0.29.0 was cut before the
    backport and lacks it; a single ``>= 0.28.9`` would wrongly pass 0.29.0.

    Rule: sort the entries; let F be the greatest entry with F <= version. The version has the fix iff such
    an F exists and either
      * version is on F's release line (F is where the fix landed on this line, and later versions on the
        line keep it), or
      * F is the greatest entry overall (every line newer than the newest listed line branched after the
        fix, so it inherits it).
    Otherwise the version is on a line that branched before the fix reached it (0.29.0 above) and lacks it.

    Examples with ``["0.29.1rc0", "0.30.0"]``: 0.28.5 no, 0.29.0 no, 0.29.1rc0 yes,
    0.29.1rc1.dev347+gdee37d891 yes, 0.29.1 yes, 0.30.0rc1 no (pre-release of the line's first fixed
    version), 0.30.0 yes, 0.31.0 yes. An empty list means no release has the fix: always False.

    Raises `ConfigError` for an entry that is not a version, or for two entries on one release line (which
    one would be "first" is ambiguous).
    """
    entries = sorted(parse_version(text) for text in fixed_in)
    lines: dict[tuple[int, int, int], Version] = {}
    for entry in entries:
        line = _release_line(entry)
        if line in lines:
            raise ConfigError(
                f"fixed-in versions {list(fixed_in)!r} list both {lines[line]} and {entry} on release line "
                f"{line[1]}.{line[2]}: give only the first version on each line that has the fix"
            )
        lines[line] = entry
    at_or_below = [entry for entry in entries if entry <= component_version]
    if not at_or_below:
        return False
    floor = at_or_below[-1]
    return floor == entries[-1] or _release_line(floor) == _release_line(component_version)
