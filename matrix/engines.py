"""The engine table: how each engine takes its KV bound and its memory fraction, and their defaults.

One entry per engine program: the flag (or variable) that carries the KV bound and its unit, the default
bound a plan passes when the case sets none, the flag and launch key of the engine's memory fraction and
its default. The arms build their engine flags from an entry (`kv_arg`, `fraction_argv`), the scheduler's
`absolute_memory` is derived from it, and `matrix catalog sync` checks a case's bound against its unit, so
what is checked is what is launched.

Which arm runs which engine, and under which entry, is the arm table's (`matrix.arm_table`). A leaf: it
imports only other leaves, so the catalog, the cell and the arms read the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

from matrix.case_launch import CommonLaunch
from matrix.kv_bound import KvBound, KvUnit

# The most of a GPU's memory an engine's utilisation fraction may claim for its start-up to count as bounded
# absolutely: vLLM checks `--gpu-memory-utilization` x total against free memory before its byte cap, and
# SGLang's `--mem-fraction-static` is the share its weights and pool may take; tiny ones never decide.
TINY_MEMORY_FRACTION = 0.1


def tiny_fraction(value: object) -> bool:
    try:
        return 0 < float(str(value)) <= TINY_MEMORY_FRACTION
    except ValueError:
        return False


@dataclass(frozen=True)
class MemoryFraction:
    """An engine's share-of-memory flag, the case's launch key that overrides it, and its default."""

    flag: str
    launch_key: str
    default: float


@dataclass(frozen=True)
class Engine:
    """How one engine takes its KV bound (`unit`, `kv_flag`, `default_kv` when the case sets none) and its
    memory fraction (None: the engine has none; its KV bound alone sizes it)."""

    name: str
    unit: KvUnit
    kv_flag: str
    default_kv: int | None = None
    fraction: MemoryFraction | None = None
    # False: matrix does not start this engine itself (a launch script does), so its memory never counts as
    # bounded absolutely whatever the case's bound says.
    memory_vouched: bool = True
    # True: the engine's start-up compares the GPU memory free before and after it loads its weights against
    # its fraction, so another start-up allocating meanwhile can fail it however small its own bound is. Its
    # memory is bounded, but its start-up must not overlap others (`absolute_memory` is False).
    startup_reads_free_memory: bool = False

    @property
    def flag(self) -> str:
        return self.kv_flag

    def kv_arg(self, bound: KvBound, default: int | None = None) -> tuple[str, int] | None:
        """(flag, value) from the case's bound, else `default`; None when there is neither."""
        value = bound.get(self.unit)
        value = default if value is None else value
        return None if value is None else (self.kv_flag, value)

    def kv_argv(self, bound: KvBound) -> list[str]:
        """The KV flag and its value: the case's bound, else the engine's default bound."""
        arg = self.kv_arg(bound, self.default_kv)
        return [] if arg is None else [arg[0], str(arg[1])]

    def fraction_value(self, launch: CommonLaunch) -> object:
        assert self.fraction is not None, f"{self.name} has no memory fraction"
        # The field is named by this entry (each engine reads its own key); an arm's table without it, or a
        # field left None, takes the engine's default.
        value = getattr(launch, self.fraction.launch_key, None)
        return self.fraction.default if value is None else value

    def fraction_argv(self, launch: CommonLaunch) -> list[str]:
        """The memory-fraction flag and its value (the case's launch key, else the default)."""
        if self.fraction is None:
            return []
        return [self.fraction.flag, str(self.fraction_value(launch))]

    def absolute_memory(self, bound: KvBound, launch: CommonLaunch) -> bool:
        """The case bounds this engine's memory absolutely: a KV bound in its unit and, where the engine has a
        memory fraction, a tiny one (else the fraction, sized from free memory, decides)."""
        if not self.memory_vouched or self.startup_reads_free_memory or bound.get(self.unit) is None:
            return False
        return self.fraction is None or tiny_fraction(self.fraction_value(launch))


_VLLM_UTILIZATION = "--gpu-memory-utilization"
# vLLM on a CPU host (or a case without a bound) gets 256 MiB of KV cache.
VLLM_DEFAULT_KV_BYTES = 268_435_456

ENGINES: dict[str, Engine] = {
    "reference": Engine("reference", "bytes", "--kv-cache-bytes", default_kv=8 * 1024 * 1024),
    # vLLM's own P/D pair (`vllm_native`): the fraction must be tiny too, vLLM checks it before the byte cap.
    "vllm": Engine(
        "vllm",
        "bytes",
        "--kv-cache-memory-bytes",
        default_kv=VLLM_DEFAULT_KV_BYTES,
        fraction=MemoryFraction(_VLLM_UTILIZATION, "gpu_memory_utilization", 0.02),
    ),
    # vLLM under Dynamo (`vllm-rs` engines, or an upstream launch script): two engines and Dynamo's own
    # processes share the GPU, so the default fraction is smaller.
    "dynamo-vllm": Engine(
        "dynamo-vllm",
        "bytes",
        "--kv-cache-memory-bytes",
        default_kv=VLLM_DEFAULT_KV_BYTES,
        fraction=MemoryFraction(_VLLM_UTILIZATION, "gpu_memory_utilization", 0.01),
    ),
    "sglang": Engine(
        "sglang",
        "tokens",
        "--max-total-tokens",
        default_kv=2048,
        fraction=MemoryFraction("--mem-fraction-static", "mem_fraction_static", 0.05),
        # SGLang 0.5.18-0.5.21 refuse to start ("Loaded weights leave no GPU memory for the KV cache under
        # --mem-fraction-static=0.05 ... minimum viable = 1 - available/pre") when other engines allocate
        # during their weight load: seen on an 80 GB H100 with 12 packed start-ups (5 % = 4 GB of headroom),
        # though the 2048-token pool needs a few MiB.
        startup_reads_free_memory=True,
    ),
    # TensorRT-LLM reads it from its engine config (kv_cache_config.max_tokens), which the launch script
    # writes from this variable; matrix starts it through that script only, so its memory is not vouched for.
    "trtllm": Engine("trtllm", "tokens", "TRTLLM_KV_MAX_TOKENS", memory_vouched=False),
}
# Dynamo's mocker has no real cache: a bound in either unit only sizes the scheduler's memory estimate.
UNBOUNDED_ENGINES = frozenset({"mocker"})
