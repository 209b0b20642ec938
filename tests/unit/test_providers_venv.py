"""The venv provider without the network: prepare, locking, listing and pruning over environments laid out
by hand the way a build leaves them."""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from matrix.cells import RuntimeInfo
from matrix.launch.providers import (
    Environment,
    Mismatch,
    NotProvisioned,
    ProvisionFailed,
    Unavailable,
    ensure_provisioned,
    prepare,
)
from matrix.launch.providers.store import list_envs, prune, referenced_names
from matrix.launch.providers.venv import ProvisionError, Target, envs_dir, provision_target, resolve_target, targets_of
from matrix.launch.providers.venv import provisioning as venv_module
from tests.helpers.cli import Matrix

STEPS: list[Any] = [
    {"requirements_of": "ai-dynamo==1.6.1", "exclude": ["aisimulate"]},
    ["--no-deps", "ai-dynamo==1.6.1"],
]


def _runtime(version: str = "1.6.1", steps: list[Any] | None = None, **provider: Any) -> RuntimeInfo:
    return RuntimeInfo(
        backend="dynamo",
        version=version,
        tag=f"v{version}",
        provider={"kind": "venv", "steps": steps or STEPS, **provider},  # no python: this interpreter
        components={"ai-dynamo": version, "ai-dynamo-runtime": version},
    )


def _fake_env(target: Target, components: dict[str, str], *, key: str | None = None) -> Path:
    """What a finished build leaves: bin/python and env.json, under the final name."""
    (target.path / "bin").mkdir(parents=True)
    (target.path / "bin" / "python").symlink_to(sys.executable)
    info = {"key": key or target.key, "components": components, "size_bytes": 1234, "created": "2026-11-30T10:00:00"}
    (target.path / "env.json").write_text(json.dumps(info))
    return target.path


@contextmanager
def _holding(lock: Path) -> Iterator[None]:
    """Hold a build lock the way another runner would."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


def test_envs_live_in_the_data_directory(matrix: Matrix) -> None:
    assert envs_dir() == matrix.home / "envs"
    assert resolve_target(_runtime()).path.parent == matrix.home / "envs"


def test_not_provisioned_is_a_skip_with_the_command(matrix: Matrix) -> None:
    environment = prepare(_runtime())
    assert isinstance(environment, NotProvisioned)
    assert environment.reason == (
        "runtime dynamo 1.6.1 is not provisioned: run `matrix runtime provision --runtime dynamo=1.6.1`"
    )


def test_provisioned_env_gives_its_interpreter_and_path(matrix: Matrix) -> None:
    runtime = _runtime()
    path = _fake_env(resolve_target(runtime), {"ai-dynamo": "1.6.1", "ai-dynamo-runtime": "1.6.1"})
    environment = prepare(runtime)
    assert isinstance(environment, Environment)
    assert environment.python == str(path / "bin" / "python")
    assert environment.env["PATH"].split(os.pathsep)[0] == str(path / "bin")
    assert environment.env["VIRTUAL_ENV"] == str(path)
    assert environment.env["PYTHONPATH"] == ""  # nothing of the runner's own import path leaks in
    assert environment.components == {"ai-dynamo": "1.6.1", "ai-dynamo-runtime": "1.6.1"}


def test_recorded_components_are_checked_against_the_catalog(matrix: Matrix) -> None:
    runtime = _runtime()
    _fake_env(resolve_target(runtime), {"ai-dynamo": "1.6.0", "ai-dynamo-runtime": "1.6.1"})
    environment = prepare(runtime)
    assert isinstance(environment, Mismatch)
    assert environment.reason == "runtime says ai-dynamo 1.6.1, venv has 1.6.0"


def test_unrecorded_components_are_looked_up_in_the_env(matrix: Matrix) -> None:
    # Another runtime with the same recipe may list components the first build did not record.
    runtime = _runtime()
    _fake_env(resolve_target(runtime), {})
    environment = prepare(runtime)
    assert isinstance(environment, Mismatch)
    assert environment.reason == "venv has no ai-dynamo; venv has no ai-dynamo-runtime"


def test_env_of_another_key_or_with_a_dangling_interpreter_is_not_used(matrix: Matrix) -> None:
    runtime = _runtime()
    target = resolve_target(runtime)
    _fake_env(target, {"ai-dynamo": "1.6.1", "ai-dynamo-runtime": "1.6.1"}, key="0" * 64)
    assert isinstance(prepare(runtime), NotProvisioned)
    (target.path / "env.json").write_text(json.dumps({"key": target.key}))
    (target.path / "bin" / "python").unlink()
    (target.path / "bin" / "python").symlink_to(target.path / "gone")
    assert isinstance(prepare(runtime), NotProvisioned)


def test_last_failure_is_the_failure_reason(matrix: Matrix) -> None:
    """A recipe that failed to build fails its cells (`ProvisionFailed`), the build's error line first."""
    runtime = _runtime()
    target = resolve_target(runtime)
    target.root.mkdir(parents=True)
    error = "provisioning dynamo-1.6.1 failed at step 2/3: pip exit 1\nbuild error: ERROR: pip said no"
    target.failure_path.write_text(json.dumps({"at": "2026-11-30T10:00:00+00:00", "error": error}))
    environment = prepare(runtime)
    assert isinstance(environment, ProvisionFailed)
    assert environment.reason == (
        "runtime dynamo 1.6.1 failed to build (2026-11-30T10:00:00+00:00): ERROR: pip said no\n"
        f"{error}\nretry with `matrix runtime provision --runtime dynamo=1.6.1`"
    )


