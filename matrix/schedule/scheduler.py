"""Run jobs (attempts of cells) concurrently on slots, longest expected first, and record each outcome.

Worker threads only run cells (processes, HTTP, waiting); the driver thread alone claims rows and writes
outcomes, so every database write happens in one place and in short transactions. A claim turns the
attempt's pending row into a running one (or inserts a retry's row), atomically on the database, so two
runners sharing a campaign never run an attempt twice (`matrix.schedule.claims`).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from matrix.cells import ROLES, Cell
from matrix.db.engine import transaction
from matrix.db.models import CellRun
from matrix.interrupts import StopSignal
from matrix.outcome import (
    CELL_FAULT_STATUSES,
    FAILED_STATUSES,
    PASSED,
    CellOutcome,
    error,
    interrupted,
    judge_listeners,
    not_run,
    retryable,
    skipped,
    with_flaky,
)
from matrix.progress import Event, Reporter
from matrix.results import record_outcome
from matrix.schedule.claims import claim_attempt
from matrix.schedule.executor import CellExecutor, Submission
from matrix.schedule.slots import Demand, Lease, SlotPool
from matrix.skew_outcome import PairClass, classify_outcome, judged_as_skew, role_options_text

_POLL_S = 0.1
# While a stopping runner waits for its pairs, how often it says so (with the time left before SIGKILL).
_COUNTDOWN_S = 2.0


@dataclass
class Job:
    cell: Cell
    attempt: int
    expected_s: float
    demand: Demand
    failed_before: bool = False


@dataclass(frozen=True)
class SchedulerOptions:
    jobs: int
    max_attempts: int = 1
    fail_fast: bool = False
    # `--loopback-only`: a cell whose processes listen beyond loopback fails (`judge_listeners`).
    loopback_only: bool = False


@dataclass
class Tally:
    counts: dict[str, int] = field(default_factory=dict)
    interrupted: bool = False
    failed_fast: bool = False
    # Cell keys of attempts a stop request left unstarted (their rows stay pending: `--resume` runs them).
    not_started: list[str] = field(default_factory=list)
    # Failed attempts of skew cells that are honest refusals (`clean-reject`): an outcome, not a finding.
    refused: int = 0
    # Skew cells' classes, counted (the campaign's summary line says `2 clean-reject`, not `2 failed`).
    classes: dict[str, int] = field(default_factory=dict)
    # Each finished skew attempt as the run's closing grid shows it: (case, backend, role options, pair).
    skew_pairs: list[tuple[str, str, str, PairClass]] = field(default_factory=list)

    def add(self, status: str) -> None:
        self.counts[status] = self.counts.get(status, 0) + 1

    @property
    def any_failed(self) -> bool:
        """A finding: a failed attempt that is not a skew pair's honest refusal."""
        return sum(self.counts.get(s, 0) for s in FAILED_STATUSES) > self.refused


@dataclass
class _Running:
    job: Job
    uid: str
    row_id: int
    lease: Lease


def attempt_log_dir(logs_root: Path, cell_key: str, uid: str) -> Path:
    """Where one attempt's logs live under a campaign's log directory (also for imported attempts)."""
    safe = "".join(c if c.isalnum() or c in "_.@+-" else "_" for c in cell_key)
    return logs_root / f"{safe}-{uid}"


