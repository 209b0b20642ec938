"""The venv provider for real: environments built from PyPI, reused, built once under concurrency, never
left half-built by a crash, pruned; and the `matrix runtime` commands over them.

The recipes are tiny (six, and requests' requirements without two of them) so the module stays fast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from matrix.cells import RuntimeInfo
from matrix.launch.providers import Environment, NotProvisioned, ProvisionFailed, prepare
from matrix.launch.providers.store import list_envs, prune
from matrix.launch.providers.venv import ProvisionError, choose_installer, provision_target, resolve_target
from tests.helpers.cli import Matrix, toml_value

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

# requests without urllib3 and charset-normalizer: the shape of ai-dynamo without aisimulate.
TOY: dict[str, Any] = {
    "backend": "toy",
    "version": "1.0",
    "tag": "v1.0",
    "provider": {
        "kind": "venv",
        "steps": [
            ["six==1.16.0"],
            {"requirements_of": "requests==2.32.3", "exclude": ["urllib3", "charset-normalizer"]},
            ["--no-deps", "requests==2.32.3"],
        ],
    },
    "components": {"six": "1.16.0", "requests": "2.32.3"},
}
SMALL: dict[str, Any] = {
    "backend": "toy",
    "version": "2.0",
    "tag": "v2.0",
    "provider": {"kind": "venv", "steps": [["six==1.16.0"]]},
    "components": {"six": "1.16.0"},
}
# Fails at once, before building anything: no such interpreter.
NO_PYTHON: dict[str, Any] = {
    "backend": "toy",
    "version": "4.0",
    "tag": "v4.0",
    "provider": {"kind": "venv", "python": "3.99", "steps": [["six==1.16.0"]]},
    "components": {},
}
BROKEN: dict[str, Any] = {
    "backend": "toy",
    "version": "3.0",
    "tag": "v3.0",
    "provider": {"kind": "venv", "steps": [["--no-index", "matrix-no-such-distribution==1.0"]]},
    "components": {},
}

PROVISION = """
import json, sys
from matrix.launch.providers.venv import provision_target
from matrix.cells import RuntimeInfo
result = provision_target(RuntimeInfo(**json.loads(sys.argv[1])), echo=lambda line: print(line, flush=True))
print(json.dumps({"built": result.built, "waited": result.waited}), flush=True)
"""


@pytest.fixture(scope="module")
def venv_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One data directory for the module: later tests use what earlier ones built."""
    path = tmp_path_factory.mktemp("venv-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MATRIX_HOME", str(path))
        patch.setenv("MATRIX_DB", str(path / "matrix.db"))
        yield path


