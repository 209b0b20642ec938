"""venv recipes: parsing, the cache key, and the requirements_of filtering (pure, no network)."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import pytest

from matrix.errors import ConfigError
from matrix.launch.providers.recipe import (
    PipStep,
    RequirementsOfStep,
    check_provider,
    parse_venv,
    select_requirements,
    wheel_metadata,
)

DYNAMO = {
    "kind": "venv",
    "python": "3.11",
    "steps": [{"requirements_of": "ai-dynamo==1.6.1", "exclude": ["aisimulate"]}, ["--no-deps", "ai-dynamo==1.6.1"]],
}

# The shape of ai-dynamo 1.6.1's METADATA (trimmed): a broken dependency only for some Pythons, and extras.
METADATA = """\
Metadata-Version: 2.4
Name: ai-dynamo
Version: 1.6.1
Requires-Python: >=3.10
Requires-Dist: ai-dynamo-runtime==1.6.1
Requires-Dist: aiohttp<4.0,>=3.14.3
Requires-Dist: aisimulate==0.13.0; python_version >= '3.11' and python_version < '3.14'
Requires-Dist: tomli; python_version < '3.11'
Requires-Dist: pywin32; sys_platform == 'win32'
Requires-Dist: uvloop; sys_platform != 'win32' and platform_machine == 'x86_64'
Provides-Extra: vllm
Requires-Dist: vllm[flashinfer,otel]==0.31.0; extra == 'vllm'
Requires-Dist: tomli; (python_version < '3.11') and extra == 'sglang'
Requires-Dist: Typing_Extensions>=4.10.0

