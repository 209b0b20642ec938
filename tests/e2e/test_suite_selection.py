"""Plain `pytest` is the fast suite; `pytest -m engines` is exactly the suite that builds real engines.

A newcomer's `pytest` must not download GiBs of engines, and CI's engine run must not miss one.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.cli import REPO

# Modules that provision engines from PyPI (Dynamo releases, vLLM CPU builds).
ENGINE_MODULES = {
    "tests/e2e/test_dynamo_mocker.py", "tests/e2e/test_dynamo_mocker_topology.py", "tests/e2e/test_dynamo_nightly.py",
    "tests/e2e/test_dynamo_skew.py", "tests/e2e/test_installer_equivalence.py",
    "tests/e2e/test_kv_faults_vllm_cpu.py", "tests/e2e/test_vllm_cpu.py", "tests/e2e/test_vllm_rs_reverse_variant.py",
    "tests/e2e/test_vllm_skew.py", "tests/e2e/test_vllm_topology_cpu.py", "tests/e2e/test_vllm_traffic.py",
    "tests/e2e/test_vllm_peer_loss_cpu.py",
}  # fmt: skip


def _collected(*args: str) -> set[str]:
    result = subprocess.run(
        # -n 0: the listing in this process (pytest-xdist's workers would collect without printing the ids).
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-n", "0", *args],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {line.split("::")[0] for line in result.stdout.splitlines() if "::" in line}


def test_plain_pytest_leaves_the_engines_out_and_keeps_the_rest() -> None:
    modules = _collected()
    assert not modules & ENGINE_MODULES
    assert "tests/browser/test_report_browser.py" in modules
    assert "tests/e2e/test_run_reference.py" in modules


def test_the_engine_marker_selects_exactly_the_engine_modules() -> None:
    assert _collected("-m", "engines") == ENGINE_MODULES


def _browser_tests_without_chromium(ci: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["MATRIX_TEST_CHROMIUM"] = "none"  # as on a host without Chromium
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0",  # one test: no workers to start
         "tests/browser/test_report_browser.py::test_the_harness_sees_console_errors_and_external_requests"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip


def test_a_missing_chromium_is_a_skip_with_its_reason_locally() -> None:
    result = _browser_tests_without_chromium(None)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "SKIPPED" in result.stdout and "chromium is not installed" in result.stdout  # in the summary
    assert "1 skipped" in result.stdout


def test_a_missing_chromium_fails_in_ci() -> None:
    result = _browser_tests_without_chromium("true")
    assert result.returncode == 1, result.stdout[-3000:]
    assert "CI needs the browser tests: chromium is not installed" in result.stdout
