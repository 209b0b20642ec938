"""Which Python interpreters really run: probed before one is chosen for a runtime.

A file named ``python3.12`` on PATH is not always a Python 3.12: a pyenv shim for a version that is not
installed exits 127, a dangling link or a wrapper for a removed toolchain fails the same way. Taking the
first such name found would build (or run) a runtime on an interpreter that cannot start. So every
candidate is asked for its version in a child process, the first that answers is chosen, and a given path
that does not answer is called what it is: "this interpreter does not run".
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from matrix.text import clean, excerpt

__all__ = ["Found", "Probe", "find_python", "interpreter_version", "probe"]

PROBE_TIMEOUT_S = 30.0
_MAJOR_MINOR = re.compile(r"^\d+\.\d+$")
_VERSION_SCRIPT = "import sys; print('%d.%d' % sys.version_info[:2])"


@dataclass(frozen=True)
class Probe:
    """What asking one interpreter for its version gave: its major.minor, or why it does not run."""

    version: str | None
    problem: str = ""


@lru_cache(maxsize=64)
def _probe(python: str, mtime_ns: int, env: tuple[tuple[str, str], ...] | None) -> Probe:
    del mtime_ns  # part of the cache key only: a replaced interpreter is asked again
    try:
        done = subprocess.run(
            [python, "-c", _VERSION_SCRIPT],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
            env=dict(env) if env is not None else None,
        )
    except subprocess.TimeoutExpired:
        return Probe(None, f"did not answer within {PROBE_TIMEOUT_S:.0f} s")
    except OSError as exc:
        return Probe(None, exc.strerror or str(exc))
    answer = done.stdout.strip()
    if done.returncode == 0 and _MAJOR_MINOR.match(answer):
        return Probe(answer)
    if done.returncode != 0:
        # The last line it printed says why (a shim: "pyenv: python3.12: command not found").
        last = excerpt((clean(done.stderr).strip().splitlines() or [""])[-1], 200)
        return Probe(None, f"exit {done.returncode}" + (f": {last}" if last else ""))
    return Probe(None, f"printed {excerpt(answer, 40)!r}, not a version")


def probe(python: str, env: Mapping[str, str] | None = None) -> Probe:
    """Ask the interpreter at `python` (a path) for its major.minor, in environment `env` (default: ours)."""
    try:
        mtime_ns = os.stat(python).st_mtime_ns
    except OSError as exc:
        return Probe(None, exc.strerror or str(exc))
    return _probe(python, mtime_ns, tuple(sorted(env.items())) if env is not None else None)


def interpreter_version(python: str) -> str | None:
    """major.minor of the interpreter at `python`, or None when it does not run."""
    return probe(python).version


@dataclass(frozen=True)
class Found:
    """The first candidate that runs (None if none does), and those passed over with why."""

    path: str | None
    passed_over: tuple[tuple[str, str], ...] = ()

    def why_not(self) -> str:
        """``/x/python3.12 does not run (exit 127)``, for each candidate passed over; "" when there were none."""
        return "; ".join(f"{path} {problem}" for path, problem in self.passed_over)


def find_python(name: str, path: str | None = None, *, version: str | None = None) -> Found:
    """The first `name` on `path` (default: PATH) that runs, and, when `version` is given, is that
    major.minor; like `shutil.which`, but a candidate that cannot start is passed over, not chosen."""
    passed: list[tuple[str, str]] = []
    seen: set[str] = set()
    for directory in (path if path is not None else os.environ.get("PATH", os.defpath)).split(os.pathsep):
        candidate = os.path.join(directory or os.curdir, name)
        if candidate in seen or not (os.path.isfile(candidate) and os.access(candidate, os.X_OK)):
            continue
        seen.add(candidate)
        answer = probe(candidate)
        if answer.version is None:
            passed.append((candidate, f"does not run ({answer.problem})"))
        elif version is not None and answer.version != version:
            passed.append((candidate, f"is Python {answer.version}"))
        else:
            return Found(os.path.abspath(candidate), tuple(passed))
    return Found(None, tuple(passed))
