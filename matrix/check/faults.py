"""Read back what matrix's KV fault plugin did in a cell ([M28]) and judge the cell by it.

The plugin (matrix/tools/vllm_kv_faults) appends one JSON line per injection to the cell's events file, and
a `not_armed` line when the engine's release lacks a method the class needs. Only injections that changed
something count as fired (`effective`): a fault that silently did nothing must never make a cell pass or
fail, so a cell with zero effective injections is "not exercised" (`outcome.judge_fault`, which the runner
calls with `evidence`). The fault classes and the `kv_fault` launch value's grammar are the leaf
`matrix.kv_faults`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matrix.errors import ConfigError
from matrix.kv_faults import NONE, parse

# In the cell's directory: the plugin appends here.
EVENTS_FILE = "kv-fault-events.jsonl"


def events_path(work_dir: Path) -> Path:
    """Where the plugin appends its events for the cell in `work_dir`."""
    return work_dir / EVENTS_FILE


@dataclass(frozen=True)
class FaultEvents:
    fired: int  # effective injections
    ineffective: int  # injections that changed nothing (e.g. the blocks already held the same values)
    not_armed: tuple[str, ...]  # why the plugin could not arm the class
    requests: tuple[str, ...]  # the requests it fired on

    def evidence(self) -> str:
        parts = [f"{self.fired} effective injection(s) on {len(self.requests)} request(s)"]
        if self.ineffective:
            parts.append(f"{self.ineffective} changed nothing")
        parts += [f"not armed: {why}" for why in self.not_armed]
        return "; ".join(parts)


def read_events(path: Path, fault: str) -> FaultEvents:
    """The events of `fault` in `path` (absent file: none; a torn last line is ignored)."""
    events: list[dict[str, Any]] = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and event.get("class") in (fault, "*"):
                events.append(event)
    injected = [e for e in events if e.get("event") == "injected"]
    effective = [e for e in injected if e.get("effective")]
    not_armed = tuple(dict.fromkeys(str(e.get("why")) for e in events if e.get("event") == "not_armed"))
    requests = tuple(Counter(str(e.get("request_id")) for e in effective))
    return FaultEvents(len(effective), len(injected) - len(effective), not_armed, requests)


def evidence(spec: str | None, work_dir: Path) -> tuple[int, str, str] | None:
    """(effective injections, "CLASS on ROLE", what the events say) for `outcome.judge_fault`; None when
    the cell has no fault, or a `kv_fault` value the arm already refused as a config error."""
    if not spec:
        return None
    try:
        fault = parse(spec)
    except ConfigError:
        return None
    if fault.fault == NONE:
        return None
    events = read_events(events_path(work_dir), fault.fault)
    return events.fired, f"{fault.fault} on {fault.role}", events.evidence()
