"""The wheelhouse lock resolved with its independent uv resolutions at once gives exactly the step-by-step
lock (real uv against the real index, small recipes): the plans that the manifest and each pylock.toml are
written from are equal, including a `--no-deps` step that an earlier step's pin changes."""

from __future__ import annotations

import pytest

from matrix.cells import RuntimeInfo
from matrix.launch.providers.wheelresolve import plan_runtimes
from matrix.launch.providers.wheeltarget import WheelTarget

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

RECIPES = {
    "1.0": {
        "kind": "venv",
        "steps": [
            ["six==1.16.0"],
            {"requirements_of": "requests==2.32.3", "exclude": ["urllib3"], "with": ["idna==3.10"]},
            ["--no-deps", "requests==2.32.3"],
            {"extract": "six==1.16.0", "member": "six.py"},
        ],
    },
    # The --no-deps step alone would take the newest idna; the first step's pin keeps 3.7.
    "2.0": {"kind": "venv", "steps": [["idna==3.7"], ["--no-deps", "idna"], ["--no-deps", "six==1.16.0"]]},
}


def test_concurrent_lock_equals_the_step_by_step_lock() -> None:
    runtimes = [RuntimeInfo(backend="toy", version=v, tag=f"v{v}", provider=p) for v, p in RECIPES.items()]
    target = WheelTarget.of("3.12", ["manylinux_2_39_x86_64"])
    lines: list[str] = []
    one_by_one = plan_runtimes(runtimes, target, ["certifi"], lines.append, workers=1)
    at_once = plan_runtimes(runtimes, target, ["certifi"], lines.append)
    assert at_once == one_by_one
    pinned = at_once[1].steps[1].install
    assert [(r.canonical, r.version) for r in pinned] == [] and at_once[1].steps[0].install[0].version == "3.7"
    assert [r.canonical for r in at_once[0].steps[2].install] == ["requests"]
    assert at_once[0].excluded == ["certifi"]
