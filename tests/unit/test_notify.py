"""[M30] item 2: episode events posted to a webhook: the body's shape, the URL check, and delivery to a real
HTTP receiver on 127.0.0.1 (a thread of this process): retried with backoff, recorded, posted once, redacted."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from matrix.db.engine import create_db_engine, session_factory
from matrix.errors import ConfigError
from matrix.notify import CLOSED, OPENED, Event, check_url, deliver, event_key, payload, record_events, shown_url
from matrix.report.episodes import Attempt, Episode
from tests.helpers.cli import Matrix
from tests.helpers.reports import attempt, campaign, db, sync
from tests.helpers.webhook import webhook

T0 = dt.datetime(2026, 12, 1, 10, 0, tzinfo=dt.UTC)


def _attempt(uid: str, campaign_id: int, status: str, minutes: int, **kw: str) -> Attempt:
    return Attempt(uid, campaign_id, status, T0 + dt.timedelta(minutes=minutes), kw.get("kind"), kw.get("sig", ""))


def _episode() -> Episode:
    bad = _attempt("bad1", 2, "failed", 10, kind="validation", sig="kv_transfer")
    good, last_bad, closed = (_attempt("good0", 1, "passed", 0), _attempt("bad3", 4, "failed", 30),
                              _attempt("good5", 5, "passed", 75))  # fmt: skip
    return Episode("vllm_native_disaggregated", "vllm-0.31.0", bad, good, failures=3, last_bad=last_bad,
                   closed_by=closed)  # fmt: skip


def test_an_opening_is_one_slack_line_plus_its_fields() -> None:
    episode = _episode()
    key = event_key(episode.case, episode.runtime, OPENED, "bad1")
    body = payload(Event(key, OPENED, episode.first_bad, episode), T0 + dt.timedelta(minutes=12))
    assert body["text"] == (
        "OPENED vllm_native_disaggregated on vllm-0.31.0: failed (validation): kv_transfer; first bad bad1 "
        "(campaign 2), last good good0"
    )
    # Told as it was when it opened, though the same history already closed it.
    assert body["event"] == "opened" and body["failures"] == 1 and body["closed_by"] is None
    assert body["episode"]["state"] == "open" and body["episode"]["first_bad"]["campaign"] == 2
    assert (body["first_bad"], body["last_good"], body["attempt"]) == ("bad1", "good0", "bad1")
    assert (body["class"], body["signature"], body["age_s"]) == ("validation", "kv_transfer", 120.0)
    assert body["idempotency_key"] == key and len(key) == 64
    fields = {f["title"]: f["value"] for f in body["attachments"][0]["fields"]}
    assert fields["case"] == "vllm_native_disaggregated" and fields["closed_by"] == "-"


def test_a_closing_names_the_pass_and_how_long_it_was_broken() -> None:
    episode = _episode()
    body = payload(Event("k", CLOSED, episode.closed_by, episode), T0 + dt.timedelta(days=3))  # type: ignore[arg-type]
    assert body["text"] == (
        "CLOSED vllm_native_disaggregated on vllm-0.31.0: passed in good5 (campaign 5) after 3 failure(s) over "
        "1h 5m 0s; it opened with failed (validation): kv_transfer"
    )
    assert (body["event"], body["closed_by"], body["failures"], body["age_s"]) == ("closed", "good5", 3, 3900.0)
    assert body["attachments"][0]["color"] == "good"


def test_the_key_is_stable_and_names_one_event() -> None:
    key = event_key("c", "r", OPENED, "u1")
    assert key == event_key("c", "r", OPENED, "u1")
    assert len({key, event_key("c", "r", CLOSED, "u1"), event_key("c", "r", OPENED, "u2"),
                event_key("c", "r2", OPENED, "u1")}) == 4  # fmt: skip


def test_a_secret_in_the_signature_is_not_posted() -> None:
    bad = _attempt("b", 1, "failed", 0, kind="startup", sig="auth failed HF_TOKEN=hf_abcdefghijklmnop for x")
    body = payload(Event("k", OPENED, bad, Episode("c", "r", bad, None)), T0)
    assert "hf_abcdefghijklmnop" not in str(body) and "HF_TOKEN=***" in body["text"]


@pytest.mark.parametrize("url", ["ftp://h/x", "hooks.slack.com/x", "http://", "https:///path", " http://h",
                                 "http://h:99999/", "file:///etc/passwd", ""])  # fmt: skip
def test_only_http_urls_with_a_host(url: str) -> None:
    with pytest.raises(ConfigError, match="--notify"):
        check_url(url)


def test_good_urls_and_what_is_shown_of_them() -> None:
    assert check_url("https://hooks.slack.com/services/T/B/X") == "https://hooks.slack.com/services/T/B/X"
    assert shown_url("https://hooks.slack.com/services/T/B/X") == "https://hooks.slack.com"
    assert shown_url("http://user:pw@127.0.0.1:8080/hook?token=x") == "http://127.0.0.1:8080"


def test_a_bad_url_is_one_line_exit_2_and_nothing_written(matrix: Matrix) -> None:
    sync(matrix)
    before = matrix.dump()
    result = matrix("run", "--notify", "ftp://example.org/hook", "--no-report")
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "is not an http:// or https:// URL" in lines[0], result.output
    assert matrix.dump() == before


def _planted(matrix: Matrix, statuses: str) -> list[int]:
    """One campaign per letter (F failed, P passed) of one cell, the failures' message carrying a secret."""
    sync(matrix)
    ids = []
    with db(matrix) as s:
        for letter in statuses:
            camp = campaign(s)
            status = "failed" if letter == "F" else "passed"
            # Written straight into the row, as an older matrix or a hand-made import could have left it.
            message = "engine died: HF_TOKEN=hf_abcdefghijklmnop" if letter == "F" else ""
            attempt(s, camp, "vllm_agg_check", "vllm=0.30.0", status, failure_kind="startup" if letter == "F" else None,
                    message=message)  # fmt: skip
            ids.append(camp.id)
    return ids


