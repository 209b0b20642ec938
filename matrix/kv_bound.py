"""A case's absolute bound on each instance's KV cache (`kv_bound = { bytes = N }` and/or `{ tokens = N }`).

One typed value from the catalog entry to the engine flag: `matrix catalog sync` parses it (refusing any
other shape with the fix), the planner carries it on `CaseInfo`, the scheduler sizes GPU memory from it and
the arms pass it to the engines (`matrix.launch.options.kv_arg`). A leaf module: it imports nothing of the
planner or the launch machinery, so every stage may use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from matrix.errors import ConfigError

KvUnit = Literal["bytes", "tokens"]
KV_UNITS: tuple[str, ...] = get_args(KvUnit)


@dataclass(frozen=True)
class KvBound:
    """An absolute bound on each instance's KV cache, in bytes and/or tokens (`kv_bound = { bytes = N }`)."""

    bytes: int | None = None
    tokens: int | None = None

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> KvBound:
        """The bound a catalog entry writes; `ConfigError` naming the fix for anything else."""
        unknown = sorted(set(raw) - set(KV_UNITS))
        values = [raw[unit] for unit in KV_UNITS if unit in raw]
        if unknown or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            raise ConfigError(f"kv_bound must be {{bytes = N}} and/or {{tokens = N}} with N > 0, got {dict(raw)!r}")
        return cls(bytes=raw.get("bytes"), tokens=raw.get("tokens"))

    def __bool__(self) -> bool:
        """True when the bound bounds anything (a case without `kv_bound` has the empty one)."""
        return self.bytes is not None or self.tokens is not None

    def get(self, unit: str) -> int | None:
        value: int | None = getattr(self, unit)
        return value

    def as_dict(self) -> dict[str, int]:
        """The stored shape (`case.kv_bound`, JSON): only the units given."""
        return {unit: value for unit in KV_UNITS if (value := self.get(unit)) is not None}
