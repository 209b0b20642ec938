"""Where cells run: threads on this host (`local`) or tasks on a Ray cluster (`ray`).

An executor only runs cells and hands back their outcomes; the scheduler's driver thread decides what
starts when and alone writes the database. Both executors call the same `matrix.runner.run_cell` and
implement `matrix.schedule.executor.CellExecutor`, the interface the scheduler owns.
"""

EXECUTORS = ("local", "ray")
