"""The explicit arm registry: a case names its arm; an unknown name fails before anything starts.

What each arm is (its launch table, engines, memory facts, aggregated and shared-engine abilities, proxy
protocol) is its row in `matrix.arm_table`; this module holds only the code of each row's arm, and refuses at
import a registry whose names are not the rows'.
"""

from __future__ import annotations

from matrix.arm_table import ARMS
from matrix.errors import ConfigError
from matrix.launch.arms.base import Arm
from matrix.launch.arms.dynamo import DynamoArm
from matrix.launch.arms.reference import ReferenceArm
from matrix.launch.arms.sglang_native import SglangNativeArm
from matrix.launch.arms.vllm_native import VllmNativeArm

# The code of each arm of `arm_table.ARM_ROWS` (one line per arm).
_ARM_TYPES: dict[str, type[Arm]] = {
    "reference": ReferenceArm,
    "dynamo": DynamoArm,
    "vllm_native": VllmNativeArm,
    "sglang_native": SglangNativeArm,
}
if set(_ARM_TYPES) != ARMS:
    raise RuntimeError(f"the arm registry {sorted(_ARM_TYPES)} is not the arm table's {sorted(ARMS)}")


def _registry() -> dict[str, Arm]:
    return {name: arm_type() for name, arm_type in _ARM_TYPES.items()}


def known_arms() -> frozenset[str]:
    return ARMS


def get_arm(name: str) -> Arm:
    arms = _registry()
    if name not in arms:
        raise ConfigError(f"unknown arm {name!r}; known arms: {', '.join(sorted(arms))}")
    return arms[name]
