"""One row per arm: what an arm *is*, as data, for every stage that must know it without the arm's code.

A row names the arm, its typed launch table (`case_launch`), the engines a case of it may run (and the
engine table's entry for each, `matrix.engines`), whether it can also launch aggregated (the baseline of
`launch.equivalence`), whether its decode serves any prefill (a skew grid then shares engines), the
protocol matrix's P/D proxy speaks for it, and the two memory facts the scheduler needs (`runs_on_cpu`,
`absolute_memory`), which `CaseInfo` computes from the row when a case is made. Every other table of arms
derives from `ARM_ROWS`: the arm registry (`matrix.launch.arms`, which holds the code and checks its names
against these), `LAUNCH_TYPES`, `ARMS` and `AGGREGATED_ARMS` (`matrix.launch.options`, catalog sync),
`SHARED_ENGINE_ARMS` (`matrix.executors.shared_engines`) and `PROTOCOLS` (`matrix.pdproxy`).

A leaf: it imports only other leaves, so the catalog, the planner, the cell and launch all read it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from matrix.case_launch import (
    CommonLaunch,
    DynamoLaunch,
    ReferenceLaunch,
    SglangNativeLaunch,
    VllmNativeLaunch,
    parse_typed,
)
from matrix.engines import ENGINES, UNBOUNDED_ENGINES, Engine
from matrix.errors import ConfigError
from matrix.kv_bound import KvBound


def _always(launch: CommonLaunch) -> bool:
    return True


@dataclass(frozen=True)
class ArmRow:
    """What one arm is. `engines[0]` is the engine of a case that names none (`launch.engine`, read only
    where there is more than one); `entries` maps an engine to its entry in `ENGINES` where the names differ.
    `cpu(launch, engine)` says whether a case runs on a host without GPUs; `vouched(launch)` whether matrix
    starts the engines itself (a launch script may start them any way it likes: then no memory bound is
    vouched for)."""

    name: str
    launch_type: type[CommonLaunch]
    engines: tuple[str, ...]
    cpu: Callable[[CommonLaunch, str], bool]
    aggregated: bool = False
    shared_engines: bool = False
    protocol: str | None = None
    entries: Mapping[str, str] = field(default_factory=dict)
    vouched: Callable[[CommonLaunch], bool] = _always

    def engine_of(self, launch: CommonLaunch) -> str:
        """The engine a case of this arm runs; ConfigError for one the arm does not run."""
        if len(self.engines) == 1:
            return self.engines[0]
        engine = launch.engine if launch.engine is not None else self.engines[0]
        if engine not in self.engines:
            known = ", ".join(self.engines)
            raise ConfigError(f"launch.engine {engine!r} is not a {self.name} engine; write one of {known}")
        return engine

    def entry(self, engine: str) -> Engine | None:
        """The engine table's entry for `engine` under this arm (None: an engine with no real cache)."""
        return ENGINES.get(self.entries.get(engine, engine))

    def absolute_memory(self, bound: KvBound, launch: CommonLaunch) -> bool:
        """Every instance's GPU memory is bounded absolutely (KV bytes or tokens with a tiny utilisation
        fraction), not sized from what is free: then its start-up may overlap others."""
        if not self.vouched(launch):
            return False
        engine = self.engine_of(launch)
        if engine in UNBOUNDED_ENGINES:
            return True  # no GPU memory at all
        entry = self.entry(engine)
        return entry is not None and entry.absolute_memory(bound, launch)

    def runs_on_cpu(self, launch: CommonLaunch) -> bool:
        return self.cpu(launch, self.engine_of(launch))


def _gpu_only(launch: CommonLaunch, engine: str) -> bool:
    return False


def _reference_cpu(launch: CommonLaunch, engine: str) -> bool:
    device: object = getattr(launch, "device", None)
    return device is None or device == "cpu"  # the reference server's default device is the CPU


def _flag_cpu(launch: CommonLaunch, engine: str) -> bool:
    return bool(getattr(launch, "cpu", None))


def _dynamo_cpu(launch: CommonLaunch, engine: str) -> bool:
    # The mocker needs no device; of the real engines only vLLM has a CPU build.
    return engine == "mocker" or (engine == "vllm" and _flag_cpu(launch, engine))


def _dynamo_vouched(launch: CommonLaunch) -> bool:
    # A `script` always runs and may start the engines any way it likes. A `workspace_script` runs only under
    # `matrix run --workspace`, so the run decides that one (`workspace_unvouched`): without the option matrix
    # starts the engines itself, with the case's bounds.
    return not getattr(launch, "script", None)


def workspace_unvouched(launch: CommonLaunch, workspace: object) -> bool:
    """Whether this run hands the case's engines to an upstream launch script (`launch.workspace_script`
    with `--workspace`), which matrix cannot vouch bounds its memory: then its start-up runs alone."""
    return workspace is not None and bool(getattr(launch, "workspace_script", None))


ARM_ROWS: dict[str, ArmRow] = {
    row.name: row
    for row in (
        ArmRow("reference", ReferenceLaunch, ("reference",), _reference_cpu, aggregated=True),
        ArmRow(
            "vllm_native",
            VllmNativeLaunch,
            ("vllm",),
            _flag_cpu,
            aggregated=True,
            # NIXL's kv_transfer_params name the prefill's engine id and side channel: decode serves any peer.
            shared_engines=True,
            protocol="vllm",
        ),
        ArmRow("sglang_native", SglangNativeLaunch, ("sglang",), _gpu_only, protocol="sglang"),
        ArmRow(
            "dynamo",
            DynamoLaunch,
            ("mocker", "vllm", "sglang", "trtllm"),
            _dynamo_cpu,
            # Two engines and Dynamo's own processes share the GPU: vLLM gets its own smaller default fraction.
            entries={"vllm": "dynamo-vllm"},
            vouched=_dynamo_vouched,
        ),
    )
}

LAUNCH_TYPES: dict[str, type[CommonLaunch]] = {name: row.launch_type for name, row in ARM_ROWS.items()}
ARMS = frozenset(ARM_ROWS)
# The arms that can also launch their deployment aggregated (`AggregatedArm`).
AGGREGATED_ARMS = frozenset(name for name, row in ARM_ROWS.items() if row.aggregated)
# The arms whose grid shares one engine per (role, runtime) among its pairs.
SHARED_ENGINE_ARMS = frozenset(name for name, row in ARM_ROWS.items() if row.shared_engines)
# The protocols matrix's P/D proxy speaks, in row order (the first is its default).
PROTOCOLS = tuple(dict.fromkeys(row.protocol for row in ARM_ROWS.values() if row.protocol is not None))


def parse_launch(arm: str, launch: Mapping[str, Any]) -> CommonLaunch:
    """`launch` as `arm`'s typed table (`case_launch.parse_typed` with the row's dataclass)."""
    return parse_typed(arm, LAUNCH_TYPES[arm], launch)


def memory_facts(arm: str, bound: KvBound, launch: CommonLaunch) -> tuple[bool, bool]:
    """(runs_on_cpu, absolute_memory) of a case, from its arm's row. An arm or engine no row knows gets
    (False, False), the cautious answer (a GPU slot, start-ups one at a time): the runner fails such a cell
    with the arm registry's or the row's own ConfigError, and catalog sync refuses it before."""
    row = ARM_ROWS.get(arm)
    if row is None:
        return False, False
    try:
        return row.runs_on_cpu(launch), row.absolute_memory(bound, launch)
    except ConfigError:
        return False, False
