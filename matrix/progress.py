"""What a running campaign shows: a live view on a terminal, lines in logs, JSON events for machines."""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from matrix.text import clean

if TYPE_CHECKING:  # Rich is imported only for the live panel: it costs start-up time every run pays
    from rich.console import Console, Group
    from rich.text import Text


@dataclass(frozen=True)
class Event:
    """One thing that happened: `kind` is campaign-start, cell-start, cell-end, message or campaign-end."""

    kind: str
    cell: str = ""
    cell_id: str = ""
    attempt: int = 0
    status: str = ""
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


class Reporter(Protocol):
    def emit(self, event: Event) -> None: ...

    def close(self) -> None: ...


def _line(event: Event) -> str:
    """The event as one line; catalog names and process messages cleaned (redacted, control bytes escaped)."""
    return clean(_raw_line(event))


def _raw_line(event: Event) -> str:
    if event.kind == "cell-start":
        return f"{'START':<11} {event.cell} [{event.cell_id}] attempt {event.attempt}"
    if event.kind == "cell-end":
        # A skew pair shows its class (`CLEAN-REJECT`, `HANG`...): an honest refusal never reads FAILED.
        label = str(event.data.get("skew_class") or event.status)
        return f"{label.upper():<11} {event.cell} [{event.cell_id}]" + (
            f" - {event.detail}" if event.detail else ""
        )
    return event.detail


class LineReporter:
    """One line per event (not a terminal, or --quiet for only the summary)."""

    def __init__(self, stream: TextIO | None = None, *, quiet: bool = False) -> None:
        self._stream = stream or sys.stdout
        self._quiet = quiet
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        if self._quiet and event.kind not in ("campaign-end", "message"):
            return
        with self._lock:
            print(_line(event), file=self._stream, flush=True)

    def close(self) -> None:
        pass


class JsonReporter:
    """`--json-events`: one JSON object per line on stdout."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        record = {"ts": round(time.time(), 3), "event": event.kind, **{
            k: v for k, v in (("cell", event.cell), ("cell_id", event.cell_id), ("attempt", event.attempt),
                              ("status", event.status), ("detail", clean(event.detail))) if v
        }, **event.data}  # fmt: skip
        with self._lock:
            print(json.dumps(record, default=str), file=self._stream, flush=True)

    def close(self) -> None:
        pass


class LiveReporter:
    """A live panel on a terminal: counts, ETA, one line per running cell; finished cells scroll above."""

    def __init__(self, total: int, console: Console | None = None) -> None:
        from rich.console import Console
        from rich.live import Live

        self._console = console or Console()
        self._total = total
        self._started = time.monotonic()
        self._running: dict[str, tuple[str, float]] = {}
        self._counts: dict[str, int] = {}
        self._done = 0
        self._lock = threading.RLock()
        # `get_renderable`: every refresh (4 a second) renders the panel anew, so the running cells' elapsed
        # times tick; a renderable built once would show the time of the last event, `0.0s` at a start.
        self._live = Live(console=self._console, refresh_per_second=4, transient=True, get_renderable=self._render)
        self._live.start()

    def emit(self, event: Event) -> None:
        printed = self._update(event)
        # Rich is called with our lock released. Rich's refresh thread holds rich's lock while it renders,
        # and rendering (`_render`) takes ours: taking rich's lock while holding ours (console.print, refresh)
        # deadlocked the runner for good, e.g. on the countdown after Ctrl-C.
        if printed is not None:
            self._live.console.print(printed)
        self._live.refresh()

    def _update(self, event: Event) -> Text | str | None:
        """Record the event in the panel's state; what to print above the panel, if anything."""
        from rich.text import Text

        with self._lock:
            if event.kind == "cell-start":
                self._running[event.cell_id] = (event.cell, time.monotonic())
            elif event.kind == "cell-end":
                self._running.pop(event.cell_id, None)
                if not event.data.get("will_retry"):
                    self._done += 1
                    self._counts[event.status] = self._counts.get(event.status, 0) + 1
                style = {"passed": "green", "skipped": "yellow"}.get(event.status, "red")
                return Text(_line(event), style=style)
            elif event.kind in ("message", "campaign-end", "campaign-start"):
                return _line(event)
            return None

    def header(self) -> str:
        """``3/8 done (2 passed, 1 failed), 2 running, ETA 40s``: no empty parentheses before a cell ends."""
        with self._lock:
            elapsed = time.monotonic() - self._started
            eta = ""
            if self._done:
                remaining = (self._total - self._done) * elapsed / self._done
                eta = f", ETA {remaining:.0f}s"
            counts = ", ".join(f"{n} {s}" for s, n in sorted(self._counts.items()))
            done = f"{self._done}/{self._total} done" + (f" ({counts})" if counts else "")
            return f"{done}, {len(self._running)} running{eta}"

    def _render(self) -> Group:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        with self._lock:
            header = Text(self.header(), style="bold")
            table = Table.grid(padding=(0, 2))
            now = time.monotonic()
            for cell_id, (cell, since) in sorted(self._running.items(), key=lambda kv: kv[1][1]):
                table.add_row(f"{now - since:6.1f}s", Text(clean(cell)), cell_id)
            return Group(header, table)

    def close(self) -> None:
        self._live.stop()


def make_reporter(*, total: int, json_events: bool, quiet: bool) -> Reporter:
    if json_events:
        return JsonReporter()
    if quiet:
        return LineReporter(quiet=True)
    from rich.console import Console

    console = Console()
    if console.is_terminal and not quiet:
        return LiveReporter(total, console)
    return LineReporter(quiet=quiet)
