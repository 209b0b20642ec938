"""The host provider: component versions looked up in a real interpreter and on PATH, compared with the
catalog's (PEP 440 equality, local labels exact)."""

from __future__ import annotations

import os
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from matrix.cells import RuntimeInfo
from matrix.launch.providers import Environment, Mismatch, Unavailable, prepare
from matrix.launch.providers import components as components_module
from matrix.launch.providers.components import Detected, mismatches, same_version, version_in_text

CLICK = version("click")


def _runtime(components: dict[str, str], **provider: Any) -> RuntimeInfo:
    return RuntimeInfo(
        backend="vllm", version="0.30.0", tag="v0.30.0", provider={"kind": "host", **provider}, components=components
    )


def _tool(directory: Path, name: str, output: str, *, sleep: float = 0) -> Path:
    """An executable that prints `output` for --version."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / name
    script.write_text(f"#!/bin/sh\n{'sleep ' + str(sleep) if sleep else ''}\necho '{output}'\n")
    script.chmod(0o755)
    return script


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory first on PATH for this test."""
    directory = tmp_path / "bin"
    directory.mkdir()
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")
    return directory


def test_installed_distribution_at_the_catalog_version_passes() -> None:
    environment = prepare(_runtime({"click": CLICK}))
    assert isinstance(environment, Environment)
    assert environment.python == sys.executable
    assert environment.components == {"click": CLICK}


def test_wrong_version_fails_with_the_exact_message() -> None:
    environment = prepare(_runtime({"click": "0.0.1"}))
    assert isinstance(environment, Mismatch)
    assert environment.reason == f"runtime says click 0.0.1, host has {CLICK}"


def test_absent_component_says_so() -> None:
    environment = prepare(_runtime({"click": CLICK, "vllm-rs-not-installed-here": "0.30.0"}))
    assert isinstance(environment, Mismatch)
    assert environment.reason == "host has no vllm-rs-not-installed-here"


def test_several_problems_are_all_reported_in_catalog_order() -> None:
    environment = prepare(_runtime({"no-such-dist-a": "1.0", "click": "0.0.1"}))
    assert isinstance(environment, Mismatch)
    assert environment.reason == f"host has no no-such-dist-a; runtime says click 0.0.1, host has {CLICK}"


def test_distribution_names_are_matched_normalised() -> None:
    # "Click" and "click" are the same distribution; so are "typing_extensions" and "typing-extensions".
    environment = prepare(_runtime({"Click": CLICK}))
    assert isinstance(environment, Environment)


def test_executable_component_answers_version(bin_dir: Path) -> None:
    _tool(bin_dir, "mytool", "tool 1.2.3")
    assert isinstance(prepare(_runtime({"mytool": "1.2.3"})), Environment)
    environment = prepare(_runtime({"mytool": "1.2.4"}))
    assert isinstance(environment, Mismatch)
    assert environment.reason == "runtime says mytool 1.2.4, host has 1.2.3"


def test_local_version_label_must_match_exactly(bin_dir: Path) -> None:
    _tool(bin_dir, "vllm-rs", "vllm-rs 0.29.1rc1.dev347+gdee37d891")
    assert isinstance(prepare(_runtime({"vllm-rs": "0.29.1rc1.dev347+gdee37d891"})), Environment)
    without_label = prepare(_runtime({"vllm-rs": "0.29.1rc1.dev347"}))
    assert isinstance(without_label, Mismatch)
    assert without_label.reason == "runtime says vllm-rs 0.29.1rc1.dev347, host has 0.29.1rc1.dev347+gdee37d891"
    other_build = prepare(_runtime({"vllm-rs": "0.29.1rc1.dev347+gabc"}))
    assert isinstance(other_build, Mismatch)


def test_executable_without_a_version_in_its_output(bin_dir: Path) -> None:
    _tool(bin_dir, "quiet", "no numbers here")
    environment = prepare(_runtime({"quiet": "1.0"}))
    assert isinstance(environment, Mismatch)
    assert environment.reason == "runtime says quiet 1.0, but `quiet --version` printed no version ('no numbers here')"


