"""[M28] item 4: every KV fault class has fast controls on the reference server for each check that caught it
in a real engine; the controls named are real tests of the fast suite that plant the named fault."""

from __future__ import annotations

import re
from pathlib import Path

from matrix.kv_faults import CLASSES
from matrix.reference.faults import FAULTS
from tests.helpers.kv_fault_cases import REFERENCE_CONTROLS

ROOT = Path(__file__).resolve().parents[2]


def _module_texts(path: Path) -> str:
    """A test module's text and that of the tests.helpers modules it imports (where a catalog may plant it)."""
    text = path.read_text()
    helpers = re.findall(r"^from tests\.helpers\.(\w+) import", text, flags=re.MULTILINE)
    return "\n".join([text, *((ROOT / "tests" / "helpers" / f"{name}.py").read_text() for name in helpers)])


def _test_exists(node: str) -> Path:
    path, _, name = node.partition("::")
    module = ROOT / path
    assert module.is_file(), node
    assert re.search(rf"^def {re.escape(name)}\(", module.read_text(), flags=re.MULTILINE), node
    return module


def test_every_class_has_a_control_for_each_check_that_caught_it() -> None:
    assert set(REFERENCE_CONTROLS) == set(CLASSES)
    assert all(REFERENCE_CONTROLS.values())


def test_each_control_plants_a_reference_fault_in_a_fast_test_that_names_its_check() -> None:
    for controls in REFERENCE_CONTROLS.values():
        for control in controls:
            assert control.fault in FAULTS, control
            positive, negative = _test_exists(control.positive), _test_exists(control.negative)
            texts = _module_texts(positive)
            assert control.fault in texts, control
            assert control.check in texts, control  # asserted by name
            # In the fast suite: not a module of the engine suite.
            assert "pytest.mark.engines" not in positive.read_text() + negative.read_text(), control
