"""Without scipy, in a fresh interpreter: the perf comparison names the extra to install."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_without_scipy_the_message_names_the_extra() -> None:
    """scipy blocked from import (as on a base install): a MatrixError (exit 2) naming the install command."""
    code = (
        "import sys; sys.modules['scipy'] = None\n"
        "from matrix.report.stats import compare_samples, StatsMissingError\n"
        "try:\n    compare_samples('request_s', [1.0, 2.0], [1.0, 2.0])\n"
        "except StatsMissingError as exc:\n    print(exc.exit_code, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("2 ") and "pip install 'disagg-matrix[stats]'" in out