def _start(spec: dict[str, Any], venv_home: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PROVISION, json.dumps(spec)],
        env={**os.environ, "MATRIX_HOME": str(venv_home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so a test can kill the builder with everything it started
    )


def _temps(venv_home: Path) -> list[Path]:
    root = venv_home / "envs"
    return [p for p in root.iterdir() if p.name.startswith(".tmp-")] if root.exists() else []


def test_provision_builds_the_recipe_atomically(venv_home: Path) -> None:
    runtime = RuntimeInfo(**TOY)
    target = resolve_target(runtime)
    assert isinstance(prepare(runtime), NotProvisioned)
    builder = _start(TOY, venv_home)
    saw_temp = False
    while builder.poll() is None:
        # The final name appears complete or not at all.
        if target.path.exists():
            assert (target.path / "env.json").exists()
        saw_temp = saw_temp or bool(_temps(venv_home))
        time.sleep(0.02)
    output = builder.stdout.read() if builder.stdout else ""
    assert builder.returncode == 0, output
    assert saw_temp
    assert json.loads(output.splitlines()[-1]) == {"built": True, "waited": False}
    assert "toy-1.0: step 1/5 create a Python" in output
    assert "toy-1.0: step 3/5 requirements of requests==2.32.3 without urllib3, charset-normalizer" in output
    assert _temps(venv_home) == []

    info = json.loads((target.path / "env.json").read_text())
    assert info["key"] == target.key
    assert info["components"] == {"six": "1.16.0", "requests": "2.32.3"}
    assert info["size_bytes"] > 500_000  # six and requests, without byte code (compiled on first import)
    assert info["recipe"]["steps"][1] == {
        "requirements_of": "requests==2.32.3",
        "exclude": ["charset-normalizer", "urllib3"],
    }
    frozen = {line.split("==")[0].lower() for line in info["freeze"]}
    assert {"six", "requests", "idna", "certifi"} <= frozen
    assert not {"urllib3", "charset-normalizer"} & frozen
    assert (target.path / "provision.log").exists()
    # Relocated: scripts name the final directory, never the temporary one (pip's own console script, when
    # pip built it, names the final interpreter; uv leaves no pip in the environment).
    scripts = [p for p in (target.path / "bin").iterdir() if p.is_file() and not p.is_symlink()]
    assert not [p.name for p in scripts if b"/.tmp-" in p.read_bytes()]
    assert f"{target.path}" in (target.path / "bin" / "activate").read_text()
    if info["installer"] == "pip":
        first_line = (target.path / "bin" / "pip").read_text().splitlines()[0]
        assert first_line.startswith(f"#!{target.path}/bin/python")

    environment = prepare(runtime)
    assert isinstance(environment, Environment)
    assert environment.components == {"six": "1.16.0", "requests": "2.32.3"}
    ran = subprocess.run(
        [environment.python, "-c", "import six, idna; print(six.__version__)"],
        env={**os.environ, **environment.env},
        capture_output=True,
        text=True,
        check=False,
    )
    assert ran.stdout.strip() == "1.16.0", ran.stderr


def test_second_provision_reuses_without_rebuilding(venv_home: Path) -> None:
    runtime = RuntimeInfo(**TOY)
    target = resolve_target(runtime)
    before = (target.path.stat().st_ino, (target.path / "env.json").stat().st_mtime_ns)
    lines: list[str] = []
    result = provision_target(runtime, echo=lines.append)
    assert (result.built, result.waited, result.path) == (False, False, target.path)
    assert lines == []
    assert (target.path.stat().st_ino, (target.path / "env.json").stat().st_mtime_ns) == before


def test_killed_build_leaves_no_half_environment_and_prune_cleans_up(venv_home: Path) -> None:
    runtime = RuntimeInfo(**SMALL)
    target = resolve_target(runtime)
    builder = _start(SMALL, venv_home)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        logs = [t / "provision.log" for t in _temps(venv_home)]
        if any(log.exists() and "pip install" in log.read_text() for log in logs):
            break
        time.sleep(0.02)
    else:
        pytest.fail("the build never reached its pip step")
    os.killpg(builder.pid, signal.SIGKILL)
    builder.wait()

    assert not target.path.exists()
    assert isinstance(prepare(runtime), NotProvisioned)
    # Stale once the lock is free: a child the builder was starting may still hold it for a moment (between
    # fork and exec it has every descriptor, and after setsid it is outside the killed group), until the
    # build watchdog kills it.
    deadline = time.monotonic() + 10
    while (states := [e.state for e in list_envs() if e.name == target.name]) == ["building"]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert states == ["stale"]
    report = prune({resolve_target(RuntimeInfo(**TOY)).name, target.name})
    assert [r.why for r in report.removed] == ["temporary directory of a build that did not finish"]
    assert _temps(venv_home) == []
    assert resolve_target(RuntimeInfo(**TOY)).path.exists()


def test_concurrent_runners_build_once(venv_home: Path) -> None:
    target = resolve_target(RuntimeInfo(**SMALL))
    runners = [_start(SMALL, venv_home), _start(SMALL, venv_home)]
    outputs = [r.communicate(timeout=90)[0] for r in runners]
    assert [r.returncode for r in runners] == [0, 0], outputs
    results = [json.loads(out.splitlines()[-1]) for out in outputs]
    assert sorted(r["built"] for r in results) == [False, True]
    waiter = outputs[[r["built"] for r in results].index(False)]
    assert "waiting for another runner that is building environment" in waiter
    assert sum(out.count("step 1/3") for out in outputs) == 1
    assert (target.path / "env.json").exists() and _temps(venv_home) == []


def test_failed_build_reports_the_end_of_its_log(venv_home: Path) -> None:
    runtime = RuntimeInfo(**BROKEN)
    with pytest.raises(ProvisionError) as failure:
        provision_target(runtime, echo=lambda _: None)
    message = str(failure.value)
    assert message.startswith("provisioning toy-3.0 failed at step 2/3: `")
    assert "--- last 20 lines of the build log ---" in message
    assert "matrix-no-such-distribution" in message.split("---")[-1]
    assert _temps(venv_home) == []
    assert not resolve_target(runtime).path.exists()
    failed = prepare(runtime)
    assert isinstance(failed, ProvisionFailed)  # the recipe does not build: its cells fail
    assert "failed to build" in failed.reason and "failed at step 2/3" in failed.reason
    # The installer's own error line, naming what was not found (uv's comes with the cause it prints under it).
    error = "ERROR: " if choose_installer().name == "pip" else "error: "
    line = next(line for line in message.splitlines() if line.startswith("build error: "))
    assert line.startswith(f"build error: {error}") and "matrix-no-such-distribution" in line, line


def test_runtime_commands(venv_home: Path) -> None:
    m = Matrix(home=venv_home, db_path=venv_home / "matrix.db")
    catalog = venv_home / "toy.toml"
    runtimes = "\n".join(
        f'[[runtime]]\nbackend = "toy"\nversion = "{spec["version"]}"\nprovider = {toml_value(spec["provider"])}\n'
        f"components = {toml_value(spec['components'])}\n"
        for spec in (TOY, NO_PYTHON)
    )
    catalog.write_text(f'[[backend]]\nname = "toy"\n\n{runtimes}')
    assert m("catalog", "sync", str(catalog)).exit_code == 0

    result = m("runtime", "provision", "--runtime", "toy=1.0")
    assert result.exit_code == 0, result.output
    assert f"toy-1.0: already provisioned: {resolve_target(RuntimeInfo(**TOY)).path}" in result.output

    result = m("runtime", "provision")  # toy-4.0 cannot be built here: exit 1, the other is fine
    assert result.exit_code == 1
    assert "provisioning toy-4.0 failed at step 1/3: no Python 3.99 interpreter" in result.output
    assert "1 of 2 runtime(s) provisioned" in result.output

    listed = {e["name"]: e for e in json.loads(m("runtime", "envs", "--json").output)}
    toy, small = resolve_target(RuntimeInfo(**TOY)).name, resolve_target(RuntimeInfo(**SMALL)).name
    assert listed[toy]["runtimes"] == ["toy-1.0"] and listed[toy]["state"] == "ready"
    assert listed[small]["runtimes"] == []
    assert "(unused)" in m("runtime", "envs").output

    result = m("runtime", "prune")
    assert result.exit_code == 0, result.output
    assert f"removed {venv_home / 'envs' / small} (not used by any runtime of the catalog" in result.output
    assert {e.name for e in list_envs()} == {toy}
    doctor = {r["runtime"]: r for r in json.loads(m("doctor", "--json").output)["runtimes"]}
    assert doctor["toy-1.0"]["status"] == "ready"
    assert doctor["toy-4.0"]["status"] == "not provisioned"
