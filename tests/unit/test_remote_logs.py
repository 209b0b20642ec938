"""The logs a remote (Ray) cell sends back: tails within caps, recreated on the driver, never outside; and
the scratch directory a killed remote cell left behind."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from matrix.executors import remote
from matrix.executors.remote import collect_logs, write_logs


def test_small_logs_come_back_whole_and_large_ones_as_their_tail(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "prefill.log").write_bytes(b"ready\n")
    (logs / "decode.log").write_bytes(b"x" * (remote.LOG_FILE_CAP_BYTES + 10) + b"LAST LINE\n")
    collected, truncated = collect_logs(logs)
    assert collected["prefill.log"] == b"ready\n"
    assert len(collected["decode.log"]) == remote.LOG_FILE_CAP_BYTES
    assert collected["decode.log"].endswith(b"LAST LINE\n")
    assert truncated == ("decode.log",)

    driver_side = tmp_path / "driver" / "cell"
    write_logs(driver_side, collected, truncated)
    assert (driver_side / "prefill.log").read_bytes() == b"ready\n"
    decode = (driver_side / "decode.log").read_bytes()
    assert decode.startswith(b"[matrix: earlier output cut") and decode.endswith(b"LAST LINE\n")


def test_the_total_cap_bounds_what_a_cell_sends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "LOG_TOTAL_CAP_BYTES", 100)
    for name in ("a.log", "b.log", "c.log"):
        (tmp_path / name).write_bytes(b"y" * 60)
    collected, truncated = collect_logs(tmp_path)
    assert sum(len(content) for content in collected.values()) == 100
    assert truncated == ("b.log", "c.log")


def test_a_missing_log_directory_sends_nothing(tmp_path: Path) -> None:
    assert collect_logs(tmp_path / "never-created") == ({}, ())


def test_names_that_leave_the_cell_directory_are_not_written(tmp_path: Path) -> None:
    cell = tmp_path / "runs" / "cell"
    write_logs(cell, {"../../escaped.log": b"hostile", "/abs.log": b"hostile", "ok.log": b"fine"}, ())
    assert (cell / "ok.log").read_bytes() == b"fine"
    assert not (tmp_path / "escaped.log").exists() and not Path("/abs.log").exists()


def test_a_killed_remote_cells_scratch_is_swept_by_the_next_one(tmp_path: Path) -> None:
    """A Ray worker killed mid-cell never removes its scratch directory; the next remote cell on the node
    removes every one whose owner is gone, and nothing else."""
    me = psutil.Process()

    def scratch(name: str, owner: object) -> Path:
        directory = tmp_path / name
        (directory / "logs").mkdir(parents=True)
        if owner is not None:
            (directory / remote.SCRATCH_OWNER).write_text(owner if isinstance(owner, str) else json.dumps(owner))
        return directory

    live = scratch("matrix-c1-live", {"pid": me.pid, "started": me.create_time()})
    dead = scratch("matrix-c2-dead", {"pid": 2**22 + 7, "started": 1.0})  # above any pid_max: never a process
    reused = scratch("matrix-c3-reused", {"pid": me.pid, "started": me.create_time() - 3600})
    foreign = scratch("matrix-ports-0", None)
    garbled = scratch("matrix-c4-garbled", "{not json")
    assert sorted(remote.sweep_orphan_scratch(tmp_path)) == sorted([dead, reused])
    assert live.is_dir() and foreign.is_dir() and garbled.is_dir()
    assert not dead.exists() and not reused.exists()