class Scheduler:
    def __init__(
        self,
        factory: sessionmaker[Session],
        campaign_id: int,
        pool: SlotPool,
        executor: CellExecutor,
        reporter: Reporter,
        stop: StopSignal,
        options: SchedulerOptions,
        logs_root: Path,
    ) -> None:
        self._factory = factory
        self._campaign_id = campaign_id
        self._pool = pool
        self._executor = executor
        self._reporter = reporter
        self._stop = stop
        self._options = options
        self._logs_root = logs_root
        self.tally = Tally()

    # --- the driver loop ---------------------------------------------------------------------------

    def run(self, jobs: list[Job]) -> Tally:
        # Cells this host can never run are recorded as skipped at once, not after everything else.
        pending = self._skip_impossible(sorted(jobs, key=lambda job: -job.expected_s), wait_if_none=False)
        running: dict[Future[CellOutcome], _Running] = {}
        killed = False
        told_at = 0.0
        try:
            while pending or running:
                if self._stop.requested and not self._executor.cancelled:
                    self._executor.cancel_all()
                    self.tally.interrupted = True
                    if running:
                        self._reporter.emit(Event("message", detail=f"{self._stop.signal_name or 'stop'}: tearing "
                                                  f"down {len(running)} running pair(s); press Ctrl-C again to kill "
                                                  "them at once"))  # fmt: skip
                if self._stop.forced and running and not killed:
                    killed = True
                    self._reporter.emit(Event("message", detail=f"second {self._stop.signal_name or 'stop'}: "
                                              f"killing {len(running)} pair(s) now"))  # fmt: skip
                    self._executor.kill_all()
                if self._stop.requested and running and not killed and time.monotonic() - told_at >= _COUNTDOWN_S:
                    told_at = time.monotonic()
                    self._countdown(running)
                if not self._stop.requested and not self.tally.failed_fast:
                    pending = self._start_what_fits(pending, running)
                elif not running:
                    break
                if not running:
                    if pending:  # nothing runs and nothing fits: skip what can never fit now
                        pending = self._skip_impossible(pending)
                    continue
                done, _ = wait(running, timeout=_POLL_S, return_when=FIRST_COMPLETED)
                for future in done:
                    retry = self._finish(running.pop(future), future)
                    if retry is not None:
                        pending.insert(0, retry)
        finally:
            self._executor.shutdown()
        if self.tally.failed_fast:
            for job in pending:
                self._record_not_run(job)
        elif self._stop.requested:
            self.tally.not_started = [job.cell.key for job in pending]
        return self.tally

    def _countdown(self, running: dict[Future[CellOutcome], _Running]) -> None:
        """Say what a stopping runner waits for: which pairs, and how long at most before SIGKILL."""
        left = dict(self._executor.stopping())
        waiting = [(entry.job.cell.key, left.get(entry.uid)) for entry in running.values()]
        longest = max((s for _, s in waiting if s is not None), default=None)
        when = f"SIGKILL in {longest:.0f}s at most" if longest else "SIGKILL is next"
        names = ", ".join(key for key, _ in waiting[:3]) + (f" and {len(waiting) - 3} more" if len(waiting) > 3 else "")
        self._reporter.emit(Event("message", detail=f"waiting for {len(waiting)} pair(s) to exit after SIGTERM "
                                  f"({names}): {when}; Ctrl-C again kills them now"))  # fmt: skip

    def _start_what_fits(self, pending: list[Job], running: dict[Future[CellOutcome], _Running]) -> list[Job]:
        left = []
        for job in pending:
            if len(running) >= self._options.jobs:
                left.append(job)
                continue
            lease = self._pool.try_acquire(job.demand)
            if lease is None:
                left.append(job)  # a later, smaller job may still fit (backfill)
                continue
            claimed = self._claim(job)
            if claimed is None:  # another runner has this attempt
                self._pool.release(lease)
                continue
            uid, row_id = claimed
            entry = _Running(job, uid, row_id, lease)
            self._reporter.emit(Event("cell-start", job.cell.key, uid, job.attempt))
            submission = Submission(job.cell, uid, job.attempt, self._log_dir(job, uid), lease)
            running[self._executor.submit(submission)] = entry
        return left

    def _skip_impossible(self, pending: list[Job], *, wait_if_none: bool = True) -> list[Job]:
        left = []
        for job in pending:
            reason = self._pool.can_ever_fit(job.demand)
            if reason is None:
                left.append(job)
                continue
            claimed = self._claim(job)
            if claimed is not None:
                outcome = skipped(reason)
                self._write(claimed[1], outcome)
                self.tally.add("skipped")
                self._reporter.emit(Event("cell-end", job.cell.key, claimed[0], job.attempt, "skipped", reason))
        if left == pending and wait_if_none:
            time.sleep(_POLL_S)  # something else holds the slots (another runner's reservation): wait
        return left

    # --- driver-side bookkeeping --------------------------------------------------------------------

    def _finish(self, entry: _Running, future: Future[CellOutcome]) -> Job | None:
        self._pool.release(entry.lease)
        job = entry.job
        try:
            outcome = future.result()
        except Exception as exc:  # a bug in our own code path: record it, keep the campaign going
            outcome = error("infra", f"internal error: {exc!r}")
        if self._executor.cancelled:
            why = f"runner received {self._stop.signal_name or 'a stop request'}; the pair was torn down"
            outcome = interrupted(outcome, why)
        outcome = judge_listeners(outcome, loopback_only=self._options.loopback_only)
        # "interrupted" without a stop request means the executor lost the cell (e.g. a Ray node died).
        retry = retryable(outcome) and job.attempt < self._options.max_attempts and not self._stop.requested
        outcome = with_flaky(outcome, job.failed_before)
        self._write(entry.row_id, outcome)
        detail = _detail(outcome) + (" (flaky: passed after a failed attempt)" if outcome.flaky else "")
        data: dict[str, object] = {"will_retry": retry}
        if judged_as_skew(job.cell):
            # A skew pair is read by its class: an honest refusal prints and counts as one, not as FAILED.
            verdict = classify_outcome(outcome)
            data["skew_class"] = verdict.cls
            if outcome.status != PASSED:
                detail = f"{verdict.reason.splitlines()[0] if verdict.reason else ''} - {detail}"
            if not retry:
                self.tally.classes[verdict.cls] = self.tally.classes.get(verdict.cls, 0) + 1
                self.tally.refused += verdict.cls == "clean-reject" and outcome.status in FAILED_STATUSES
                case = job.cell.case
                roles = {role: job.cell.runtime_of(role).version for role in ROLES}
                options = role_options_text(getattr(case.launch, "role_launch", None))
                pair = PairClass(job.cell.key, roles, verdict)
                self.tally.skew_pairs.append((case.name, case.backend, options, pair))
        if retry:
            detail += f"; retrying (attempt {job.attempt + 1} of {self._options.max_attempts})"
        else:
            self.tally.add(outcome.status)
        self._reporter.emit(Event("cell-end", job.cell.key, entry.uid, job.attempt, outcome.status, detail, data))
        # An honest refusal of a skew pair is an outcome, not a fault: fail-fast does not stop on it.
        fault = outcome.status in CELL_FAULT_STATUSES and data.get("skew_class") != "clean-reject"
        if fault and not retry and self._options.fail_fast and not self.tally.failed_fast:
            self.tally.failed_fast = True
            self._reporter.emit(Event("message", detail="fail-fast: no new cells will start; running cells finish"))
        if retry:
            return Job(job.cell, job.attempt + 1, job.expected_s, job.demand, failed_before=True)
        return None

    def _claim(self, job: Job) -> tuple[str, int] | None:
        """Own the job's attempt (its pending row, or a new row for a retry); None when another runner has it."""
        return claim_attempt(
            self._factory, self._campaign_id, job.cell, job.attempt, lambda uid: str(self._log_dir(job, uid))
        )

    def _log_dir(self, job: Job, uid: str) -> Path:
        return attempt_log_dir(self._logs_root, job.cell.key, uid)

    def _write(self, row_id: int, outcome: CellOutcome) -> None:
        with transaction(self._factory) as session:
            record_outcome(session.get_one(CellRun, row_id), outcome)

    def _record_not_run(self, job: Job) -> None:
        claimed = self._claim(job)
        if claimed is None:
            return
        self._write(claimed[1], not_run("not started: fail-fast stopped the campaign"))
        self.tally.add("not-run")
        self._reporter.emit(Event("cell-end", job.cell.key, claimed[0], job.attempt, "not-run", "fail-fast"))


def _detail(outcome: CellOutcome) -> str:
    parts = []
    if outcome.status == PASSED and outcome.ready_s is not None and outcome.request_s is not None:
        parts.append(f"ready {outcome.ready_s:.2f}s, request {outcome.request_s * 1000:.0f} ms")
    if outcome.failure_kind:
        first = outcome.message.splitlines()[0] if outcome.message else ""
        parts.append(f"{outcome.failure_kind}: {first}")
    elif outcome.message:
        parts.append(outcome.message.splitlines()[0])
    if outcome.expected_failure:
        parts.append(f"(expected: {outcome.expected_failure})")
    return " - ".join(parts)
