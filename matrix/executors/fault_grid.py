"""One cell of a fault grid ([M28]) on its shared pair: the cell's KV fault put in force, what the plugin did
given back to the cell, and the pair brought to rest for the next cell.

A fault grid's engines load matrix's vLLM fault plugin armed for every class; each engine reads the class in
force from its own control file (`SharedEngines.fault_control`) at every transfer. Before its request a cell
writes its class into its fault's role's file (and nothing into the other's: the healthy twin writes nothing
into both); after its checks it clears them, copies the event lines the engines appended meanwhile into its
own log directory (where `check.faults` reads a per-cell row's), and waits until both engines are at rest.
A fault made at launch (`model_revision`) is the engine itself: a grid of that case's repeats writes nothing
into the control files, and each cell's plan of its pair records the launch event in the cell's directory.
A fault may leave work behind that would be the next cell's: `lost_notification` leaves prefill holding
blocks until its lease runs out (vLLM's 30 s), `never_complete` a decode request waiting for KV that never
comes. A pair still busy after `SETTLE_BOUND_S` is restarted before the next cell, and the row says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from matrix.check.faults import EVENTS_FILE, events_path
from matrix.check.http import loopback_client
from matrix.check.lifecycle import POLL_S, held_at_rest, read_gauges
from matrix.check.specs import EngineGauges
from matrix.kv_faults import LAUNCH_CLASSES, parse
from matrix.launch.faults import write_control

# vLLM's NIXL lease (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 30 s) with room for a loaded host.
SETTLE_BOUND_S = 60.0


@dataclass(frozen=True)
class FaultSwitch:
    """The control file of each role, and each engine's events file with its size when the cell began."""

    controls: dict[str, Path]
    events: dict[str, tuple[Path, int]]


def arm(kv_fault: str | None, controls: dict[str, Path], work_dirs: dict[str, Path]) -> FaultSwitch:
    """Put the cell's fault (`CLASS` or `CLASS:ROLE`; None: the healthy twin) in force on its role's engine.
    A fault made at launch (`model_revision`) is in force already: the faulted engine is the fault, and the
    cell's own plan of its pair records the launch event in the cell's directory, as a per-cell pair's does."""
    fault = parse(kv_fault) if kv_fault else None
    plugin_class = fault.fault if fault is not None and fault.fault not in LAUNCH_CLASSES else None
    for role, control in controls.items():
        write_control(control, plugin_class if fault is not None and fault.role == role else None)
    events = {role: (events_path(d), _size(events_path(d))) for role, d in work_dirs.items()}
    return FaultSwitch(controls, events)


def disarm(switch: FaultSwitch, log_dir: Path) -> None:
    """No fault in force any more; the engines' events since `arm` into the cell's own events file."""
    for control in switch.controls.values():
        write_control(control, None)
    lines = b""
    for path, offset in switch.events.values():
        try:
            with path.open("rb") as handle:
                handle.seek(offset)
                lines += handle.read()
        except OSError:
            continue  # no injection, no file
    if lines:
        with (log_dir / EVENTS_FILE).open("ab") as sink:
            sink.write(lines)


def settle(engines: tuple[EngineGauges, ...], bound_s: float = SETTLE_BOUND_S) -> tuple[float, list[str]]:
    """Wait until every engine is at rest (nothing running or waiting, no KV held): (seconds waited, what is
    still held when the bound passed; empty: at rest)."""
    started = time.monotonic()
    with loopback_client(5.0) as client:
        while True:
            held = held_at_rest(read_gauges(engines, client))
            waited = time.monotonic() - started
            if not held or waited >= bound_s:
                return waited, held
            time.sleep(POLL_S)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
