"""The tiny random model is built once however many cells ask for it at once (a packed campaign starts a
dozen): the others wait on the build's flock and take the finished directory."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from matrix import model_files


def test_concurrent_requests_build_the_random_model_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[str] = []
    running = threading.Lock()

    def write_weights(python: str, directory: Path, revision: int) -> None:
        assert running.acquire(blocking=False), "two builds ran at once"
        try:
            builds.append(python)
            time.sleep(0.3)
            (directory / "model.safetensors").write_bytes(b"weights")
        finally:
            running.release()

    monkeypatch.setattr(model_files, "_write_weights", write_weights)
    with ThreadPoolExecutor(8) as pool:
        paths = list(pool.map(lambda n: model_files.ensure_tiny_model(root=tmp_path, weights_python=f"py{n}"),
                              range(8)))  # fmt: skip
    assert len(builds) == 1
    assert len(set(paths)) == 1
    assert (paths[0] / "model.safetensors").read_bytes() == b"weights"
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".building-")]


def test_a_failed_build_leaves_nothing_and_the_next_request_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(python: str, directory: Path, revision: int) -> None:
        raise model_files.ConfigError("no torch")

    monkeypatch.setattr(model_files, "_write_weights", broken)
    with pytest.raises(model_files.ConfigError):
        model_files.ensure_tiny_model(root=tmp_path, weights_python="py")
    monkeypatch.setattr(model_files, "_write_weights", lambda python, directory, revision: None)
    path = model_files.ensure_tiny_model(root=tmp_path, weights_python="py")
    assert (path / "tokenizer.json").is_file()


def test_another_revision_is_a_directory_of_its_own_built_from_its_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[M28] `model_revision`: the same config and tokenizer, weights from seed N, never the case's directory."""
    seeds: list[int] = []

    def write_weights(python: str, directory: Path, revision: int) -> None:
        seeds.append(revision)
        (directory / "model.safetensors").write_bytes(f"seed {revision}".encode())

    monkeypatch.setattr(model_files, "_write_weights", write_weights)
    case = model_files.ensure_tiny_model(root=tmp_path, weights_python="py")
    other = model_files.ensure_tiny_model(root=tmp_path, weights_python="py", revision=1)
    assert seeds == [0, 1] and other != case and other.name == f"{case.name}-r1"
    assert (case / "config.json").read_text() == (other / "config.json").read_text()
    assert (other / "model.safetensors").read_bytes() == b"seed 1"
    with pytest.raises(model_files.ConfigError, match="needs random weights"):
        model_files.ensure_tiny_model(root=tmp_path, revision=1)
