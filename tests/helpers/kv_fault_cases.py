"""The KV fault cases of the engine test and the benchmarks ([M28]): vLLM's NIXL pair on CPU with the
equivalence oracle on, one case per fault class plus healthy twins (`kv_fault = "none"`). Written by the
tests, never into data/, so a plain `matrix run --backend vllm-cpu` runs no fault cell."""

from __future__ import annotations

from dataclasses import dataclass

HEALTHY = "none"


# The classes that need concurrent requests to fire (two transfers done in one step): their cases carry a
# traffic table, 8 streams x 3 rounds, and decode's prefix cache off, so a block a fault corrupted is never
# served from the cache to a later cell of the same grid (the traffic prompts fill whole blocks).
TRAFFIC_CLASSES = ("swap",)
TRAFFIC = ('traffic = { streams = 8, rounds = 3, shared_prefix_tokens = 16, max_prompt_tokens = 64, '
           'stream = "mixed", logprobs = 2, bound_s = 120, request_seeds = false }\n')  # fmt: skip


def case_name(fault: str, traffic: bool = False) -> str:
    return f"vllm_kv_fault_{fault}{'_traffic' if traffic else ''}_cpu"


def cases_toml(faults: tuple[str, ...], twins: int = 1, traffic: bool = False) -> str:
    """One case per class of `faults` and `twins` healthy twins (`none`, `none_2`, ...), identical but for
    `kv_fault`, so one fault grid serves them all: the oracle at 8 prompts x 32 token ids; a request
    unanswered in 90 s is a hang (never_complete). `traffic`: the cases also carry the traffic table above
    (their own grid: another case identity)."""
    names = [(HEALTHY if i == 0 else f"{HEALTHY}_{i + 1}", HEALTHY) for i in range(twins)]
    no_prefix_cache = 'extra_args = ["--no-enable-prefix-caching"], ' if traffic else ""
    entries = []
    for name, fault in (*names, *((f, f) for f in faults)):
        entries.append(
            f'[[case]]\nname = "{case_name(name, traffic)}"\nbackend = "vllm-cpu"\narm = "vllm_native"\n'
            f'model = "matrix-tiny-random"\ndescription = "KV fault {fault} in the NIXL pair on CPU."\n'
            'markers = ["e2e", "vllm", "gpu_0"]\nkv_bound = { bytes = 268435456 }\nstartup_timeout_s = 300\n'
            'request_timeout_s = 90\nlaunch = { cpu = true, model_dir = "tiny-random", max_model_len = 512, '
            f"orphan_decode = false, {no_prefix_cache}equivalence = {{ prompts = 8, tokens = 32, "
            f'near_tie_gap = 0.1 }}, kv_fault = "{fault}" }}\n' + (TRAFFIC if traffic else "")
        )
    return "\n".join(entries)


@dataclass(frozen=True)
class Control:
    """The fast suite's guard of one check that caught a KV fault class in a real engine ([M28] item 4): a
    reference-server fault that fails the check (the positive control) and the healthy reference pair that
    passes it (the negative one), each a fast test (`path::name`). A change that blinds the check fails CI
    in minutes, long before an engine test would run."""

    check: str
    fault: str
    positive: str
    negative: str


_RUN = "tests/e2e/test_run_reference.py"
_ORACLE = "tests/e2e/test_equivalence_oracle.py"
_TRAFFIC = "tests/e2e/test_traffic_reference.py"
_PLANTED = f"{_RUN}::test_planted_fault_is_caught_and_leaves_nothing"
_HEALTHY = f"{_RUN}::test_healthy_reference_pair_passes_every_check"
_NONBLANK = Control("content_nonblank", "empty-completion", _PLANTED, _HEALTHY)
_ORACLE_CONTROL = Control(
    "equivalent_to_aggregated",
    "kv-corrupt-after-checksum",
    f"{_ORACLE}::test_kv_corrupted_after_the_checksum_fails_only_the_oracle",
    f"{_ORACLE}::test_a_healthy_pair_is_token_identical_to_aggregated",
)
_TIMEOUT = Control("request", "kv-transfer-stall", _PLANTED, _HEALTHY)
_RELEASE = Control(
    "kv_released_after_answer",
    "kv-read-report-lost",
    f"{_RUN}::test_lifecycle_faults_fail_exactly_their_check",
    f"{_RUN}::test_healthy_pair_streams_cancels_and_releases_an_orphaned_decode",
)
_DIVERGENCE = Control(
    "traffic_divergence",
    "kv-corrupt-after-checksum",
    f"{_TRAFFIC}::test_streams_answered_wrong_but_by_no_other_prompt_fail_as_a_divergence",
    f"{_TRAFFIC}::test_a_healthy_pair_serves_every_stream_its_own_answer",
)
# class -> the checks that caught it on vLLM (docs/results/detection.md: CPU float32 and CUDA bfloat16), each
# with its reference controls.
REFERENCE_CONTROLS: dict[str, tuple[Control, ...]] = {
    "bit_flip": (_NONBLANK, _ORACLE_CONTROL),  # blank answers on CPU; readable wrong ones on CUDA
    "stale": (_ORACLE_CONTROL,),
    "off_by_one": (_ORACLE_CONTROL,),
    "drop_last": (_ORACLE_CONTROL, _NONBLANK),  # blank after a bit_flip cell left its blocks flipped
    "never_complete": (_TIMEOUT,),
    "lost_notification": (_RELEASE,),
    "swap": (_DIVERGENCE,),
    "model_revision": (_ORACLE_CONTROL,),
}
