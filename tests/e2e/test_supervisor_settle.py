"""Readiness waits for a line a process announced (`LogSettle`): Dynamo's frontend answered its /health probe
while its prefill router was still being activated, and a request in between got 503. Real processes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from matrix.launch.launch_plan import LogSettle, ProcessSpec
from matrix.launch.supervisor import Supervisor
from tests.helpers.supervisor import engine, make_plan

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

SETTLE = LogSettle(r"activating prefill router", r"Prefill router target activated", wait_s=1.0)


def announcer(settled_after_s: float | None, stamp: Path) -> ProcessSpec:
    """A process that announces an activation at once and logs it done `settled_after_s` later (never: None),
    writing the moment it did to `stamp`."""
    code = ("import sys, time; print('registering and activating prefill router', flush=True); "
            + (f"time.sleep({settled_after_s}); open({str(stamp)!r}, 'w').write(repr(time.time())); "
               "print('Prefill router target activated', flush=True); " if settled_after_s is not None else "")
            + "time.sleep(60)")  # fmt: skip
    return ProcessSpec(role="frontend", argv=(sys.executable, "-c", code), settles=(SETTLE,))


def test_ready_waits_for_the_announced_line(tmp_path: Path, ports: list[int]) -> None:
    stamp = tmp_path / "settled"
    # The engine's probe passes after 0.3 s, long after the announcement; the activation takes 0.6 s.
    plan = make_plan((announcer(0.6, stamp), engine("decode", ports[1], "--delay", "0.3")), ports)
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        result = sup.wait_ready()
        noticed = time.time()
        assert result.ok, result.message
        assert stamp.exists() and noticed >= float(stamp.read_text())
        assert sup.teardown().clean


def test_a_line_that_never_comes_delays_ready_by_its_bound_only(tmp_path: Path, ports: list[int]) -> None:
    plan = make_plan((announcer(None, tmp_path / "never"), engine("decode", ports[1])), ports)
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        result = sup.wait_ready()
        assert result.ok, result.message
        # Ready once the wait ran out (1 s after the announcement), well inside the 10 s start-up budget.
        assert SETTLE.wait_s <= result.ready_s < 10, result.ready_s
        assert sup.teardown().clean