def test_a_host_that_cannot_build_it_is_a_skip(matrix: Matrix) -> None:
    runtime = _runtime()
    target = resolve_target(runtime)
    target.root.mkdir(parents=True)
    record = {"at": "2026-11-30T10:00:00+00:00", "error": "no Python 3.99 interpreter on PATH", "host": True}
    target.failure_path.write_text(json.dumps(record))
    environment = prepare(runtime)
    assert type(environment) is NotProvisioned
    assert "cannot be built on this host" in environment.reason and "3.99" in environment.reason


def test_missing_interpreter_and_bad_recipe(matrix: Matrix, tmp_path: Path) -> None:
    missing = prepare(_runtime(python=str(tmp_path / "python3.99")))
    assert type(missing) is Unavailable and "is not on this host" in missing.reason
    bad = prepare(_runtime(steps=[{"requirements_of": "ai-dynamo==1.6.1", "excludes": []}]))
    assert isinstance(bad, Mismatch) and "unknown key(s) excludes" in bad.reason


def test_a_second_runner_waits_for_the_build_and_reuses_it(matrix: Matrix) -> None:
    runtime = _runtime()
    target = resolve_target(runtime)
    lines: list[str] = []
    with _holding(target.lock_path):

        def other_runner_finishes() -> None:
            time.sleep(0.3)
            _fake_env(target, {"ai-dynamo": "1.6.1", "ai-dynamo-runtime": "1.6.1"})
            # The lock is released when the `with` block below ends; the env exists before that.

        finisher = threading.Thread(target=other_runner_finishes)
        finisher.start()
        result: list[Any] = []
        waiter = threading.Thread(target=lambda: result.append(provision_target(runtime, echo=lines.append)))
        waiter.start()
        finisher.join()
        time.sleep(0.2)
        assert waiter.is_alive()  # still blocked on the lock
    waiter.join(timeout=10)
    assert result[0].built is False and result[0].waited is True
    assert lines == [f"dynamo-1.6.1: waiting for another runner that is building environment {target.name}"]


