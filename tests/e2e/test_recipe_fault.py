"""A release whose engine refuses a dependency of OUR recipe at start-up ("NIXL >= 1.5.0 is required, but
nixl==1.4.1 is installed", vLLM 0.33.0 on a recipe pinning NIXL 1.4.1) is a recipe fault: the cell fails with
kind `recipe`, the gate says it is the recipe's fault and never calls it a regression, and compare says
`recipe fault`, not `regressed`. Real reference pairs through the ordinary run path: the workers print that
line and exit (fault `unmet-dependency`), and the runner's start-up classification decides.
"""

from __future__ import annotations

import json

from tests.helpers.cli import DATA, Matrix

CASE = """
[[case]]
name = "synth_pair"
backend = "synth"
arm = "reference"
model = "tiny"
markers = ["gpu_0", "e2e", "pre_merge"]
startup_timeout_s = 20
request_timeout_s = 10
launch = { lifecycle = false }

[[gate]]
name = "plain"
expression = "e2e"
rules = { regressions_block = true }
"""


def _runtime(version: str, fault: str = "") -> str:
    env = f', env = {{ MATRIX_REFERENCE_FAULTS = "{fault}" }}' if fault else ""
    return f'[[runtime]]\nbackend = "synth"\nversion = "{version}"\nprovider = {{ kind = "builtin"{env} }}\n'


def test_an_unmet_dependency_of_the_recipe_is_the_recipes_fault_never_a_regression(matrix: Matrix) -> None:
    catalog = matrix.home / "synth.toml"
    runtimes = _runtime("1.0.0") + _runtime("1.1.0", "unmet-dependency") + _runtime("1.2.0", "crash-at-start")
    catalog.write_text('[[backend]]\nname = "synth"\n' + runtimes + CASE)
    assert matrix("catalog", "sync", str(catalog), str(DATA / "markers.toml")).exit_code == 0
    run = matrix.subprocess("run", "--backend", "synth", "--no-report", "-q")
    assert run.returncode == 1, run.stdout + run.stderr
    rows = {str(v): (str(s), k, str(m)) for v, s, k, m in matrix.sql(
        "SELECT runtime.version, cell_run.status, cell_run.failure_kind, cell_run.message FROM cell_run "
        "JOIN runtime ON runtime.id = cell_run.runtime_id")}  # fmt: skip
    assert rows["1.0.0"][:2] == ("passed", None)
    status, kind, message = rows["1.1.0"]
    assert (status, kind) == ("failed", "recipe"), message
    assert message.startswith("recipe fault: an engine refused the environment the runtime's recipe built "
                              "(RuntimeError: NIXL >= 1.5.0 is required, but nixl==1.4.1 is installed)")  # fmt: skip
    # Any other crash at start-up stays the release's start-up failure (the control).
    assert rows["1.2.0"][:2] == ("failed", "startup")

    # 1.1.0 against 1.0.0 (it passed there): failed, the recipe's fault, no regression.
    gate = json.loads(matrix("gate", "synth", "1.1.0", "--policy", "plain", "--json").output)
    kinds = {r["kind"] for r in gate["reasons"]}
    assert gate["verdict"] == "NO-GO" and "failed" in kinds and "regression" not in kinds, gate
    assert any("the runtime's recipe, not the release" in r["message"] for r in gate["reasons"]), gate["reasons"]
    compared = json.loads(matrix("compare", "synth=1.0.0", "synth=1.1.0", "--json").output)
    assert [c["verdict"] for c in compared["cases"]] == ["recipe fault"]
    assert matrix("compare", "synth=1.0.0", "synth=1.1.0", "--fail-on", "regression").exit_code == 0
    assert matrix("compare", "synth=1.0.0", "synth=1.1.0", "--fail-on", "failure").exit_code == 1
    # The control: the same comparison with a plain start-up crash is a regression.
    assert [c["verdict"] for c in json.loads(matrix("compare", "synth=1.0.0", "synth=1.2.0", "--json").output)[
        "cases"]] == ["regressed"]  # fmt: skip
