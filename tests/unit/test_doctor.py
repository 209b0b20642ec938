"""`matrix doctor` on this machine: no GPU, no running container engine, nothing provisioned."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from matrix import doctor as doctor_module
from matrix.catalog.queries import load_catalog_view
from matrix.doctor import runtime_readiness
from matrix.launch.providers import container as container_module
from tests.helpers.cli import Matrix


@pytest.fixture
def no_gpus_no_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This machine as CI sees it, whatever the machine running the test has: no GPU, and a docker client
    whose daemon is not running."""
    monkeypatch.setattr(doctor_module, "inventory", lambda: ())
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text(
        "#!/bin/sh\necho 'Cannot connect to the Docker daemon at unix:///var/run/docker.sock. "
        "Is the docker daemon running?' >&2\nexit 1\n"
    )
    docker.chmod(0o755)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "podman").exists())
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{path}")
    container_module._status.clear()
    yield
    container_module._status.clear()


def _doctor(m: Matrix) -> dict[str, Any]:
    result = m("doctor", "--json")
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.output)
    return data


def test_host_facts(seeded: Matrix, no_gpus_no_engine: None) -> None:
    host = _doctor(seeded)["host"]
    assert host["gpus"] == []
    assert host["container_engines"]["docker"] == (
        "container engine docker is not running on this host (docker info failed: Cannot connect to the Docker "
        "daemon at unix:///var/run/docker.sock. Is the docker daemon running?)"
    )
    assert host["container_engines"]["podman"] == "not installed"
    assert host["default_engine"] == "docker"
    assert host["python"].split()[0].count(".") == 2
    assert host["data_dir"] == str(seeded.home)
    assert host["disk_free_bytes"] > 0
    assert host["shm_bytes"] is None or host["shm_bytes"] > 0


def test_every_runtime_with_why_it_cannot_run(seeded: Matrix, no_gpus_no_engine: None) -> None:
    runtimes = {r["runtime"]: r for r in _doctor(seeded)["runtimes"]}
    assert len(runtimes) == len(json.loads(seeded("runtimes", "list", "--json").output))
    reference = runtimes["reference-0.1.0"]
    assert (reference["status"], reference["runnable"], reference["cells"], reference["runnable_cells"]) == (
        "ready", "partly", 6, 5,
    )  # fmt: skip
    assert reference["reasons"] == ["1 of 6 case(s) need 1 GPU, host has 0"]
    dynamo = runtimes["dynamo-1.6.1"]
    assert (dynamo["status"], dynamo["runnable"], dynamo["cells"]) == ("not provisioned", "no", 8)
    assert dynamo["reasons"][0] == (
        "runtime dynamo 1.6.1 is not provisioned: run `matrix runtime provision --runtime dynamo=1.6.1`"
    )
    vllm = runtimes["vllm-0.29.1rc0"]
    # Nothing of it installed: the runtime is not on this host (a skip); a wrong version would be a mismatch.
    assert (vllm["provider"], vllm["status"], vllm["runnable"]) == ("host", "unavailable", "no")
    assert vllm["reasons"] == [
        "runtime vllm-0.29.1rc0 is not installed on this host (none of vllm, vllm-rs found)",
        "5 of 5 case(s) need 1 GPU, host has 0",
    ]
    venv_vllm = runtimes["vllm-0.30.0"]
    assert (venv_vllm["provider"], venv_vllm["status"]) == ("venv", "not provisioned")
    assert runtimes["trtllm-1.3.0rc26"]["reasons"][-1] == "no case uses this runtime"


def test_table_view(seeded: Matrix, no_gpus_no_engine: None) -> None:
    result = seeded("doctor")
    assert result.exit_code == 0, result.output
    for text in (
        "container engines",
        "docker info failed",
        "none (NVML not available): GPU cases are skipped",
        "/dev/shm",
        "not provisioned",
        "matrix runtime provision --runtime dynamo=1.6.1",
        "is not installed on this host",
        "5/6",
    ):
        assert text in result.output, text


def test_empty_catalog(matrix: Matrix, no_gpus_no_engine: None) -> None:
    result = matrix("doctor")
    assert result.exit_code == 0, result.output
    assert "the catalog has no runtimes: run `matrix catalog sync`" in result.output


def test_readiness_with_a_gpu_and_a_disabled_runtime(seeded: Matrix) -> None:
    from matrix.db.engine import create_db_engine, session_factory

    engine = create_db_engine(f"sqlite:///{seeded.db_path}")
    with session_factory(engine)() as session:
        cases, runtimes, markers, backends = load_catalog_view(session)
    engine.dispose()
    runtimes = [replace(r, enabled=False) if r.label == "reference-0.1.0" else r for r in runtimes]
    with_gpu = {
        r.runtime: r
        for r in runtime_readiness(cases, runtimes, known_markers=markers, known_backends=backends, gpu_count=1)
    }
    assert with_gpu["reference-0.1.0"].status == "disabled"
    assert with_gpu["reference-0.1.0"].reasons[0] == "disabled: `matrix runtime enable reference 0.1.0`"
    assert with_gpu["reference-0.1.0"].cells == 6  # what it would run once enabled
    enabled = [replace(r, enabled=True) for r in runtimes]
    ready = {
        r.runtime: r
        for r in runtime_readiness(cases, enabled, known_markers=markers, known_backends=backends, gpu_count=1)
    }
    assert (ready["reference-0.1.0"].runnable, ready["reference-0.1.0"].runnable_cells) == ("yes", 6)
    assert ready["reference-0.1.0"].reasons == ()


def test_scale_out_extras_are_reported_with_how_to_get_them(seeded: Matrix, no_gpus_no_engine: None) -> None:
    import importlib.metadata

    host = _doctor(seeded)["host"]
    # The dev extra installs both, so the real installed versions must show.
    assert host["scale_out"] == {
        "ray": importlib.metadata.version("ray"),
        "postgres": importlib.metadata.version("psycopg"),
    }
    assert doctor_module._extra_line("ray", None) == (
        "not installed: pip install 'disagg-matrix[ray]' for --executor ray"
    )
