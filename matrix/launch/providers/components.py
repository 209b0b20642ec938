"""Which component versions an interpreter really has, compared with what the catalog says.

A component is looked up first as a Python distribution inside the target interpreter (one child process
for every name, so a runtime with five components costs one interpreter start), then as an executable on
the environment's PATH answering ``NAME --version``. Versions compare as PEP 440 versions, so ``0.30`` and
``0.30.0`` are equal, while a local label (``+gdee37d891``) must match exactly: two dev builds that differ
only in their commit are different builds (version skew).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from packaging.version import VERSION_PATTERN, InvalidVersion, Version

from matrix.text import clean, excerpt

EXECUTABLE_TIMEOUT_S = 10.0
# An interpreter start plus importlib.metadata over a large site-packages stays far below this.
DISTRIBUTION_TIMEOUT_S = 60.0

# Runs inside the *target* interpreter (which may be older than ours: keep it Python 3.8 compatible and
# free of third-party imports). Names come in argv, the answer goes out as one JSON object on stdout.
DISTRIBUTIONS_SCRIPT = """
import json, re, sys
from importlib import metadata

def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()

found, index = {}, None
for name in sys.argv[1:]:
    version = None
    try:
        version = metadata.version(name)
    except Exception:
        if index is None:
            index = {}
            for dist in metadata.distributions():
                try:
                    index.setdefault(canonical(dist.metadata["Name"] or ""), dist.version)
                except Exception:
                    pass
        version = index.get(canonical(name))
    found[name] = version
sys.stdout.write(json.dumps(found))
"""

# Not glued to a word or a dotted name on the left ("x86_64", "python3"), nor running on into one on the
# right; a sentence's final full stop is fine ("version 1.2.3.").
_VERSION_IN_TEXT = re.compile(r"(?<![\w.])(" + VERSION_PATTERN + r")(?!\w|\.\w)", re.VERBOSE | re.IGNORECASE)


class ProbeError(Exception):
    """The target interpreter could not be asked for its distributions (missing, broken, timed out)."""


@dataclass(frozen=True)
class Detected:
    """What was found: versions by component name, and names whose lookup went wrong (with why)."""

    versions: Mapping[str, str] = field(default_factory=dict)
    problems: Mapping[str, str] = field(default_factory=dict)


def distribution_versions(python: str, names: Sequence[str], env: Mapping[str, str]) -> dict[str, str | None]:
    """Version of each distribution in `names` as `python` sees it (None when not installed).

    Raises `ProbeError` when the interpreter cannot be run or answers nonsense.
    """
    if not names:
        return {}
    argv = [python, "-c", DISTRIBUTIONS_SCRIPT, *names]
    try:
        done = subprocess.run(
            argv, env=dict(env), capture_output=True, text=True, timeout=DISTRIBUTION_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        raise ProbeError(f"interpreter {python} not found") from None
    except PermissionError:
        raise ProbeError(f"interpreter {python} is not executable") from None
    except subprocess.TimeoutExpired:
        raise ProbeError(f"interpreter {python} did not answer within {DISTRIBUTION_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        tail = " ".join(clean(done.stderr).strip().splitlines()[-3:])
        raise ProbeError(f"interpreter {python} failed to list its distributions (exit {done.returncode}): {tail}")
    try:
        answer = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise ProbeError(f"interpreter {python} printed no distribution list: {excerpt(done.stdout, 200)!r}") from None
    return {name: (str(answer[name]) if answer.get(name) is not None else None) for name in names}


def version_in_text(text: str) -> str | None:
    """The first PEP 440 version in a tool's ``--version`` output ("tool 1.2.3" -> "1.2.3").

    A dotted version is preferred over a bare number, so "tool (build 42) 1.2.3" gives 1.2.3.
    """
    candidates = [m.group(1) for m in _VERSION_IN_TEXT.finditer(text)]
    dotted = [c for c in candidates if "." in c]
    chosen = (dotted or candidates or [None])[0]
    # The pattern only matches valid versions, so this normalises ("v2.0" -> "2.0") and never raises.
    return None if chosen is None else str(Version(chosen))


def executable_version(name: str, env: Mapping[str, str]) -> tuple[str | None, str]:
    """(version, problem) of executable `name` on the PATH of `env`: (None, "") when there is no such file."""
    path = shutil.which(name, path=env.get("PATH", os.defpath))
    if path is None:
        return None, ""
    try:
        done = subprocess.run(
            [path, "--version"],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=EXECUTABLE_TIMEOUT_S,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return None, f"`{name} --version` did not answer within {EXECUTABLE_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return None, f"`{name} --version` could not run: {exc.strerror or exc}"
    output = (done.stdout + "\n" + done.stderr).strip()
    version = version_in_text(output)
    if version is None:
        first = output.splitlines()[0] if output else "nothing"
        return None, f"`{name} --version` printed no version ({excerpt(first, 120)!r})"
    return version, ""


def detect(python: str, names: Sequence[str], env: Mapping[str, str]) -> Detected:
    """Find every component: as a distribution of `python`, else as an executable on PATH.

    Raises `ProbeError` when `python` itself cannot be queried.
    """
    distributions = distribution_versions(python, names, env)
    versions: dict[str, str] = {}
    problems: dict[str, str] = {}
    for name in names:
        found = distributions.get(name)
        if found is not None:
            versions[name] = found
            continue
        version, problem = executable_version(name, env)
        if version is not None:
            versions[name] = version
        elif problem:
            problems[name] = problem
    return Detected(versions, problems)


def same_version(expected: str, found: str) -> bool:
    """PEP 440 equality (normalised spelling; local labels compared too); plain text when unparseable."""
    try:
        return Version(expected) == Version(found)
    except InvalidVersion:
        return expected.strip() == found.strip()


def mismatches(expected: Mapping[str, str], detected: Detected, where: str = "host") -> list[str]:
    """One sentence per component that is absent or at another version, in the catalog's order.

    ``runtime says vllm-rs 0.30.0, host has 0.29.0`` / ``host has no vllm-rs``.
    """
    problems = []
    for name, version in expected.items():
        if name in detected.problems:
            problems.append(f"runtime says {name} {version}, but {detected.problems[name]}")
        elif name not in detected.versions:
            problems.append(f"{where} has no {name}")
        elif not same_version(version, detected.versions[name]):
            problems.append(f"runtime says {name} {version}, {where} has {detected.versions[name]}")
    return problems
