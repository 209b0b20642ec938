"""[M29] item 1: the live panel never deadlocks between its own lock and rich's.

Rich's refresh thread holds rich's lock while it renders the panel, and rendering takes the panel's lock.
`emit` used to hold the panel's lock while it called into rich (print, refresh), which takes rich's lock:
two threads, two locks, opposite orders. Here a second thread refreshes the way rich's own refresh thread
does (rich's lock held, then a render), as often as it can, while the main thread emits events; with a
tiny thread switch interval the interleaving that deadlocked comes up within a fraction of a second.
"""

from __future__ import annotations

import io
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from rich.console import Console

from matrix.progress import Event, LiveReporter


@pytest.fixture
def fast_switching() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_emit_and_refresh_from_two_threads_do_not_deadlock(fast_switching: None) -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=100, height=30)
    reporter = LiveReporter(total=1000, console=console)
    live = reporter._live  # the thread below stands in for rich's refresh thread, at full speed
    stop = threading.Event()

    def refresher() -> None:
        while not stop.is_set():
            with live._lock:  # what rich's _RefreshThread does, 4 times a second
                live.refresh()

    def emitter() -> None:
        for i in range(400):
            reporter.emit(Event("cell-start", f"case@reference-{i}", f"id{i}", 1))
            reporter.emit(Event("message", detail=f"waiting for {i} pair(s)"))
            reporter.emit(Event("cell-end", f"case@reference-{i}", f"id{i}", 1, "interrupted", "stopped"))

    threads = [threading.Thread(target=refresher, daemon=True), threading.Thread(target=emitter, daemon=True)]
    for thread in threads:
        thread.start()
    threads[1].join(timeout=30)
    deadlocked = threads[1].is_alive()
    stop.set()
    threads[0].join(timeout=5)
    deadlocked = deadlocked or threads[0].is_alive()
    if not deadlocked:
        reporter.close()
    assert not deadlocked, "emit and rich's refresh deadlocked on each other's lock"
    assert reporter.header().startswith("400/1000 done (400 interrupted), 0 running")


def test_the_panel_still_prints_events_and_shows_running_cells() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, height=30)
    reporter = LiveReporter(total=2, console=console)
    reporter.emit(Event("cell-start", "case@reference-0.1.0", "abc", 1))
    time.sleep(0.3)
    assert "1 running" in reporter.header()
    reporter.emit(Event("cell-end", "case@reference-0.1.0", "abc", 1, "passed", "ready 1.00s"))
    reporter.close()
    assert "PASSED      case@reference-0.1.0 [abc] - ready 1.00s" in out.getvalue()
    assert reporter.header().startswith("1/2 done (1 passed), 0 running")
