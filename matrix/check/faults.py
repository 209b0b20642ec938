"""Read back what matrix's KV fault plugin did in a cell ([M28]) and judge the cell by it.

The plugin (matrix/tools/vllm_kv_faults) appends one JSON line per injection to the cell's events file, and
a `not_armed` line when the engine's release lacks a method the class needs. Only injections that changed
something count as fired (`effective`): a fault that silently did nothing must never make a cell pass or
fail, so a cell with zero effective injections is "not exercised" (`outcome.judge_fault`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matrix.errors import ConfigError
from matrix.launch.faults import events_path, parse
from matrix.outcome import CellOutcome, judge_fault


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


def judge(outcome: CellOutcome, spec: str | None, work_dir: Path) -> CellOutcome:
    """`outcome` judged by the fault the cell injected (none: unchanged)."""
    if not spec:
        return outcome
    try:
        fault = parse(spec)
    except ConfigError:  # the arm already made the cell a config error naming it
        return outcome
    events = read_events(events_path(work_dir), fault.fault)
    return judge_fault(outcome, events.fired, f"{fault.fault} on {fault.role}", events.evidence())
