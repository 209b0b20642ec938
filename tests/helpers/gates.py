"""The gate tests' shared catalog: the cases they seed, gate policies and waivers."""

from __future__ import annotations

from tests.helpers.cli import Matrix
from tests.helpers.reports import attempt, campaign, db

CASES = ("vllm_agg_check", "vllm_long_prompt", "vllm_disaggregated")

GATES = """
[[gate]]
name = "release"
expression = "(pre_merge or post_merge or release) and e2e"
rules = { flaky_blocks = false, regressions_block = true }

[[gate]]
name = "strict"
expression = "(pre_merge or post_merge) and e2e"
rules = { flaky_blocks = true, regressions_block = true }

[[gate]]
name = "lenient"
expression = "(pre_merge or post_merge) and e2e"
rules = { regressions_block = false }

[[gate]]
name = "typo"
expression = "e2e"
rules = { flaky_block = true }
"""


def waivers(*entries: tuple[str, str, str]) -> str:
    return "".join(
        f'[[waiver]]\ncase = "{case}"\nruntime_spec = "{spec}"\nreason = "known bug <b>x</b>"\n'
        f'link = "https://example.org/issue/1"\nexpires = {expires}\n\n'
        for case, spec, expires in entries
    )


SKEW_CASES = ("vllm_agg_check", "vllm_long_prompt", "vllm_disaggregated")
# `sidecar` selects vllm_disaggregated only: the rule judges the cases its expression names.
SKEW_GATES = """
[[gate]]
name = "upgrade"
expression = "(pre_merge or post_merge) and e2e"
rules = { skew_both_ways = "sidecar" }

[[gate]]
name = "upgrade_all"
expression = "(pre_merge or post_merge) and e2e"
rules = { skew_both_ways = true }

[[gate]]
name = "bad_expression"
expression = "e2e"
rules = { skew_both_ways = "sidecar and (" }

[[gate]]
name = "bad_type"
expression = "e2e"
rules = { skew_both_ways = 3 }
"""


def diagonal_passes(m: Matrix) -> None:
    with db(m) as s:
        camp = campaign(s)
        for case in SKEW_CASES:
            for version in ("0.29.0", "0.30.0"):
                attempt(s, camp, case, f"vllm={version}", "passed")
