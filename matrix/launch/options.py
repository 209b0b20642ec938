"""Typed case options: the KV bound (`KvBound`), which launch keys each arm reads, and the one table from a
bound to the engine flag that carries it (the engine table, `matrix.engines`).

`matrix catalog sync` checks every case against these (`check_case_options`) before the database is touched,
so a misspelled launch key, a value of the wrong kind (`case_launch`, the launch table typed per arm), a
bound in a unit the case's engine does not read, or a marker that restates the bound with another value is
refused with the fix, instead of being ignored at run time. The arms read the same tables (`kv_arg`), so
what is checked is what is launched.

Pure data and checks: this module imports nothing of the launch machinery (the arm and engine tables and
the typed launch tables are leaves, of check only its pure-data `specs`), so the catalog may import it.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any, overload

from matrix import arm_table as _arm_table
from matrix.arm_table import ARM_ROWS, LAUNCH_TYPES, parse_launch
from matrix.case_launch import CommonLaunch, keys_of, table_option
from matrix.check.specs import DEFAULT_NEAR_TIE_GAP
from matrix.engines import ENGINES, UNBOUNDED_ENGINES, Engine
from matrix.errors import ConfigError
from matrix.kv_bound import KvBound, KvUnit
from matrix.markers import parse_marker_use

# The one table from a bound to engine flags (`matrix.engines`). Every arm that passes a bound looks its
# engine up there.
KV_FLAGS: Mapping[str, Engine] = ENGINES


@overload
def kv_arg(bound: KvBound, engine: str, default: int) -> tuple[str, int]: ...
@overload
def kv_arg(bound: KvBound, engine: str, default: None = None) -> tuple[str, int] | None: ...
def kv_arg(bound: KvBound, engine: str, default: int | None = None) -> tuple[str, int] | None:
    """(flag, value) that bounds `engine`'s KV cache from a case's `kv_bound` (else `default`); None when
    there is neither."""
    return ENGINES[engine].kv_arg(bound, default)


# Markers that restate the bound for a reader of `matrix plan -m`: their value must be the bound's.
RESTATING_MARKERS: dict[str, KvUnit] = {
    "requested_vllm_kv_cache_bytes": "bytes",
    "requested_sglang_kv_tokens": "tokens",
    "requested_trtllm_kv_tokens": "tokens",
}

# Launch keys every arm may carry (`case_launch.CommonLaunch`: read by the runner, the scheduler and the
# container provider). `equivalence` on an arm without an aggregated plan is refused by `catalog sync` with
# that reason.
COMMON_LAUNCH_KEYS = keys_of(CommonLaunch)
# The launch keys each arm reads: the fields of its typed launch table (`tests/unit/test_case_options.py`
# checks this against the arms' code).
LAUNCH_KEYS: dict[str, frozenset[str]] = {
    arm: keys_of(launch_type) - COMMON_LAUNCH_KEYS for arm, launch_type in LAUNCH_TYPES.items()
}


def engine_of(arm: str, launch: CommonLaunch) -> str:
    """The engine whose KV flag a case of `arm` uses (its row's; a dynamo case names it in `launch.engine`)."""
    return ARM_ROWS[arm].engine_of(launch)


def check_case_options(
    arm: str, launch: Mapping[str, Any], kv_bound: Mapping[str, Any], markers: Sequence[str]
) -> KvBound:
    """The case's typed KV bound, after checking its launch keys, the bound's unit and the markers that
    restate it. `ConfigError` (the caller adds file and entry) says what is wrong and how to fix it.
    An arm this module does not know is left to the arm registry's own check."""
    bound = KvBound.parse(kv_bound)
    if arm not in LAUNCH_KEYS:
        return bound
    known = LAUNCH_KEYS[arm] | COMMON_LAUNCH_KEYS
    for key in sorted(set(launch) - known):
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"
        raise ConfigError(f"launch key {key!r} is not read by the {arm} arm; {hint}")
    engine = engine_of(arm, parse_launch(arm, launch))
    what = f"the {arm} arm" if arm != "dynamo" else f"dynamo's {engine} engine"
    if engine not in UNBOUNDED_ENGINES:
        unit = KV_FLAGS[engine].unit
        for other in bound.as_dict():
            if other != unit:
                raise ConfigError(
                    f"kv_bound.{other} is not read by {what}, which bounds its KV cache in {unit} "
                    f"({KV_FLAGS[engine].flag}): write kv_bound = {{ {unit} = N }}"
                )
    for text in markers:
        use = parse_marker_use(text)
        unit_of_marker = RESTATING_MARKERS.get(use.name)
        if unit_of_marker is None or not use.args:
            continue
        value = bound.get(unit_of_marker)
        if value is None:
            raise ConfigError(
                f"marker {text} restates kv_bound.{unit_of_marker}, which the case does not set: add "
                f"kv_bound = {{ {unit_of_marker} = {use.args[0]} }} or drop the marker"
            )
        if use.args[0] != value:
            raise ConfigError(
                f"marker {text} says {use.args[0]} but kv_bound.{unit_of_marker} is {value}: "
                f"write {use.name}({value}) (the engine is launched with the bound)"
            )
    return bound


# The arms the registry (`matrix.launch.arms`) holds, and those that can also launch their deployment
# aggregated (`AggregatedArm`, the baseline of `launch.equivalence`): the arm table's, re-exported so that
# catalog sync checks a case's arm without importing the arms; a unit test keeps these equal to the registry.
AGGREGATED_ARMS = _arm_table.AGGREGATED_ARMS
ARMS = _arm_table.ARMS

# `launch.equivalence` keys and their defaults: K prompts of T greedy tokens, the near-tie threshold (nats
# between the aggregated run's top-1 and top-2 logprobs) and the engines' seed.
EQUIVALENCE_DEFAULTS: dict[str, int | float] = {
    "prompts": 16,
    "tokens": 64,
    "near_tie_gap": DEFAULT_NEAR_TIE_GAP,
    "seed": 0,
}


def check_equivalence(name: str, raw: object) -> dict[str, int | float] | None:
    """The case's `launch.equivalence` value `raw` (true, or a table of `EQUIVALENCE_DEFAULTS` keys), checked;
    None when the case does not opt in. Raises ConfigError naming the bad key and the fix. Catalog sync checks
    it from a case's name and typed launch table; the arms read it through `equivalence_options`."""
    where = f"case {name}: launch.equivalence"
    options = table_option(where, raw, EQUIVALENCE_DEFAULTS)
    if options is None:
        return None
    for key in ("prompts", "tokens"):
        value = options[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
            raise ConfigError(f"{where}.{key} must be an integer from 1 to 4096, got {value!r}")
    gap = options["near_tie_gap"]
    if isinstance(gap, bool) or not isinstance(gap, int | float) or not gap >= 0:
        raise ConfigError(f"{where}.near_tie_gap must be a number >= 0 (nats), got {gap!r}")
    seed = options["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"{where}.seed must be an integer >= 0, got {seed!r}")
    return options