def test_executable_that_hangs_is_cut_off(bin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(components_module, "EXECUTABLE_TIMEOUT_S", 0.3)
    _tool(bin_dir, "slow", "slow 1.0", sleep=5)
    environment = prepare(_runtime({"slow": "1.0"}))
    assert isinstance(environment, Mismatch)
    assert "`slow --version` did not answer within" in environment.reason


def test_provider_path_and_pythonpath_are_what_lookups_see(tmp_path: Path) -> None:
    # A distribution visible only through the provider's pythonpath, a tool only on the provider's PATH.
    site = tmp_path / "site"
    info = site / "fakepkg-2.5.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg\nVersion: 2.5\n")
    tools = tmp_path / "tools"
    _tool(tools, "sidecar", "sidecar version 0.5.19")
    runtime = _runtime(
        {"fakepkg": "2.5", "sidecar": "0.5.19"},
        pythonpath=[str(site)],
        env={"PATH": f"{tools}{os.pathsep}{os.environ['PATH']}", "EXTRA": "1"},
    )
    environment = prepare(runtime)
    assert isinstance(environment, Environment), environment
    assert environment.components == {"fakepkg": "2.5", "sidecar": "0.5.19"}
    assert environment.env["PYTHONPATH"].split(os.pathsep)[0] == str(site)
    assert environment.env["EXTRA"] == "1"


def test_given_interpreter_is_used_and_put_first_on_path() -> None:
    environment = prepare(_runtime({"click": CLICK}, python=sys.executable))
    assert isinstance(environment, Environment)
    assert environment.python == sys.executable
    assert environment.env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)


def test_missing_interpreter_is_a_skip_not_a_failure(tmp_path: Path) -> None:
    environment = prepare(_runtime({"click": CLICK}, python=str(tmp_path / "no-python")))
    assert type(environment) is Unavailable
    assert environment.reason == f"interpreter {tmp_path / 'no-python'} of runtime vllm-0.30.0 is not on this host"


def test_broken_interpreter_is_a_skip_with_its_error(tmp_path: Path) -> None:
    broken = _tool(tmp_path, "python", "x")
    broken.write_text("#!/bin/sh\necho boom >&2\nexit 3\n")
    environment = prepare(_runtime({"click": CLICK}, python=str(broken)))
    assert type(environment) is Unavailable
    assert "this interpreter does not run (exit 3: boom)" in environment.reason


def test_invalid_provider_entry_is_a_config_failure() -> None:
    environment = prepare(_runtime({}, interpreter="/usr/bin/python3"))
    assert isinstance(environment, Mismatch)
    assert "unknown key(s) interpreter for kind 'host'" in environment.reason


def test_runtime_without_components_needs_no_lookup() -> None:
    environment = prepare(_runtime({}))
    assert isinstance(environment, Environment) and environment.components == {}


def test_builtin_provider_is_unchanged() -> None:
    runtime = RuntimeInfo(backend="reference", version="0.1.0", tag="v0.1.0", provider={"kind": "builtin"})
    environment = prepare(runtime)
    assert isinstance(environment, Environment) and "matrix-reference" in environment.components


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tool 1.2.3", "1.2.3"),
        ("Docker version 24.0.7, build afdd53b", "24.0.7"),
        ("vllm-rs 0.29.1rc1.dev347+gdee37d891", "0.29.1rc1.dev347+gdee37d891"),
        ("mytool version 1.2.3.", "1.2.3"),
        ("tool (build 42) 1.2.3", "1.2.3"),
        ("tool v2.0", "2.0"),
        ("running on x86_64, release 7", "7"),
        ("no version", None),
        ("", None),
    ],
)
def test_version_in_text(text: str, expected: str | None) -> None:
    assert version_in_text(text) == expected


@pytest.mark.parametrize(
    ("expected", "found", "same"),
    [
        ("0.30.0", "0.30.0", True),
        ("0.30", "0.30.0", True),
        ("1.3.0rc27", "1.3.0-rc.27", True),
        ("0.29.1rc1.dev347+gdee37d891", "0.29.1rc1.dev347+GDEE37D891", True),
        ("0.29.1rc1.dev347+gdee37d891", "0.29.1rc1.dev347", False),
        ("0.29.0", "0.29.1rc0", False),
        ("not-pep440", "not-pep440", True),
    ],
)
def test_same_version(expected: str, found: str, same: bool) -> None:
    assert same_version(expected, found) is same


def test_mismatch_sentences_name_where() -> None:
    detected = Detected({"a": "1.0"})
    assert mismatches({"a": "2.0", "b": "1"}, detected, "venv") == ["runtime says a 2.0, venv has 1.0", "venv has no b"]