long description that mentions Requires-Dist: not-a-header
"""

LINUX_311 = {
    "implementation_name": "cpython",
    "implementation_version": "3.11.7",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_release": "6.1.0",
    "platform_system": "Linux",
    "platform_version": "#1 SMP",
    "python_full_version": "3.11.7",
    "platform_python_implementation": "CPython",
    "python_version": "3.11",
    "sys_platform": "linux",
}


def test_recipe_parses_into_steps() -> None:
    recipe = parse_venv(DYNAMO, "dynamo-1.6.1")
    assert recipe.python == "3.11"
    assert recipe.steps == (
        RequirementsOfStep("ai-dynamo==1.6.1", ("aisimulate",)),
        PipStep(("--no-deps", "ai-dynamo==1.6.1")),
    )
    assert recipe.summary() == (
        "requirements of ai-dynamo==1.6.1 without aisimulate; pip install --no-deps ai-dynamo==1.6.1"
    )


def test_key_is_stable_and_a_sha256() -> None:
    one = parse_venv(DYNAMO, "a").key("3.11", "linux-x86_64")
    two = parse_venv(dict(DYNAMO), "b").key("3.11", "linux-x86_64")
    assert one == two
    assert len(one) == 64 and int(one, 16) >= 0


def test_key_ignores_spelling_that_does_not_change_the_build() -> None:
    base = parse_venv(DYNAMO, "a").key("3.11", "linux-x86_64")
    reordered = {
        "steps": [
            {"exclude": ["AISimulate"], "requirements_of": "ai-dynamo==1.6.1"},
            ["--no-deps", "ai-dynamo==1.6.1"],
        ],
        "python": "3.11",
        "kind": "venv",
    }
    assert parse_venv(reordered, "a").key("3.11", "linux-x86_64") == base
    # The interpreter is keyed by the major.minor it resolves to, not by how the recipe spells it.
    assert parse_venv({**DYNAMO, "python": "/usr/bin/python3.11"}, "a").key("3.11", "linux-x86_64") == base


@pytest.mark.parametrize(
    "change",
    [
        {"steps": [["ai-dynamo-runtime==1.6.1"], ["--no-deps", "ai-dynamo==1.6.1"]]},
        {"steps": [{"requirements_of": "ai-dynamo==1.6.1"}, ["--no-deps", "ai-dynamo==1.6.1"]]},
        {
            "steps": [
                ["--no-deps", "ai-dynamo==1.6.1"],
                {"requirements_of": "ai-dynamo==1.6.1", "exclude": ["aisimulate"]},
            ]
        },
    ],
)
def test_key_changes_with_the_recipe(change: dict[str, Any]) -> None:
    base = parse_venv(DYNAMO, "a").key("3.11", "linux-x86_64")
    assert parse_venv({**DYNAMO, **change}, "a").key("3.11", "linux-x86_64") != base


def test_key_changes_with_python_and_platform() -> None:
    recipe = parse_venv(DYNAMO, "a")
    keys = {
        recipe.key("3.11", "linux-x86_64"),
        recipe.key("3.12", "linux-x86_64"),
        recipe.key("3.11", "linux-aarch64"),
    }
    assert len(keys) == 3


def test_requirements_of_keeps_what_holds_for_the_interpreter() -> None:
    selected = select_requirements(METADATA, LINUX_311, exclude=["aisimulate"])
    assert selected.install == (
        "ai-dynamo-runtime==1.6.1",
        "aiohttp<4.0,>=3.14.3",
        "uvloop",
        "Typing_Extensions>=4.10.0",
    )
    skipped = dict(selected.skipped)
    assert skipped["aisimulate==0.13.0; python_version >= '3.11' and python_version < '3.14'"] == "excluded"
    assert skipped["tomli; python_version < '3.11'"] == "marker does not hold"
    assert skipped["pywin32; sys_platform == 'win32'"] == "marker does not hold"
    assert skipped["vllm[flashinfer,otel]==0.31.0; extra == 'vllm'"] == "marker does not hold"


def test_requirements_of_evaluates_markers_for_the_target_interpreter_not_ours() -> None:
    python_310_arm = {
        **LINUX_311,
        "python_version": "3.10",
        "python_full_version": "3.10.4",
        "platform_machine": "aarch64",
    }
    selected = select_requirements(METADATA, python_310_arm)
    assert "tomli" in selected.install  # needed on 3.10 only
    assert "uvloop" not in selected.install  # x86_64 only
    # aisimulate's marker does not hold on 3.10, so it is skipped even without an exclusion.
    assert not any(r.startswith("aisimulate") for r in selected.install)


def test_exclusions_compare_canonical_names() -> None:
    selected = select_requirements(METADATA, LINUX_311, exclude=["AISimulate", "typing.extensions", "AIOHTTP"])
    assert selected.install == ("ai-dynamo-runtime==1.6.1", "uvloop")


def test_requirements_of_without_requirements() -> None:
    assert select_requirements("Metadata-Version: 2.1\nName: x\nVersion: 1\n", LINUX_311).install == ()


def test_unparseable_requirement_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unparseable Requires-Dist"):
        select_requirements("Name: x\nRequires-Dist: ==broken\n", LINUX_311)


def test_wheel_metadata_reads_the_dist_info(tmp_path: Path) -> None:
    wheel = tmp_path / "ai_dynamo-1.6.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("dynamo/__init__.py", "")
        archive.writestr("ai_dynamo-1.6.1.dist-info/METADATA", METADATA)
        archive.writestr("ai_dynamo-1.6.1.dist-info/RECORD", "")
    assert wheel_metadata(wheel) == METADATA


@pytest.mark.parametrize(
    ("provider", "message"),
    [
        ({"kind": "venv"}, "a venv provider needs steps"),
        ({"kind": "venv", "steps": []}, "a venv provider needs steps"),
        ({"kind": "venv", "steps": ["six"]}, r"steps\[0\] must be a list of pip arguments"),
        ({"kind": "venv", "steps": [[]]}, r"steps\[0\] must be a non-empty list"),
        ({"kind": "venv", "steps": [{"requirements_of": "x==1", "extras": []}]}, "unknown key"),
        ({"kind": "venv", "steps": [{"exclude": ["x"]}]}, "needs requirements_of"),
        ({"kind": "venv", "steps": [{"requirements_of": "==1"}]}, "is not a requirement"),
        ({"kind": "venv", "steps": [["six"]], "image": "x"}, r"unknown key\(s\) image for kind 'venv'"),
        ({"kind": "venv", "steps": [["six"]], "env": {"A": 1}}, "env must be a table of strings"),
        ({"kind": "host", "pythonpath": "/x"}, "pythonpath must be a list of strings"),
        ({"kind": "container"}, "needs an image"),
        ({"kind": "container", "image": "x", "engine": "lxc"}, "engine 'lxc' is not one of docker, podman"),
        ({"kind": "container", "image": "x", "ipc": "shareable"}, "ipc 'shareable'"),
        ({"kind": "cloud"}, "unknown kind 'cloud'"),
    ],
)
def test_check_provider_names_the_problem(provider: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        check_provider(provider, "dynamo-1.6.1")
    assert str(info.value).startswith("provider of runtime dynamo-1.6.1: ")


def test_check_provider_accepts_the_documented_shapes() -> None:
    check_provider(DYNAMO, "dynamo-1.6.1")
    check_provider({"kind": "host", "python": "/opt/py/bin/python", "env": {"A": "1"}, "pythonpath": ["/x"]}, "h")
    check_provider({"kind": "container", "image": "nvcr.io/x:1", "engine": "podman", "ipc": "host"}, "c")
    check_provider({"kind": "builtin"}, "b")
    check_provider({}, "default host")


def test_requirements_of_with_resolves_more_requirements_in_the_same_step() -> None:
    step_text = {"requirements_of": "sglang==0.5.21", "exclude": ["cuda-tile"], "with": ["ai-dynamo-runtime==1.6.1"]}
    recipe = parse_venv({"kind": "venv", "steps": [step_text]}, "sglang-0.5.21")
    (step,) = recipe.steps
    assert isinstance(step, RequirementsOfStep) and step.also == ("ai-dynamo-runtime==1.6.1",)
    assert step.describe() == "requirements of sglang==0.5.21 without cuda-tile with ai-dynamo-runtime==1.6.1"
    assert step.canonical()["with"] == ["ai-dynamo-runtime==1.6.1"]
    # Without `with` the canonical form (and so every existing environment's key) is what it was.
    assert parse_venv(DYNAMO, "a").steps[0].canonical() == {"requirements_of": "ai-dynamo==1.6.1",
                                                             "exclude": ["aisimulate"]}  # fmt: skip
    with pytest.raises(ConfigError, match=r"with 'not a req!' is not a requirement"):
        parse_venv({"kind": "venv", "steps": [{"requirements_of": "x==1", "with": ["not a req!"]}]}, "x")
    with pytest.raises(ConfigError, match=r"steps\[0\]\.with must be a list of strings"):
        parse_venv({"kind": "venv", "steps": [{"requirements_of": "x==1", "with": "y==2"}]}, "x")
