"""`matrix runtime caches`: list the runtimes' engine cache directories, clear some or all."""

from __future__ import annotations

import json

from tests.helpers.cli import Matrix


def test_list_clear_by_runtime_prefix_and_refuse_an_unknown_key(matrix: Matrix) -> None:
    root = matrix.home / "caches"
    for key, size in (("vllm-0.30.0-aaaa", 3000), ("vllm-0.30.0-bbbb", 10), ("sglang-0.5.21-cccc", 500)):
        (root / key / "triton").mkdir(parents=True)
        (root / key / "triton" / "kernel.bin").write_bytes(b"x" * size)
    listed = json.loads(matrix("runtime", "caches", "--json").output)
    assert listed["enabled"] is True
    assert [c["key"] for c in listed["caches"]] == ["vllm-0.30.0-aaaa", "sglang-0.5.21-cccc", "vllm-0.30.0-bbbb"]
    bad = matrix("runtime", "caches", "--clear", "vllm-9.9")
    assert bad.exit_code == 2 and "no cache directory for vllm-9.9" in bad.output
    assert len(list(root.iterdir())) == 3  # nothing removed on bad input
    cleared = matrix("runtime", "caches", "--clear", "vllm-0.30.0")
    assert cleared.exit_code == 0 and "removed 2 cache director(ies)" in cleared.output
    assert [p.name for p in root.iterdir()] == ["sglang-0.5.21-cccc"]
    assert matrix("runtime", "caches", "--clear-all").exit_code == 0
    assert list(root.iterdir()) == []
    assert "none yet" in matrix("runtime", "caches").output
