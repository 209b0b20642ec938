"""The validator in a real `python -O` process: its checks do not rely on assert."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


def test_runs_under_python_dash_O() -> None:
    """The checks must not depend on assert statements (stripped by -O)."""
    import subprocess
    import sys

    code = "from matrix.check.validate import validate_chat_response as v\nr = v(200, b'{}')\nprint(len(r.failures))\n"
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "3"  # one_choice, usage_object, worker_ids_present
