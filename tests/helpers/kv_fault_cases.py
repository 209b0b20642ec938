"""The KV fault cases of the engine test and the benchmarks ([M28]): vLLM's NIXL pair on CPU with the
equivalence oracle on, one case per fault class plus healthy twins (`kv_fault = "none"`). Written by the
tests, never into data/, so a plain `matrix run --backend vllm-cpu` runs no fault cell."""

from __future__ import annotations

HEALTHY = "none"


def case_name(fault: str) -> str:
    return f"vllm_kv_fault_{fault}_cpu"


def cases_toml(faults: tuple[str, ...], twins: int = 1) -> str:
    """One case per class of `faults` and `twins` healthy twins (`none`, `none_2`, ...), identical but for
    `kv_fault`, so one fault grid serves them all: the oracle at 8 prompts x 32 token ids; a request
    unanswered in 90 s is a hang (never_complete)."""
    names = [(HEALTHY if i == 0 else f"{HEALTHY}_{i + 1}", HEALTHY) for i in range(twins)]
    entries = []
    for name, fault in (*names, *((f, f) for f in faults)):
        entries.append(
            f'[[case]]\nname = "{case_name(name)}"\nbackend = "vllm-cpu"\narm = "vllm_native"\n'
            f'model = "matrix-tiny-random"\ndescription = "KV fault {fault} in the NIXL pair on CPU."\n'
            'markers = ["e2e", "vllm", "gpu_0"]\nkv_bound = { bytes = 268435456 }\nstartup_timeout_s = 300\n'
            'request_timeout_s = 90\nlaunch = { cpu = true, model_dir = "tiny-random", max_model_len = 512, '
            "orphan_decode = false, equivalence = { prompts = 8, tokens = 32, near_tie_gap = 0.1 }, "
            f'kv_fault = "{fault}" }}\n'
        )
    return "\n".join(entries)