def _record(matrix: Matrix, campaigns: list[int]) -> int:
    with db(matrix) as s:
        return record_events(s, campaigns)


def _deliver(matrix: Matrix, url: str, **kw: float) -> tuple[int, int, int]:
    engine = create_db_engine(f"sqlite:///{matrix.db_path}")
    try:
        done = deliver(session_factory(engine), url, sleep=lambda _s: None, **kw)
    finally:
        engine.dispose()
    return done.sent, done.failed, done.left


def test_recorded_once_posted_once_and_redacted(matrix: Matrix) -> None:
    ids = _planted(matrix, "PFFP")
    assert _record(matrix, ids[:2]) == 1  # campaign 2 opened it
    assert _record(matrix, ids[:2]) == 0  # the same campaigns again (a resumed run): nothing new
    assert _record(matrix, ids[2:3]) == 0  # a repeat of the failure: the episode is still the one
    assert _record(matrix, ids[3:]) == 1  # the pass closed it
    with webhook() as receiver:
        assert _deliver(matrix, receiver.url) == (2, 0, 0)
        assert _deliver(matrix, receiver.url) == (0, 0, 0)  # sent events are never posted again
    assert receiver.events() == [("opened", "vllm_agg_check"), ("closed", "vllm_agg_check")]
    opened = receiver.posts[0]
    assert opened.headers["Idempotency-Key"] == opened.body["idempotency_key"]
    assert "hf_abcdefghijklmnop" not in str(receiver.posts) and "HF_TOKEN=***" in opened.body["text"]
    assert matrix.sql("SELECT event, state, tries FROM notification ORDER BY id") == [("opened", "sent", 1),
                                                                                       ("closed", "sent", 1)]


def test_a_5xx_is_retried_then_left_for_the_next_delivery(matrix: Matrix) -> None:
    ids = _planted(matrix, "PFP")
    _record(matrix, ids)
    with webhook() as receiver:
        receiver.script = [500, 200]  # one 5xx, then fine: the second try of the same delivery sends it
        assert _deliver(matrix, receiver.url) == (2, 0, 0)
        assert [p.status for p in receiver.posts] == [500, 200, 200]
        assert receiver.posts[0].headers["Idempotency-Key"] == receiver.posts[1].headers["Idempotency-Key"]
    _planted_more(matrix)
    with webhook() as down:
        down.status = 503  # down for the whole delivery: 3 tries of the first event, the rest left alone
        assert _deliver(matrix, down.url) == (0, 1, 0)
        assert len(down.posts) == 3
        assert matrix.sql("SELECT state, tries FROM notification WHERE id = 3") == [("failed", 3)]
        error = str(matrix.sql("SELECT last_error FROM notification WHERE id = 3")[0][0])
        assert error.startswith("HTTP 503") and "s3cretpath" not in error
        down.status = 200  # recovered: the next delivery sends it, once
        assert _deliver(matrix, down.url) == (1, 0, 0)
        assert [p.body["event"] for p in down.accepted] == ["opened"]


def _planted_more(matrix: Matrix) -> None:
    """Another cell's failure in a campaign of its own, recorded: one more event to post."""
    with db(matrix) as s:
        camp = campaign(s)
        attempt(s, camp, "vllm_long_prompt", "vllm=0.30.0", "timeout", failure_kind="health")
        ids = [camp.id]
    _record(matrix, ids)


def test_a_refused_body_fails_that_event_only(matrix: Matrix) -> None:
    ids = _planted(matrix, "FP")
    _record(matrix, ids)
    with webhook() as receiver:
        receiver.script = [400]  # a 4xx refuses this body: no retry, the next event still goes
        assert _deliver(matrix, receiver.url) == (1, 1, 0)
        assert [p.status for p in receiver.posts] == [400, 200]


def test_a_slow_receiver_costs_a_bounded_time(matrix: Matrix) -> None:
    ids = _planted(matrix, "FP")
    _record(matrix, ids)
    with webhook() as receiver:
        receiver.delay_s = 2.0
        started = time.monotonic()
        assert _deliver(matrix, receiver.url, timeout=0.3) == (0, 1, 1)
        assert time.monotonic() - started < 3 * 0.3 + 1.5
    error = str(matrix.sql("SELECT last_error FROM notification WHERE state = 'failed'")[0][0])
    assert "Timeout" in error


def test_the_notify_command_retries_what_is_pending(matrix: Matrix) -> None:
    ids = _planted(matrix, "F")
    with webhook() as receiver:
        first = matrix("notify", "--url", receiver.url, "--campaign", str(ids[0]))
        assert first.exit_code == 0, first.output
        assert "notify: 1 event(s) posted to http://127.0.0.1:" in first.output and "s3cretpath" not in first.output
        again = matrix("notify", "--url", receiver.url, "--campaign", str(ids[0]))
        assert "notify: 0 event(s) posted" in again.output
    assert receiver.events() == [("opened", "vllm_agg_check")]
