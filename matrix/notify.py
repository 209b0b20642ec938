"""Notifications of failure episodes ([M30] item 2): a webhook hears when an episode opens and when it closes.

An *event* is (episode, "opened" or "closed", the attempt that opened or closed it), found with
`matrix.report.episodes`' rules. After a run, the events whose attempt belongs to one of the run's campaigns are
recorded in the `notification` table (state `pending`) and then every event not yet sent is posted, oldest
first, as JSON: a Slack-readable `text` line and Slack `attachments` fields, plus the same facts as plain
top-level keys for any other receiver. Each event's idempotency key is a hash of the episode's cell, the
event and the attempt's uid, so it is the same in every run: a repeat, a resumed or retried run and an
import never record it twice, and a sent event is never posted again (the key also goes out as the
`Idempotency-Key` header, for receivers that dedupe two runners posting at once).

A post is tried `TRIES` times with exponential backoff, each try bounded by a short timeout, and a run spends
at most `BUDGET_S` posting. A failure is recorded (`failed`, tries, the last error) and never changes the
run's verdicts or exit code; the next run (or `matrix notify`) tries again. Everything posted goes through
`matrix.text.clean` (redaction, printable text), and the webhook's URL is never stored nor printed beyond
its scheme and host: the path of a Slack webhook is its secret.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from matrix.db.engine import transaction
from matrix.db.models import CellRun, Notification, utcnow
from matrix.errors import ConfigError
from matrix.report.episodes import Attempt, Episode, load_episodes
from matrix.text import clean, clean_data, shorten

if TYPE_CHECKING:
    import httpx
    from sqlalchemy.orm import Session, sessionmaker

NOTIFY_ENV = "MATRIX_NOTIFY_URL"
TIMEOUT_ENV = "MATRIX_NOTIFY_TIMEOUT_S"
# A webhook answers in well under a second; a run's end must not wait long on one that hangs.
DEFAULT_TIMEOUT_S = 5.0
TRIES = 3
BACKOFF_S = 0.5  # before the 2nd try; doubled before each further one
BUDGET_S = 60.0  # what one run spends posting at most; what is left stays pending for the next
# An event a receiver refused this many times over all runs (say a 400 on its body) is not tried again,
# so one bad event does not cost every later run its tries.
GIVE_UP_TRIES = 12
ERROR_CHARS = 300

OPENED, CLOSED = "opened", "closed"
PENDING, SENT, FAILED = "pending", "sent", "failed"


@dataclass(frozen=True)
class Event:
    key: str
    event: str  # opened | closed
    attempt: Attempt
    episode: Episode


@dataclass
class Delivery:
    """What one delivery did: events posted, events that failed this time, events left untried."""

    sent: int = 0
    failed: int = 0
    left: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


def check_url(url: str, flag: str = "--notify") -> str:
    """`url` when it is an http(s) URL with a host; else a ConfigError (exit 2) naming the problem."""
    parts = urlsplit(url.strip()) if url.strip() == url else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
        raise ConfigError(
            f"{flag} {clean(shorten(url, 80))!r} is not an http:// or https:// URL with a host "
            f"(a webhook such as https://hooks.slack.com/services/...; also ${NOTIFY_ENV})"
        )
    try:
        parts.port  # noqa: B018 - raises on a port out of range or not a number
    except ValueError:
        raise ConfigError(f"{flag}: the URL's port is not a number from 0 to 65535") from None
    return url


def shown_url(url: str) -> str:
    """Scheme, host and port only: the path (and any user or query) of a webhook URL may be its secret."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")


def timeout_s() -> float:
    """Each try's timeout: $MATRIX_NOTIFY_TIMEOUT_S, else `DEFAULT_TIMEOUT_S` (a bad value: the default)."""
    try:
        value = float(os.environ.get(TIMEOUT_ENV, ""))
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return value if 0 < value <= 60 else DEFAULT_TIMEOUT_S


def event_key(case: str, runtime: str, event: str, attempt_uid: str) -> str:
    """The event's idempotency key: stable across runs, imports and databases holding the same attempt."""
    return hashlib.sha256(f"{case}\x00{runtime}\x00{event}\x00{attempt_uid}".encode()).hexdigest()


