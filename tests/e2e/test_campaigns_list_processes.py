"""`matrix campaigns` and `run --resume` against real `matrix` processes and a runner that really died."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.helpers.campaigns import add_campaign
from tests.helpers.cli import Matrix

pytestmark = pytest.mark.e2e


def test_resume_of_an_unknown_campaign_points_at_the_list(seeded: Matrix) -> None:
    result = seeded.subprocess("run", "--resume", "99")
    assert result.returncode == 2
    assert "no campaign 99" in result.stderr and "matrix campaigns list" in result.stderr


@pytest.mark.all_databases
def test_a_campaign_whose_runner_died_is_listed_as_interrupted(seeded: Matrix) -> None:
    """A SIGKILLed runner leaves its campaign `running` in the database; the list must not say so."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that was a runner and is gone
    gone = add_campaign(seeded, [("reference_disaggregated", 1, "pending")], status="running",
                        host=socket.gethostname(), owner_pid=dead.pid)  # fmt: skip
    live = add_campaign(seeded, [("reference_disaggregated", 1, "pending")], status="running",
                        host=socket.gethostname(), owner_pid=os.getppid())  # fmt: skip
    before = seeded.dump()
    rows = {r["id"]: r for r in json.loads(seeded("campaigns", "list", "--json").output)}
    assert (rows[gone]["status"], rows[live]["status"]) == ("interrupted", "running")
    assert seeded.dump() == before  # listing changes nothing; the next `matrix run` records it
