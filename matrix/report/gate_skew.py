"""The gate's version-skew rule (`skew_both_ways`): during a rolling upgrade the candidate serves beside the
previous release, so both orders of the pair must be safe.

For each required case the rule selects, the latest finished attempt of prefill=candidate/decode=previous and
of prefill=previous/decode=candidate (on a Dynamo grid: with the frontend on either of the two releases) must
be `works` or `clean-reject` (`matrix.skew_outcome`): a pair that refuses itself, naming why, is an honest
outcome an operator can plan around; a hang, an error answer, a crash or a healthy-but-wrong answer blocks. A direction
without an attempt is missing evidence (INCOMPLETE, never GO), with the command that runs it. A pair that served
correctly but failed `--loopback-only` is `exposed`: it blocks as the gate's `exposure` finding, not as skew.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy.orm import Session

from matrix.outcome import EXPOSED
from matrix.report.skew import SkewEntry, load_skew_grid

# Classes a release can ship with: the pair works, or refuses itself cleanly (operators can plan for that).
SAFE_CLASSES = frozenset({"works", "clean-reject"})
# Reason kinds this rule produces: a finding, missing evidence, and the record of a safe pair.
SKEW_KIND, SKEW_NOT_RUN, SKEW_SAFE, SKEW_NO_PREVIOUS = "skew", "skew-not-run", "skew-safe", "skew-no-previous"
# A pair that served correctly but listened beyond loopback under `--loopback-only`: the gate's exposure kind.
SKEW_EXPOSURE = "exposure"

# (kind, message, blocking) of one finding; the caller makes its Reason of it.
Finding = tuple[str, str, bool]


def _pair(prefill: str, decode: str) -> str:
    return f"prefill {prefill} / decode {decode}"


def _direction(entries: list[SkewEntry], prefill: str, decode: str, run_hint: Callable[[str, str], str]) -> Finding:
    """The finding for one order of the pair, from its grid cells (one per frontend release)."""
    pair = _pair(prefill, decode)
    ran = [e for e in entries if e.verdict.cls != "not-run"]
    unsafe = [e for e in ran if e.verdict.cls not in SAFE_CLASSES | {EXPOSED}]
    exposed = [e for e in ran if e.verdict.cls == EXPOSED]
    if exposed and not unsafe:
        # Served correctly both ways so far, but a listener was beyond loopback under --loopback-only: the
        # gate's exposure finding, not a skew incompatibility.
        e = exposed[0]
        front = f", frontend {e.roles['frontend']}" if len(entries) > 1 else ""
        return (SKEW_EXPOSURE, f"{pair}{front} is exposed: {e.verdict.reason} (cell {e.cell}, campaign "
                f"{e.campaign_id})", True)  # fmt: skip
    if unsafe:
        e = unsafe[0]
        front = f", frontend {e.roles['frontend']}" if len(entries) > 1 else ""
        # The text before the first colon is the headline (`GateResult.skew_line`): the pair and its class.
        return (SKEW_KIND, f"{pair}{front} is {e.verdict.cls}: {e.verdict.reason} (must be works or clean-reject; "
                f"cell {e.cell}, campaign {e.campaign_id})", True)  # fmt: skip
    if not ran or len(ran) < len(entries):
        return (SKEW_NOT_RUN, f"{pair} not run: no finished attempt says how the pair behaves; run it with "
                f"`{run_hint(prefill, decode)}`", True)  # fmt: skip
    classes = ", ".join(sorted({e.verdict.cls for e in ran}))
    return (SKEW_SAFE, f"{pair} is {classes}", False)


def judge_skew(session: Session, case: str, backend: str, candidate: str, previous: str | None) -> list[Finding]:
    """Both orders of (candidate, previous release) for `case`; see the module docstring."""
    if previous is None:
        return [(SKEW_NO_PREVIOUS, f"skew_both_ways: {backend} {candidate} has no previous release to pair with",
                 False)]  # fmt: skip
    grid = load_skew_grid(session, case)
    pair_of = {candidate, previous}

    def hint(prefill: str, decode: str) -> str:
        return (f"matrix run --case {case} --prefill-runtime {backend}={prefill} "
                f"--decode-runtime {backend}={decode}")  # fmt: skip

    found = []
    for prefill, decode in ((candidate, previous), (previous, candidate)):
        entries = [e for e in grid.entries if (e.roles["prefill"], e.roles["decode"]) == (prefill, decode)
                   and e.roles["frontend"] in pair_of]  # fmt: skip
        found.append(_direction(entries, prefill, decode, hint))
    return found
