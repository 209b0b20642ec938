"""The KV fault classes ([M28]): those of matrix's vLLM fault plugin, the one matrix makes at launch
(`model_revision`), and the grammar of a case's `kv_fault` value.

A leaf: the launch side (which role loads the plugin), the runner's judgement (`matrix.check.faults`), the
fault grids (`matrix.executors.fault_grid`) and the detection table (`matrix.report.detection`) read the same
vocabulary. The plugin itself (matrix/tools/vllm_kv_faults) runs inside the engine and imports nothing of
matrix, so it carries its own copy of its names; `tests/unit/test_kv_faults.py` keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass

from matrix.errors import ConfigError

__all__ = ["CLASSES", "DEFAULT_ROLE", "LAUNCH_CLASSES", "MODEL_REVISION", "NONE", "PLUGIN_CLASSES", "FaultSpec",
           "parse"]  # fmt: skip

# The classes the plugin knows (matrix/tools/vllm_kv_faults), with the role each acts on by default.
PLUGIN_ROLE = {
    "bit_flip": "decode",
    "stale": "decode",
    "off_by_one": "decode",
    "drop_last": "decode",
    "never_complete": "decode",
    "lost_notification": "prefill",
    "swap": "decode",
}
PLUGIN_CLASSES = tuple(PLUGIN_ROLE)
# A class matrix injects when it launches the role, not inside the engine: the role loads another revision
# of the model (same architecture and tokenizer, other weights), which NIXL's handshake does not compare.
# Its engines are made differently: its cells share a pair only with the repeats of their own case.
MODEL_REVISION = "model_revision"
LAUNCH_CLASSES = (MODEL_REVISION,)
DEFAULT_ROLE = {**PLUGIN_ROLE, MODEL_REVISION: "decode"}
CLASSES = tuple(DEFAULT_ROLE)
# `kv_fault = "none"`: the healthy twin of fault cells (the detection table's A/A cells): no fault anywhere,
# but the case is part of the table, and it shares a fault grid's pair with the cases of its engines.
NONE = "none"


@dataclass(frozen=True)
class FaultSpec:
    fault: str
    role: str


def parse(spec: str, roles: tuple[str, ...] = ("prefill", "decode")) -> FaultSpec:
    """`CLASS` or `CLASS:ROLE` -> FaultSpec (`none`: the healthy twin, on no role); a wrong name is a one-line
    config error naming the known ones."""
    fault, _, role = spec.partition(":")
    if fault == NONE and not role:
        return FaultSpec(NONE, "")
    if fault not in DEFAULT_ROLE:
        raise ConfigError(f"kv_fault {spec!r}: unknown fault class {fault!r}; known: {', '.join(CLASSES)}, "
                          f"or {NONE!r} (the healthy twin)")  # fmt: skip
    role = role or DEFAULT_ROLE[fault]
    if role not in roles:
        raise ConfigError(f"kv_fault {spec!r}: unknown role {role!r}; known: {', '.join(roles)}")
    return FaultSpec(fault, role)