def test_ensure_provisioned_builds_each_recipe_once(matrix: Matrix, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def failing(runtime: RuntimeInfo, *, echo: Any, **_: Any) -> Any:
        calls.append(runtime.label)
        raise ProvisionError(f"provisioning {runtime.label} failed at step 2/4: pip exploded")

    monkeypatch.setattr(venv_module, "provision_target", failing)
    same_recipe = RuntimeInfo(backend="dynamo", version="1.6.1.post1", tag="v", provider=dict(_runtime().provider))
    host = RuntimeInfo(backend="vllm", version="0.30.0", tag="v0.30.0", provider={"kind": "host"})
    bad = _runtime("1.5.1", steps=[["six"], "oops"])
    failures = ensure_provisioned([_runtime(), same_recipe, host, bad, _runtime()], echo=lambda _: None)
    assert calls == ["dynamo-1.6.1"]
    assert set(failures) == {"dynamo-1.6.1", "dynamo-1.6.1.post1", "dynamo-1.5.1"}
    assert failures["dynamo-1.6.1.post1"] == failures["dynamo-1.6.1"]
    assert "steps[1] must be a list" in failures["dynamo-1.5.1"]


def test_ensure_provisioned_reports_nothing_when_all_are_ready(matrix: Matrix) -> None:
    runtime = _runtime()
    _fake_env(resolve_target(runtime), {"ai-dynamo": "1.6.1", "ai-dynamo-runtime": "1.6.1"})
    lines: list[str] = []
    assert ensure_provisioned([runtime], echo=lines.append) == {}
    assert lines == []  # a ready environment costs no output


def test_list_and_prune(matrix: Matrix) -> None:
    used, unused = _runtime("1.6.1"), _runtime("1.5.1", steps=[["six==1.16.0"]])
    used_target, unused_target = resolve_target(used), resolve_target(unused)
    _fake_env(used_target, {})
    _fake_env(unused_target, {})
    root = envs_dir()
    stale = root / f".tmp-{'a' * 20}-123-abcdef"
    (stale / "bin").mkdir(parents=True)
    building = root / f".tmp-{'b' * 20}-456-abcdef"
    building.mkdir()
    (root / f"{'c' * 20}.lock").touch()  # lock file of an environment long gone
    (root / f"{'c' * 20}.failed.json").write_text("{}")
    referenced = referenced_names([used])
    assert referenced == {target.name for target in targets_of(used)}  # built by uv or by pip
    assert used_target.name in referenced

    with _holding(root / f"{'b' * 20}.lock"):
        states = {e.path.name: e.state for e in list_envs()}
        assert states == {
            used_target.name: "ready",
            unused_target.name: "ready",
            stale.name: "stale",
            building.name: "building",
        }
        dry = prune(referenced, dry_run=True)
        assert {r.path.name for r in dry.removed} == {unused_target.name, stale.name}
        assert unused_target.path.exists() and stale.exists()

        report = prune(referenced)
    assert {r.path.name for r in report.removed} == {unused_target.name, stale.name}
    assert report.kept == (used_target.name,)
    assert report.busy == (building.name,)
    assert report.freed_bytes >= 1234
    assert used_target.path.exists() and building.exists()
    assert not unused_target.path.exists() and not stale.exists()
    assert not (root / f"{'c' * 20}.lock").exists() and not (root / f"{'c' * 20}.failed.json").exists()
    assert not any(p.name.startswith(".trash-") for p in root.iterdir())


def test_a_carried_spec_is_not_parsed_again_by_prepare(matrix: Matrix, monkeypatch: pytest.MonkeyPatch) -> None:
    """[M18] The campaign parses each runtime's entry once (`LocalHooks.with_specs`); preparing a cell's
    environment then reads the carried recipe, where before it parsed the entry once per installer."""
    from matrix.cells import CaseInfo, Cell
    from matrix.executors.hooks import LocalHooks
    from matrix.launch.providers import recipe

    runtime = _runtime()
    _fake_env(resolve_target(runtime), {"ai-dynamo": "1.6.1", "ai-dynamo-runtime": "1.6.1"})
    parses: list[str] = []
    real = recipe.check_keys
    monkeypatch.setattr(recipe, "check_keys", lambda provider, label: parses.append(label) or real(provider, label))
    assert isinstance(prepare(runtime), Environment) and len(parses) == 2  # without a spec: once per installer
    other = _runtime("1.6.2")
    case = CaseInfo("c", "dynamo", "dynamo", "m", ())
    cells = [Cell(case, runtime), Cell(case, runtime), Cell(case, other, roles=(("prefill", runtime),))]
    parses.clear()
    parsed = LocalHooks().with_specs(cells)
    assert sorted(parses) == ["dynamo-1.6.1", "dynamo-1.6.2"]  # each runtime once, whatever its cells and roles
    assert all(isinstance(r.spec, recipe.VenvRecipe) for c in parsed for r in (c.runtime, *dict(c.roles).values()))
    parses.clear()
    environment = prepare(parsed[0].runtime)
    assert isinstance(environment, Environment) and parses == []
    assert environment == prepare(runtime)  # the same environment as from the entry itself
    # An entry that does not parse is left unparsed: its cells fail on it as before.
    broken = RuntimeInfo(backend="dynamo", version="9", tag="v9", provider={"kind": "venv", "steps": []})
    (left,) = LocalHooks().with_specs([Cell(case, broken)])
    assert left.runtime.spec is None and isinstance(prepare(left.runtime), Mismatch)
