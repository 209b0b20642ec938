"""Persistent engine caches, one directory per runtime: compiled kernels survive from one cell to the next.

Engines compile on every start (torch.compile/Inductor, Triton kernels, FlashInfer and DeepGEMM JIT, the
CUDA driver's PTX cache, transformers' remote-code modules) and keep the results in cache directories
they take from environment variables. Pointing those variables at `<data>/caches/<runtime key>/` makes
the second cell of a runtime find what the first one built.

The key is the runtime's backend and version plus a digest of its provider recipe and components, so
runtimes of different versions (or one version built two ways) never share a directory: a kernel
compiled by one Triton or torch must never be loaded by another.

`MATRIX_ENGINE_CACHES=off` (or 0/false/no) turns them off; cells then keep their caches inside their own
directory, as before. Container runtimes never get them (the host path is not mounted in the container).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from matrix.cells import RuntimeInfo
from matrix.paths import data_dir

SWITCH_ENV = "MATRIX_ENGINE_CACHES"
_OFF = {"0", "off", "false", "no"}

# variable -> subdirectory of the runtime's cache directory. Each is the engine's own knob.
CACHE_VARIABLES: Mapping[str, str] = {
    "XDG_CACHE_HOME": "xdg",  # the default of most of the below (~/.cache/...), and of anything else
    "VLLM_CACHE_ROOT": "vllm",  # vLLM: torch.compile artefacts, its own kernel caches
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",  # torch.compile / Inductor (SGLang, plain torch)
    "TRITON_CACHE_DIR": "triton",  # compiled Triton kernels (SGLang's attention backend)
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",  # FlashInfer's JIT modules live under <base>/.cache/flashinfer
    "SGLANG_DG_CACHE_DIR": "deep_gemm",  # SGLang's DeepGEMM JIT cache
    "DG_JIT_CACHE_DIR": "deep_gemm",  # DeepGEMM's own name for the same
    "TVM_FFI_CACHE_DIR": "tvm-ffi",  # FlashInfer's newer TVM-FFI builds
    "CUDA_CACHE_PATH": "nv-compute",  # the CUDA driver's PTX -> SASS cache
    "HF_MODULES_CACHE": "hf-modules",  # transformers' trust_remote_code modules
}


def caches_root() -> Path:
    return data_dir() / "caches"


def enabled(env: Mapping[str, str] | None = None) -> bool:
    value = (os.environ if env is None else env).get(SWITCH_ENV, "on")
    return value.strip().lower() not in _OFF


def runtime_key(runtime: RuntimeInfo) -> str:
    """`<backend>-<version>-<digest>`: readable, and different whenever the recipe or components differ."""
    recipe = json.dumps({"provider": runtime.provider, "components": runtime.components}, sort_keys=True, default=str)
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._+-]", "_", f"{runtime.backend}-{runtime.version}")
    return f"{name}-{digest}"


def cache_env(runtime: RuntimeInfo) -> dict[str, str]:
    """The variables that point a runtime's engines at its persistent caches (directories created);
    empty when caches are off or the runtime runs in a container."""
    if not enabled() or runtime.provider.get("kind") == "container":
        return {}
    base = caches_root() / runtime_key(runtime)
    env = {name: str(base / sub) for name, sub in CACHE_VARIABLES.items()}
    for path in set(env.values()):
        Path(path).mkdir(parents=True, exist_ok=True)
    return env


@dataclass(frozen=True)
class CacheDir:
    key: str
    path: Path
    bytes: int
    files: int


def _size(path: Path) -> tuple[int, int]:
    total = files = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
            files += 1
    return total, files


def list_caches() -> list[CacheDir]:
    """Every runtime's cache directory with its size, largest first."""
    root = caches_root()
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.is_dir():
            size, files = _size(path)
            found.append(CacheDir(path.name, path, size, files))
    return sorted(found, key=lambda c: (-c.bytes, c.key))


def clear_caches(keys: list[str] | None = None) -> list[CacheDir]:
    """Remove the cache directories of `keys` (every one when None); returns what was removed.

    A key is a directory name from `list_caches`; a prefix such as `vllm-0.30.0` matches every recipe
    of that runtime."""
    removed = []
    for cache in list_caches():
        if keys is None or any(cache.key == k or cache.key.startswith(f"{k}-") for k in keys):
            shutil.rmtree(cache.path, ignore_errors=True)
            removed.append(cache)
    return removed


def summary() -> str:
    """One line for `matrix doctor`: how many runtimes have caches and how big they are."""
    caches = list_caches()
    state = "on" if enabled() else f"off ({SWITCH_ENV})"
    if not caches:
        return f"{state}: none yet, in {caches_root()}"
    total = sum(c.bytes for c in caches)
    biggest = ", ".join(f"{c.key} {c.bytes / 2**20:.1f} MiB" for c in caches[:3])
    return f"{state}: {len(caches)} runtime(s), {total / 2**20:.1f} MiB in {caches_root()} (largest: {biggest})"
