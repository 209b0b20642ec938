"""The explicit arm registry: a case names its arm; an unknown name fails before anything starts."""

from __future__ import annotations

from matrix.errors import ConfigError
from matrix.launch.arms.base import Arm
from matrix.launch.arms.dynamo import DynamoArm
from matrix.launch.arms.reference import ReferenceArm
from matrix.launch.arms.sglang_native import SglangNativeArm
from matrix.launch.arms.vllm_native import VllmNativeArm


def _registry() -> dict[str, Arm]:
    return {
        "reference": ReferenceArm(),
        "dynamo": DynamoArm(),
        "vllm_native": VllmNativeArm(),
        "sglang_native": SglangNativeArm(),
    }


def known_arms() -> frozenset[str]:
    return frozenset(_registry())


def get_arm(name: str) -> Arm:
    arms = _registry()
    if name not in arms:
        raise ConfigError(f"unknown arm {name!r}; known arms: {', '.join(sorted(arms))}")
    return arms[name]
