"""Run one cell attempt: the Execute stage's worker, called by every executor.

- `attempt`: the attempt pipeline (`run_cell`): arm, environments, ports, plan, then `serve_and_judge`.
- `serve`: serving a planned pair and judging it (`serve_and_judge`), shared with the shared-engine grid's
  pairs (`matrix.executors.grid_pair`); its `CHECK_STEPS` is where a new family of checks goes.
- `supervise`: start, ready, teardown of one supervised plan and the checks its teardown fails.
- `equivalence`: the equivalence oracle's aggregated instance and its judgement.
- `resources`: what an attempt is granted (`Resources`) and the running pairs a driver cancels (`LiveCells`).
"""

from matrix.runner.attempt import SKEW_BOUND_S, bounded, run_cell
from matrix.runner.resources import LiveCells, Resources
from matrix.runner.serve import CHECK_STEPS, CheckStep, Exchange, serve_and_judge, unready
from matrix.runner.supervise import supervise, teardown_checks, with_refusal_evidence

__all__ = [
    "CHECK_STEPS",
    "SKEW_BOUND_S",
    "CheckStep",
    "Exchange",
    "LiveCells",
    "Resources",
    "bounded",
    "run_cell",
    "serve_and_judge",
    "supervise",
    "teardown_checks",
    "unready",
    "with_refusal_evidence",
]
