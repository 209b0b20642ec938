"""The equivalence oracle's aggregated answers, kept for the rest of a campaign and reused by every later pair
whose aggregated instance would be the very same process.

In a skew grid every pair that passes is compared with one aggregated instance of its decode side's runtime.
With N runtimes that is up to N^2 start-ups of an instance whose answers depend only on what it runs: the
same interpreter, argv and environment, asked the same greedy prompts, answers the same token ids (that is the
oracle's own premise: a deterministic engine with a fixed seed). So the answers are keyed by the instance's
launch plan made with placeholder ports, cell id and directory, and the oracle's prompt options; a pair
whose key was seen reuses the answers, and its row names the pair whose instance produced them. Anything
that differs (another runtime, a role override of decode, other prompts or CPU binding) is another key.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from matrix.check import oracle
from matrix.check.specs import OracleSpec

# What the key's plan is made with instead of the pair's own values: none of them reaches an answer.
PLACEHOLDER_DIR = Path("/matrix-baseline-key")
PLACEHOLDER_CELL = "baseline-key"


@dataclass(frozen=True)
class Baseline:
    """The aggregated instance's answers to the oracle's prompts, and where and how fast they were made."""

    answers: tuple[oracle.Completion | str, ...]
    source_cell: str
    aggregated_s: float
    ready_s: float | None

    @property
    def complete(self) -> bool:
        """Every prompt answered: only such a baseline is kept for later pairs (an unanswered prompt is the
        pair's own finding, and the next pair's instance may answer it)."""
        return all(isinstance(a, oracle.Completion) for a in self.answers)


# One process of the aggregated instance's plan: (role, argv, environment).
ProcessLaunch = tuple[str, Iterable[str], Mapping[str, str]]


def baseline_key(processes: Iterable[ProcessLaunch], python: str, spec: OracleSpec) -> str:
    """What makes two aggregated instances the same: each process's role, argv and environment (of the plan
    made with placeholders), the interpreter, and the prompt options (the endpoint's address left out)."""
    launched = [[role, list(argv), sorted(env.items())] for role, argv, env in processes]
    options = replace(spec, url="", timeout_s=0.0)
    return json.dumps([python, launched, repr(options)], sort_keys=True)


class OracleBaselines:
    """Answers per key for one campaign. `get_or_make` runs `make` once per key; a concurrent caller with the
    same key waits for it. A `make` that returns None (the instance failed) stores nothing, so the next pair
    tries again and records its own failure."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: dict[str, Baseline] = {}
        self._making: dict[str, threading.Lock] = {}

    def get_or_make(self, key: str, make: Callable[[], Baseline | None]) -> tuple[Baseline | None, bool]:
        """(the baseline, whether it was reused) for `key`."""
        with self._lock:
            if key in self._made:
                return self._made[key], True
            making = self._making.setdefault(key, threading.Lock())
        with making:
            with self._lock:
                if key in self._made:
                    return self._made[key], True
            made = make()
            if made is not None:
                with self._lock:
                    self._made[key] = made
            return made, False
