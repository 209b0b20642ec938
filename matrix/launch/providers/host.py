"""The `host` provider: the runtime is already installed here, in this interpreter or a given one.

Before a cell runs, the components the catalog lists are looked up in that interpreter (and on PATH) and
must match: a host whose vllm-rs is not the catalog's vllm-rs would test something else under the
runtime's name, so that is a `config` failure, not a skip (version skew).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping

from matrix.cells import RuntimeInfo
from matrix.errors import ConfigError
from matrix.launch.providers.base import Environment, Mismatch, Unavailable
from matrix.launch.providers.components import ProbeError, detect, mismatches
from matrix.launch.providers.interpreters import find_python, probe
from matrix.launch.providers.recipe import HostConfig, host_config


def resolve_interpreter(python: str, path: str | None = None) -> str | None:
    """An interpreter given as a path or as a command name on PATH, as an absolute path (None if absent).

    A command name is the first on PATH that runs (`find_python`: a pyenv shim exiting 127 is passed
    over); a path is taken as given, and `probe` says whether it runs."""
    if os.sep in python:
        candidate = os.path.abspath(os.path.expanduser(python))
        return candidate if os.path.isfile(candidate) and os.access(candidate, os.X_OK) else None
    return find_python(python, path).path


def host_environment(config: HostConfig, python: str | None) -> dict[str, str]:
    """The extra environment of the runtime's processes: the provider's `env`, its `pythonpath` in front of
    any PYTHONPATH, and a given interpreter's directory in front of PATH (so its console scripts and a
    launch script's `python3` are that interpreter's)."""
    env = dict(config.env)
    if config.pythonpath:
        inherited = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join([*config.pythonpath, *([inherited] if inherited else [])])
    if python is not None:
        inherited_path = env.get("PATH", os.environ.get("PATH", os.defpath))
        env["PATH"] = os.pathsep.join([os.path.dirname(python), inherited_path])
    return env


def check_installed(
    runtime: RuntimeInfo, python: str, env: Mapping[str, str], where: str
) -> Mapping[str, str] | Unavailable | Mismatch:
    """The runtime's components as installed (name -> version), or why they do not match the catalog.

    `env` is the extra environment the cells get: lookups see the same PYTHONPATH and PATH as the cell.
    """
    if not runtime.components:
        return {}
    try:
        detected = detect(python, list(runtime.components), {**os.environ, **env})
    except ProbeError as exc:
        return Unavailable(f"runtime {runtime.label}: {exc}")
    if where == "host" and not detected.versions and not detected.problems:
        # Nothing of the runtime is here: it is simply not installed on this host, which is a skip, not a
        # failure (a GPU host need not carry every runtime of the catalog). A wrong version still fails.
        return Unavailable(f"runtime {runtime.label} is not installed on this host (none of "
                           f"{', '.join(sorted(runtime.components))} found)")  # fmt: skip
    problems = mismatches(runtime.components, detected, where)
    if problems:
        return Mismatch("; ".join(problems))
    return dict(detected.versions)


_VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def _unset_variables(config: HostConfig) -> list[str]:
    texts = [*(config.pythonpath), *config.env.values(), config.python or ""]
    names = {match.group(1) for text in texts for match in _VARIABLE.finditer(text)}
    return sorted(name for name in names if name not in os.environ)


def _expanded(config: HostConfig) -> HostConfig:
    """`$NAME` in the provider's python, pythonpath and env values, from this host's environment."""
    expand = os.path.expandvars
    return HostConfig(
        python=expand(config.python) if config.python else None,
        env={key: expand(value) for key, value in config.env.items()},
        pythonpath=tuple(expand(path) for path in config.pythonpath),
    )


def prepare_host(runtime: RuntimeInfo) -> Environment | Unavailable:
    """This interpreter (or the provider's), with the components checked against the catalog."""
    try:
        config = host_config(runtime)
    except ConfigError as exc:
        return Mismatch(str(exc))
    unset = _unset_variables(config)
    if unset:
        # e.g. pythonpath = ["$MATRIX_GPUKIT_SITE"]: where a prepared installation lives differs by host.
        return Unavailable(
            f"runtime {runtime.label} needs {', '.join('$' + name for name in unset)} (where its installation "
            "is on this host): set it, or run elsewhere"
        )
    config = _expanded(config)
    python = sys.executable
    given: str | None = None
    if config.python is not None:
        given = resolve_interpreter(config.python, config.env.get("PATH", os.environ.get("PATH")))
        if given is None:
            return Unavailable(f"interpreter {config.python} of runtime {runtime.label} is not on this host")
        answer = probe(given, {**os.environ, **host_environment(config, given)})  # as the cells will run it
        if answer.version is None:
            return Unavailable(
                f"interpreter {config.python} of runtime {runtime.label}: this interpreter does not run "
                f"({answer.problem})"
            )
        python = given
    env = host_environment(config, given)
    found = check_installed(runtime, python, env, "host")
    if isinstance(found, Unavailable):
        return found
    return Environment(python=python, env=env, components=found)
