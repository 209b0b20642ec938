"""[M30] item 2: real reference campaigns post a failure episode's opening and closing to a real HTTP receiver
on 127.0.0.1, once each, whatever repeats, reruns and imports come between; a failing or slow receiver changes
no verdict and no exit code, and what it missed goes out on a later run, once."""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers import toggled_cells as toggled
from tests.helpers.cli import Matrix
from tests.helpers.webhook import Receiver, webhook

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# One reference cell; `broken` plants a missing usage object, which fails the `usage_object` check.
def _sync(m: Matrix, *, broken: bool) -> None:
    toggled.sync(m, toggled.case("ref_notify", broken=broken))


def _run(m: Matrix, *args: str, code: int) -> str:
    result = m.subprocess("run", "--case", "ref_notify", "--no-report", "-q", *args)
    assert result.returncode == code, result.stdout + result.stderr
    return result.stdout


def _notify_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("notify: ")]
    assert len(lines) == 1, stdout
    return lines[0]


@pytest.mark.all_databases
def test_an_episode_posts_its_opening_once_and_its_closing_once(
    matrix: Matrix, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    _sync(matrix, broken=True)
    with webhook() as receiver:
        first = _notify_line(_run(matrix, "--notify", receiver.url, code=1))
        assert first.startswith("notify: 1 event(s) posted to http://127.0.0.1:") and "s3cretpath" not in first
        assert receiver.events() == [("opened", "ref_notify")]
        opened = receiver.posts[0].body
        assert opened["text"].startswith("OPENED ref_notify on reference-0.1.0: failed (validation): usage_object")
        assert receiver.posts[0].headers["Idempotency-Key"] == opened["idempotency_key"]

        # The setting from the environment; a repeat and a rerun of the failure: the same episode, nothing new.
        monkeypatch.setenv("MATRIX_NOTIFY_URL", receiver.url)
        assert _notify_line(_run(matrix, "--repeat", "2", code=1)).startswith("notify: 0 event(s) posted")
        _run(matrix, "--rerun-failed", code=1)
        monkeypatch.delenv("MATRIX_NOTIFY_URL")

        # An import of another host's failing shard of the same cell: still the same episode.
        shard = Matrix(home=tmp_path_factory.mktemp("shard"), db_path=tmp_path_factory.mktemp("shard-db") / "m.db")
        _sync(shard, broken=True)
        results = shard.home / "results.json"
        ran = shard.subprocess("run", "--case", "ref_notify", "--no-report", "-q", "--results-out", str(results),
                               "--campaign-key", "notify-shard")  # fmt: skip
        assert ran.returncode == 1, ran.stdout + ran.stderr
        imported = matrix.subprocess("import", str(results))
        assert imported.returncode == 0, imported.stdout + imported.stderr
        last = max(int(str(row[0])) for row in matrix.sql("SELECT id FROM campaign"))
        assert "0 event(s) posted" in matrix("notify", "--url", receiver.url, "--campaign", str(last)).output
        assert receiver.events() == [("opened", "ref_notify")]

        # The fix: the pass closes the episode, posted once, naming the pass and every failure it saw.
        _sync(matrix, broken=False)
        assert _notify_line(_run(matrix, "--notify", receiver.url, code=0)).startswith("notify: 1 event(s) posted")
        _run(matrix, "--notify", receiver.url, code=0)
    assert receiver.events() == [("opened", "ref_notify"), ("closed", "ref_notify")]
    closed = receiver.posts[1].body
    passed = matrix.sql("SELECT uid FROM cell_run WHERE status = 'passed' ORDER BY id")
    assert closed["closed_by"] == closed["attempt"] == passed[0][0]
    assert closed["failures"] == 5 and closed["first_bad"] == opened["first_bad"]  # 1 + 2 repeats + rerun + import
    assert closed["text"].startswith(f"CLOSED ref_notify on reference-0.1.0: passed in {passed[0][0]}")
    episodes = json.loads(matrix("episodes", "--json").output)["episodes"]
    assert [(e["state"], e["failures"]) for e in episodes] == [("closed", 5)]


def _verdicts(m: Matrix) -> list[tuple[object, ...]]:
    return m.sql("SELECT status, failure_kind FROM cell_run ORDER BY id")


@pytest.mark.all_databases
def test_a_failing_or_slow_receiver_changes_no_verdict(matrix: Matrix, monkeypatch: pytest.MonkeyPatch) -> None:
    _sync(matrix, broken=True)
    monkeypatch.setenv("MATRIX_NOTIFY_TIMEOUT_S", "0.5")
    receiver: Receiver
    with webhook() as receiver:
        receiver.status = 500
        line = _notify_line(_run(matrix, "--notify", receiver.url, code=1))
        assert "0 event(s) posted" in line and "1 failed" in line and "HTTP 500" in line, line
        assert matrix.sql("SELECT state, tries FROM notification") == [("failed", 3)]

        receiver.status, receiver.delay_s = 200, 3.0  # answers, but long after the timeout
        started = time.monotonic()
        line = _notify_line(_run(matrix, "--notify", receiver.url, code=1))
        assert "0 event(s) posted" in line and "1 failed" in line and "Timeout" in line, line
        assert time.monotonic() - started < 60
        assert matrix.sql("SELECT state, tries FROM notification") == [("failed", 6)]

        receiver.delay_s = 0.0  # recovered: the event an earlier run missed goes out, once
        assert _notify_line(_run(matrix, "--notify", receiver.url, code=1)).startswith("notify: 1 event(s) posted")
        assert matrix.sql("SELECT state, tries FROM notification") == [("sent", 7)]

        # A pass with a receiver that fails: exit 0 all the same; the close waits for `matrix notify`.
        _sync(matrix, broken=False)
        receiver.status = 503
        assert "1 failed" in _notify_line(_run(matrix, "--notify", receiver.url, code=0))
        receiver.status = 200
        assert "1 event(s) posted" in matrix("notify", "--url", receiver.url).output
    # The slow receiver handled each of its 3 tries after the client had given up on it: the same key each
    # time, so a receiver that honours the key shows the opening once; every other post was refused.
    assert receiver.deduped() == [("opened", "ref_notify"), ("closed", "ref_notify")]
    assert len({p.headers["Idempotency-Key"] for p in receiver.posts if p.body["event"] == "opened"}) == 1
    assert receiver.events().count(("closed", "ref_notify")) == 1
    assert _verdicts(matrix) == [("failed", "validation")] * 3 + [("passed", None)]
