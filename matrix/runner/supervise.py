"""One supervised pair from start to teardown: started under the startup gate, asked its `Query` once ready,
sampled for peaks, torn down, and judged on what the teardown and (for a refused request) its logs say."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from matrix.check.specs import CheckFailure
from matrix.errors import MatrixError
from matrix.launch.launch_plan import LaunchPlan
from matrix.launch.listeners import listening_sockets
from matrix.launch.supervisor import Supervisor, TeardownReport, error_lines, find_cell_processes
from matrix.outcome import CellOutcome, after_teardown, failure, not_ready
from matrix.runner.resources import Resources
from matrix.skew_outcome import first_incompatibility, names_incompatibility
from matrix.telemetry import PeakSampler

# What is asked of a ready pair: (its plan, seconds it took to be ready) -> the outcome before teardown.
Query = Callable[[LaunchPlan, float], CellOutcome]


def teardown_checks(report: TeardownReport) -> list[CheckFailure]:
    """The checks a teardown fails: a process that needed SIGKILL, escaped its group, survived, or a port kept."""
    checks = []
    if report.needed_sigkill:
        checks.append(
            CheckFailure(
                "graceful_exit",
                f"{', '.join(report.needed_sigkill)} ignored SIGTERM for the grace period and had to be killed",
            )
        )
    if report.escaped_pids:
        checks.append(
            CheckFailure(
                "no_escaped_processes",
                f"{len(report.escaped_pids)} process(es) left their process group (pids "
                f"{', '.join(map(str, report.escaped_pids))}) and were found by MATRIX_CELL_ID and killed",
            )
        )
    if report.survivors:
        checks.append(CheckFailure("no_survivors", f"processes still alive after teardown: {report.survivors}"))
    if report.busy_ports:
        checks.append(CheckFailure("ports_released", f"ports still in use after teardown: {report.busy_ports}"))
    return checks


def supervise(supervisor: Supervisor, plan: LaunchPlan, resources: Resources, query: Query) -> CellOutcome:
    """Start the pair, ask `query` once it is ready, tear it down whatever happened: the judged outcome."""
    sampler = PeakSampler(supervisor.pids, [int(g) for g in resources.gpu_ids if g.isdigit()], interval_s=0.05)
    queued: list[float] = [0.0]
    listeners: list[dict[str, Any]] = []
    try:
        outcome = _start_and_query(supervisor, sampler, plan, resources, queued, query)
    finally:
        if sampler.is_alive():
            sampler.sample()  # a last look at the steady state, before teardown frees everything
        # What the processes listen on, after the request (some engines open side channels on first use).
        listeners = listening_sockets(find_cell_processes(plan.cell_id), supervisor.pids())
        report = supervisor.teardown()
        peaks = sampler.stop() if sampler.is_alive() else {}
        for scratch in plan.scratch_dirs:
            shutil.rmtree(scratch, ignore_errors=True)
    exit_codes = {e.role: e.returncode for e in report.exits}
    outcome = replace(outcome, teardown_s=report.duration_s, exit_codes=exit_codes, peaks=peaks, queued_s=queued[0],
                      listeners=(*outcome.listeners, *listeners))  # fmt: skip
    return after_teardown(with_refusal_evidence(outcome, supervisor.log_paths()), teardown_checks(report))


# Checks whose failure means the pair refused the request rather than answered it wrongly.
_REFUSED_CHECKS = frozenset({"http_status", "request"})
_EVIDENCE_LINES = 3  # per role: the first error lines, and the first lines that name an incompatibility


def with_refusal_evidence(outcome: CellOutcome, log_paths: dict[str, Path]) -> CellOutcome:
    """A request the pair refused (an HTTP error, a failed request) gets its processes' error lines in its message.

    The answer's body seldom says why: vLLM's decode answers 500 while its own log says "NIXL compatibility hash
    mismatch ... Prefill and decode instances have incompatible configurations", often after a traceback of a
    dozen lines. The lines naming an incompatibility are the evidence a reader (and the skew outcome class)
    needs, and the logs may be rotated away before anyone reads them.
    """
    if not any(check.name in _REFUSED_CHECKS for check in outcome.checks):
        return outcome
    found: list[str] = []
    for role, path in sorted(log_paths.items()):
        lines = error_lines(path).splitlines()
        naming = [line for line in lines if names_incompatibility(line)][:_EVIDENCE_LINES]
        said = first_incompatibility(path)  # a long traceback may push it past the error lines kept
        if said and not any(said in line for line in naming):
            naming.insert(0, said)
        first = [line for line in lines if line not in naming and not line.startswith("...")][:_EVIDENCE_LINES]
        if naming or first:
            found.append(f"--- error lines ({role}.log) ---\n" + "\n".join(naming + first))
    if not found:
        return outcome
    return replace(outcome, message="\n".join((outcome.message, *found)))


def _start_and_query(
    supervisor: Supervisor,
    sampler: PeakSampler,
    plan: LaunchPlan,
    resources: Resources,
    queued: list[float],
    query: Query,
) -> CellOutcome:
    waited = time.monotonic()
    try:
        with resources.startup_gate:
            queued[0] = time.monotonic() - waited
            supervisor.start()
            sampler.start()
            ready = supervisor.wait_ready()
    except MatrixError as exc:
        return failure("startup", str(exc))
    if not ready.ok:
        message = (
            ready.message
            + (f"\n--- error lines (whole log) ---\n{ready.error_lines}" if ready.error_lines else "")
            + (f"\n--- last log lines ---\n{ready.log_tail}" if ready.log_tail else "")
        )
        return not_ready(ready.kind, message)
    outcome = query(plan, ready.ready_s)
    if ready.warning:  # ready only just, on a loaded host: said whatever the request did
        outcome = replace(outcome, message=f"{outcome.message}\n{ready.warning}" if outcome.message else ready.warning)
    return outcome
