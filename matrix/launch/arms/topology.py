"""The workers of an xPyD topology ([M27]), named alike on every arm that launches one."""

from __future__ import annotations

from matrix.case_launch import topology_counts


def worker_names(topology: str | None) -> tuple[str, ...]:
    """The workers of `topology`, prefills first: "prefill", "decode", then "prefill_2", "decode_2"... (the first
    of each role keeps the 1P1D pair's names, so its ports, logs and checks stay as they were)."""
    prefills, decodes = topology_counts(topology)
    more = [f"prefill_{i}" for i in range(2, prefills + 1)] + [f"decode_{i}" for i in range(2, decodes + 1)]
    return ("prefill", "decode", *more)


def role_of(name: str) -> str:
    """A worker's role: "prefill_2" -> "prefill"."""
    return name.split("_")[0]
