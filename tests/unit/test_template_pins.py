"""`pins` of a backend's runtime_template: a per-release pin ("from 0.33.0 on, nixl 1.5.0"), checked at sync."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from matrix.catalog.template import check_template, render
from matrix.errors import ConfigError
from tests.helpers.cli import Matrix


def _template(pins: Any) -> dict[str, Any]:
    return {
        "package": "vllm",
        "provider": {"kind": "venv", "steps": [
            ["vllm=={version}"], ["--no-deps", "nixl==1.4.1", "nixl-cu13==1.4.1"],
            {"requirements_of": "ai-dynamo==1.6.1", "with": ["nixl==1.4.1"]},
        ]},
        "components": {"vllm": "{version}", "nixl": "1.4.1"},
        "pins": pins,
    }  # fmt: skip


def test_pins_apply_from_their_version_on_and_the_later_rule_wins() -> None:
    template = check_template(_template([
        {"since": "0.40.0", "set": ["nixl==1.6.0"]},
        {"since": "0.33.0", "set": ["nixl==1.5.0", "nixl-cu13==1.5.0"]},
    ]), "test")  # fmt: skip
    steps = {v: render(template, v, "test")[0]["steps"] for v in ("0.32.9", "0.33.0", "0.33.1rc1", "0.41.0")}
    assert steps["0.32.9"][1] == ["--no-deps", "nixl==1.4.1", "nixl-cu13==1.4.1"]
    assert steps["0.33.0"][1] == ["--no-deps", "nixl==1.5.0", "nixl-cu13==1.5.0"]
    assert steps["0.33.1rc1"][2] == {"requirements_of": "ai-dynamo==1.6.1", "with": ["nixl==1.5.0"]}
    assert steps["0.41.0"][1] == ["--no-deps", "nixl==1.6.0", "nixl-cu13==1.5.0"]
    assert render(template, "0.41.0", "test")[1] == {"vllm": "0.41.0", "nixl": "1.6.0"}
    assert render(template, "0.32.0", "test")[1] == {"vllm": "0.32.0", "nixl": "1.4.1"}


@pytest.mark.parametrize(("pins", "says"), [
    ({"since": "0.33.0"}, "must be a list of tables"),
    (["nixl==1.5.0"], "must be a table"),
    ([{"since": "0.33.0"}], "missing set"),
    ([{"since": "0.33.0", "set": ["nixl==1.5.0"], "until": "0.40"}], "unknown key(s) until"),
    ([{"since": "not a version", "set": ["nixl==1.5.0"]}], "is not a PEP 440 version"),
    ([{"since": "0.33.0", "set": []}], "non-empty list"),
    ([{"since": "0.33.0", "set": ["nixl>=1.5.0"]}], "must be name==version"),
    ([{"since": "0.33.0", "set": ["nixl-cu12==1.5.0"]}], "pins nixl-cu12, which no step of the template installs"),
    ([{"since": "0.33.0", "set": ["nixl==1.5.0"]}, {"since": "0.33", "set": ["nixl==1.5.1"]}], "same since"),
])  # fmt: skip
def test_a_bad_pin_is_refused_naming_it(pins: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=None) as caught:
        check_template(_template(pins), "backends.toml: backend vllm")
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_catalog_sync_refuses_a_bad_pin_and_changes_nothing(matrix: Matrix, tmp_path: Path) -> None:
    backends = tmp_path / "backends.toml"
    backends.write_text(
        '[[backend]]\nname = "vllm"\nruntime_template = { package = "vllm", provider = { kind = "venv", steps = [\n'
        '  ["vllm=={version}", "nixl==1.4.1"],\n] }, pins = [\n'
        '  { since = "0.33.0", set = ["nixl-cu13==1.5.0"] },\n] }\n'
    )
    before = matrix.dump()
    result = matrix("catalog", "sync", str(backends))
    assert result.exit_code == 2, result.output
    assert "pins nixl-cu13, which no step of the template installs; pin one of: nixl, vllm" in result.output
    assert matrix.dump() == before
