"""[M33] The statistics read each cell's newest `SAMPLE_WINDOW` passed attempts, chosen in SQL: a year of
nightlies costs what the window does, and exports keep every sample."""

from __future__ import annotations

from sqlalchemy import select

from matrix.db.models import Runtime
from matrix.report.perf import SAMPLE_WINDOW, load_samples
from tests.helpers.cli import Matrix
from tests.helpers.reports import attempt, campaign, db, sync


def test_the_newest_attempts_per_cell_are_the_samples_oldest_first(matrix: Matrix) -> None:
    sync(matrix)
    with db(matrix) as s:
        camp = campaign(s)
        for number in range(1, 8):  # request_s 1..7; a failure between them is never a sample
            attempt(s, camp, "vllm_agg_check", "vllm=0.30.0", "passed", attempt_no=2 * number, request_s=float(number))
            attempt(s, camp, "vllm_agg_check", "vllm=0.30.0", "failed", attempt_no=2 * number + 1, request_s=99.0)
        attempt(s, camp, "vllm_long_prompt", "vllm=0.30.0", "passed", request_s=0.5)
        ids = list(s.scalars(select(Runtime.id)))
        windowed = load_samples(s, ids, window=3)
        (key_agg,) = [k for k in windowed if len(windowed[k]["request_s"]) > 1]
        (key_long,) = [k for k in windowed if k != key_agg]
        every = load_samples(s, ids, window=None)
    assert windowed[key_agg]["request_s"] == [5.0, 6.0, 7.0]
    assert windowed[key_long]["request_s"] == [0.5]  # each cell has its own window
    assert every[key_agg]["request_s"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def test_a_comparison_says_when_a_side_reached_the_window(matrix: Matrix) -> None:
    sync(matrix)
    with db(matrix) as s:
        camp = campaign(s)
        for spec, scale in (("vllm=0.29.0", 1.0), ("vllm=0.30.0", 1.5)):
            for number in range(SAMPLE_WINDOW + 5):
                attempt(s, camp, "vllm_agg_check", spec, "passed", attempt_no=number + 1,
                        request_s=scale * (1 + number % 7 / 100), completion_tokens=16)  # fmt: skip
    result = matrix("compare", "vllm=0.29.0", "vllm=0.30.0")
    assert f"(n={SAMPLE_WINDOW}/{SAMPLE_WINDOW}, the newest a side)" in result.output, result.output