def events_of(episodes: Iterable[Episode], campaigns: set[int] | None = None) -> list[Event]:
    """The opening and closing of each episode, only those whose attempt is of `campaigns` (None: all)."""
    found = []
    for episode in episodes:
        for event, attempt in ((OPENED, episode.first_bad), (CLOSED, episode.closed_by)):
            if attempt is not None and (campaigns is None or attempt.campaign_id in campaigns):
                found.append(Event(event_key(episode.case, episode.runtime, event, attempt.uid), event, attempt,
                                   episode))  # fmt: skip
    return found


def payload(ev: Event, now: dt.datetime) -> dict[str, Any]:
    """The JSON body of one event, cleaned (redacted, printable)."""
    # An opening is told as it was when it opened, even when the same run already closed it.
    episode = ev.episode if ev.event == CLOSED else dataclasses.replace(ev.episode, failures=1, last_bad=None,
                                                                       closed_by=None)  # fmt: skip
    facts = episode.as_dict(now)
    first = episode.first_bad
    what = f"{first.status} ({first.failure_kind or 'unclassified'})" + (f": {first.signature}" if first.signature
                                                                         else "")  # fmt: skip
    age = episode.age_s(now)
    if ev.event == OPENED:
        last_good = episode.last_good.uid if episode.last_good else "never passed before"
        text = (f"OPENED {episode.case} on {episode.runtime}: {what}; first bad {first.uid} "
                f"(campaign {first.campaign_id}), last good {last_good}")  # fmt: skip
    else:
        text = (f"CLOSED {episode.case} on {episode.runtime}: passed in {ev.attempt.uid} "
                f"(campaign {ev.attempt.campaign_id}) after {episode.failures} failure(s) over {_age(age)}; "
                f"it opened with {what}")  # fmt: skip
    fields = {
        "event": ev.event, "case": episode.case, "runtime": episode.runtime, "failures": episode.failures,
        "class": first.failure_kind, "signature": first.signature, "first_bad": first.uid,
        "last_good": episode.last_good.uid if episode.last_good else None,
        "closed_by": episode.closed_by.uid if episode.closed_by else None, "age_s": age,
    }  # fmt: skip
    # Slack's incoming webhooks show the attachment's fields as a table under the line; other receivers read
    # the same facts as the top-level keys.
    table = [{"title": k, "value": "-" if v is None else str(v), "short": True} for k, v in fields.items()]
    attachment = {"color": "danger" if ev.event == OPENED else "good", "fallback": text, "fields": table}
    body = {
        "text": text,
        "attachments": [attachment],
        **fields,
        "attempt": ev.attempt.uid,
        "idempotency_key": ev.key,
        "episode": facts,
    }
    cleaned: dict[str, Any] = clean_data(body)
    return cleaned


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "an unknown time"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    parts = [f"{n}{unit}" for n, unit in ((days, "d"), (hours, "h"), (minutes, "m")) if n]
    return " ".join([*parts, f"{secs}s"]) if not days else " ".join(parts)


def record_events(session: Session, campaigns: Iterable[int], now: dt.datetime | None = None) -> int:
    """Record (pending) the events of `campaigns` not recorded before; how many were new."""
    wanted = set(campaigns)
    if not wanted:
        return 0
    now = now or utcnow()
    if session.scalar(select(CellRun.id).where(CellRun.campaign_id.in_(wanted)).limit(1)) is None:
        return 0
    events = events_of(load_episodes(session), wanted)
    if not events:
        return 0
    known = set(session.scalars(select(Notification.key).where(Notification.key.in_([e.key for e in events]))))
    fresh = [e for e in events if e.key not in known]
    # Oldest first, an opening before the closing of the same episode: the order they are posted in.
    fresh.sort(key=lambda e: (_stamp(e.attempt.finished_at), e.event != OPENED))
    for ev in fresh:
        session.add(Notification(key=ev.key, event=ev.event, attempt_uid=ev.attempt.uid, payload=payload(ev, now),
                                 state=PENDING, tries=0, last_error="", created_at=now))  # fmt: skip
    return len(fresh)


