"""Typed case options (`matrix.launch.options`): `catalog sync` refuses a launch key no arm reads, a KV bound in a
unit the case's engine does not read, and a marker that restates the bound with another value; with the file,
the entry and the fix, exit 2, the database unchanged. And the tables agree with the arms' code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import matrix
from matrix.errors import ConfigError
from matrix.launch.options import COMMON_LAUNCH_KEYS, KV_FLAGS, LAUNCH_KEYS, KvBound, check_case_options, kv_arg
from tests.helpers.catalogs import assert_refused, catalog_with
from tests.helpers.cli import Matrix

# The seed's vllm_disaggregated case, with one thing wrong at a time.
VLLM_CASE = """[[case]]
name = "vllm_x"
backend = "vllm"
arm = "dynamo"
model = "m"
markers = ["gpu_1", {markers}]
kv_bound = {bound}
launch = {{ engine = "vllm", {launch} }}
"""


def _case(markers: str = "", bound: str = "{ bytes = 1119388000 }", launch: str = "max_model_len = 2048") -> str:
    return VLLM_CASE.format(markers=markers, bound=bound, launch=launch)


BAD_OPTIONS = {
    "misspelt launch key": (
        _case(launch="gpu_memory_utlization = 0.01"),
        ["extra.toml: [[case]] 'vllm_x'", "launch key 'gpu_memory_utlization' is not read by the dynamo arm",
         "did you mean 'gpu_memory_utilization'?"],
    ),
    "bound in the wrong unit": (
        _case(bound="{ tokens = 2048 }"),
        ["kv_bound.tokens is not read by dynamo's vllm engine", "write kv_bound = { bytes = N }"],
    ),
    "marker restating another value": (
        _case(markers='"requested_vllm_kv_cache_bytes(5)"'),
        ["marker requested_vllm_kv_cache_bytes(5) says 5 but kv_bound.bytes is 1119388000",
         "write requested_vllm_kv_cache_bytes(1119388000)"],
    ),
    "marker restating a bound the case lacks": (
        _case(markers='"requested_sglang_kv_tokens(2048)"'),
        ["marker requested_sglang_kv_tokens(2048) restates kv_bound.tokens, which the case does not set"],
    ),
    "launch value of the wrong kind": (
        _case(launch='max_model_len = "2048"'),
        ["extra.toml: [[case]] 'vllm_x'", "launch.max_model_len must be an integer for the dynamo arm, got '2048'",
         "write max_model_len = 1024"],
    ),
    "launch list of the wrong kind": (
        _case(launch='extra_args = "--enable-x"'),
        ["launch.extra_args must be a list of strings or numbers", """write extra_args = ["--flag", 1]"""],
    ),
    "unknown dynamo engine": (
        _case().replace('engine = "vllm"', 'engine = "vllmm"'),
        ["launch.engine 'vllmm' is not a dynamo engine"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("label", sorted(BAD_OPTIONS))
def test_bad_case_options_are_refused_and_change_nothing(seeded: Matrix, tmp_path: Path, label: str) -> None:
    text, needles = BAD_OPTIONS[label]
    assert_refused(seeded, ["catalog", "sync", *catalog_with(tmp_path, "extra.toml", text)], *needles)


def test_a_right_case_syncs(seeded: Matrix, tmp_path: Path) -> None:
    text = _case(markers='"requested_vllm_kv_cache_bytes(1119388000)"', launch="gpu_memory_utilization = 0.01")
    result = seeded("catalog", "sync", *catalog_with(tmp_path, "extra.toml", text))
    assert result.exit_code == 0, result.output
    assert "added  case     vllm_x" in result.output


def test_each_arm_reads_the_bound_in_the_unit_of_its_engine() -> None:
    assert check_case_options("reference", {}, {"bytes": 8}, []) == KvBound(bytes=8)
    assert check_case_options("sglang_native", {}, {"tokens": 64}, []) == KvBound(tokens=64)
    for arm, bound in (("reference", {"tokens": 8}), ("vllm_native", {"tokens": 8}), ("sglang_native", {"bytes": 8})):
        with pytest.raises(ConfigError, match="is not read by"):
            check_case_options(arm, {}, bound, [])
    with pytest.raises(ConfigError, match="is not read by dynamo's trtllm engine"):
        check_case_options("dynamo", {"engine": "trtllm"}, {"bytes": 8}, [])
    # The mocker has no cache: a bound in either unit only sizes the scheduler's estimate.
    assert check_case_options("dynamo", {}, {"tokens": 2048, "bytes": 8}, []) == KvBound(bytes=8, tokens=2048)


def test_the_one_table_gives_each_engine_its_flag() -> None:
    assert kv_arg({"bytes": 5}, "vllm") == ("--kv-cache-memory-bytes", 5)
    assert kv_arg({}, "vllm") is None and kv_arg({}, "vllm", 7) == ("--kv-cache-memory-bytes", 7)
    assert kv_arg({"tokens": 9}, "sglang") == ("--max-total-tokens", 9)
    assert kv_arg({"tokens": 9}, "trtllm") == ("TRTLLM_KV_MAX_TOKENS", 9)
    assert kv_arg({"bytes": 5}, "sglang") is None  # the sync check refuses that case before it gets here
    assert set(KV_FLAGS) >= {"reference", "vllm", "sglang", "trtllm"}


ROOT = Path(matrix.__file__).parent
# A read of a launch key: a field of the case's typed table (`case.launch.cpu`, `_launch(ctx).env`,
# `launch_as(case.launch, VllmNativeLaunch).cpu`), not a module path (`matrix.launch.arms`, `case_launch.py`).
_READ = re.compile(r"(?<!matrix\.)(?<!case_)(?:launch|_launch\([\w.]*\)|launch_as\([\w., ]*\))\.([a-z_]+)\b")
# A read of the raw table, which the typed one replaced: `launch.get("key")`, `launch["key"]`.
_RAW_READ = re.compile(r"""launch(?:\.get)?[(\[]\s*["']([a-z_]+)["']""")
# Which source files read launch keys for which arm (the arms reuse their engines' helpers).
_READERS = {
    "reference": ["reference.py"],
    "vllm_native": ["vllm_native.py"],
    "sglang_native": ["sglang_native.py", "sglang_server.py"],
    "dynamo": ["dynamo.py", "sglang_server.py", "sglang_sidecar.py", "vllm_sidecar.py", "sidecar.py"],
}


def _keys_read(*paths: Path, pattern: re.Pattern[str] = _READ) -> set[str]:
    return {key for path in paths for key in pattern.findall(path.read_text(encoding="utf-8"))}


def test_the_launch_key_tables_cover_every_key_the_code_reads() -> None:
    arms = ROOT / "launch" / "arms"
    assert set(_READERS) == set(LAUNCH_KEYS)
    for arm, files in _READERS.items():
        read = _keys_read(*(arms / name for name in files))
        assert read, arm  # the pattern still finds the reads
        assert read <= LAUNCH_KEYS[arm] | COMMON_LAUNCH_KEYS, (arm, read - LAUNCH_KEYS[arm])
    common = _keys_read(*(ROOT / "runner").glob("*.py"), ROOT / "launch" / "providers" / "container.py",
                        ROOT / "schedule" / "slots.py")
    assert common <= COMMON_LAUNCH_KEYS, common - COMMON_LAUNCH_KEYS
    # Nothing reads the raw table any more: the parsers alone see the TOML mapping.
    parsers = {ROOT / "case_launch.py", ROOT / "cells.py"}
    raw = {str(path.relative_to(ROOT)): keys for path in sorted(ROOT.rglob("*.py")) if path not in parsers
           if (keys := _keys_read(path, pattern=_RAW_READ))}  # fmt: skip
    assert not raw, f"raw launch-table reads (read the typed table's fields): {raw}"
    assert _RAW_READ.search('x = launch.get("cpu", False)') and _READ.findall("case.launch.cpu") == ["cpu"]