def _stamp(moment: dt.datetime | None) -> float:
    if moment is None:
        return 0.0
    return (moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)).timestamp()


def deliver(
    factory: sessionmaker[Session], url: str, *, timeout: float | None = None, budget_s: float = BUDGET_S,
    sleep: Callable[[float], None] = time.sleep,
) -> Delivery:  # fmt: skip
    """Post every event not yet sent (oldest first) and record each outcome; never raises for the receiver.

    No transaction is held while posting: a slow receiver must not keep the database locked for other runners.
    A receiver that still fails after `TRIES` tries (a 5xx, a timeout, no connection) ends this delivery,
    the rest waiting for the next one; a refusal of one body (a 4xx) fails that event only.
    """
    import httpx

    with transaction(factory) as session:
        rows = session.execute(
            select(Notification.id, Notification.key, Notification.payload)
            .where(Notification.state != SENT, Notification.tries < GIVE_UP_TRIES)
            .order_by(Notification.id)
        ).all()
    done = Delivery()
    if not rows:
        return done
    deadline = time.monotonic() + budget_s
    with httpx.Client(timeout=timeout or timeout_s(), follow_redirects=False) as client:
        for index, (row_id, key, body) in enumerate(rows):
            if time.monotonic() >= deadline:
                done.left = len(rows) - index
                break
            ok, tries, error, transient = _post(client, url, key, body, deadline, sleep)
            with transaction(factory) as session:
                values: dict[str, Any] = {"tries": Notification.tries + tries}
                values |= {"state": SENT, "sent_at": utcnow(), "last_error": ""} if ok else {
                    "state": FAILED, "last_error": error}  # fmt: skip
                session.execute(update(Notification).where(Notification.id == row_id).values(**values))
            if ok:
                done.sent += 1
                continue
            done.failed += 1
            done.errors.append(error)
            if transient:
                done.left = len(rows) - index - 1
                break
    return done


def _post(
    client: httpx.Client, url: str, key: str, body: dict[str, Any], deadline: float,
    sleep: Callable[[float], None],
) -> tuple[bool, int, str, bool]:  # fmt: skip
    """(sent, tries made, the last error, whether that error may pass: worth the next run's try)."""
    import httpx

    error, transient, tries = "", True, 0
    for attempt in range(TRIES):
        if attempt:
            pause = BACKOFF_S * 2 ** (attempt - 1)
            if time.monotonic() + pause >= deadline:
                break
            sleep(pause)
        tries += 1
        try:
            answer = client.post(url, json=body, headers={"Idempotency-Key": key})
        except httpx.HTTPError as exc:
            error, transient = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, True
            continue
        if answer.is_success:
            return True, tries, "", False
        error = f"HTTP {answer.status_code}: {answer.text.strip()[:ERROR_CHARS]}".rstrip(": ")
        # 408 and 429 say "later"; any other 4xx refuses this body, and a retry would be refused the same.
        transient = answer.status_code >= 500 or answer.status_code in (408, 429)
        if not transient:
            break
    # The error may quote the URL (whose path may be the secret) or the receiver's echo of anything.
    return False, tries, shorten(clean(error.replace(url, shown_url(url))), ERROR_CHARS), transient


def notify(factory: sessionmaker[Session], url: str, campaigns: Iterable[int]) -> tuple[int, Delivery]:
    """Record the events of `campaigns`, then deliver every event not yet sent: (new events, what was posted)."""
    campaigns = list(campaigns)
    try:
        with transaction(factory) as session:
            recorded = record_events(session, campaigns)
    except IntegrityError:
        # Another runner of the same campaign (`--join`) recorded these events between our read and our
        # insert: they are recorded once, which is all that matters; it or we post them.
        recorded = 0
    return recorded, deliver(factory, url)


def summary_line(url: str, recorded: int, done: Delivery) -> str:
    """One line for the end of a run: what was posted, what failed, what waits."""
    line = f"notify: {done.sent} event(s) posted to {shown_url(url)}"
    if recorded:
        line += f" ({recorded} new)"
    if done.failed or done.left:
        line += f", {done.failed} failed, {done.left} left for the next run (`matrix notify` retries)"
        if done.errors:
            line += f": {done.errors[-1]}"
    return line
