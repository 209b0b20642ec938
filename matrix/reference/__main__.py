"""Command line: `python -m matrix.reference worker ...` or `python -m matrix.reference frontend ...`."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Sequence

from matrix.reference.faults import FAULTS_ENV, UnknownFaultError, known_faults_text, resolve_faults


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 1..65535, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    epilog = f"faults (also from ${FAULTS_ENV}, comma-separated):\n{known_faults_text()}"
    parser = argparse.ArgumentParser(
        prog="python -m matrix.reference",
        description="Reference disaggregated server: one frontend in front of prefill and decode worker processes.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    raw = argparse.RawDescriptionHelpFormatter
    worker = sub.add_parser("worker", help="a prefill or decode worker", epilog=epilog, formatter_class=raw)
    worker.add_argument("--role", required=True, choices=["prefill", "decode", "aggregated"])
    worker.add_argument("--port", required=True, type=_port, help="HTTP port")
    worker.add_argument("--side-channel-port", required=True, type=_port, help="KV side-channel TCP port")
    worker.add_argument("--kv-cache-bytes", required=True, type=_positive_int, help="size of the KV pool")
    worker.add_argument("--block-bytes", type=_positive_int, default=64, help="bytes per KV block (one token)")
    worker.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the KV pool lives")
    worker.add_argument("--fault", action="append", default=[], metavar="NAME", help="inject a fault")
    worker.add_argument("--slow-start-s", type=_non_negative_float, default=3.0, help="delay for slow-start")
    worker.add_argument(
        "--token-delay-ms", type=_non_negative_float, default=0.0, help="decode time per generated token"
    )
    worker.add_argument(
        "--kv-ttl-s",
        type=_non_negative_float,
        default=60.0,
        help="seconds unpulled KV blocks stay in the pool",
    )

    front = sub.add_parser("frontend", help="the OpenAI-style frontend", epilog=epilog, formatter_class=raw)
    front.add_argument("--port", required=True, type=_port, help="HTTP port")
    front.add_argument(
        "--prefill-url", action="append", help="http://127.0.0.1:PORT of a prefill worker (repeat for several)"
    )
    front.add_argument(
        "--decode-url", action="append", help="http://127.0.0.1:PORT of a decode worker (repeat for several)"
    )
    front.add_argument(
        "--aggregated-url", help="instead of the two: http://127.0.0.1:PORT of one worker with --role aggregated"
    )
    front.add_argument("--model", required=True, help="the model name served")
    front.add_argument("--fault", action="append", default=[], metavar="NAME", help="inject a fault")
    front.add_argument("--max-body-bytes", type=_positive_int, default=1 << 20, help="request body limit")
    front.add_argument(
        "--worker-timeout-s", type=_positive_float, default=60.0, help="timeout of each call to a worker"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        faults = resolve_faults(args.fault, os.environ)
    except UnknownFaultError as exc:
        parser.error(str(exc))  # exits 2

    if args.command == "worker":
        if args.kv_cache_bytes < args.block_bytes:
            parser.error(f"--kv-cache-bytes ({args.kv_cache_bytes}) is smaller than one block ({args.block_bytes})")
        # Imported here so `--help` and argument errors stay instant.
        from matrix.reference.worker import WorkerConfig, run_worker

        return run_worker(
            WorkerConfig(
                role=args.role,
                port=args.port,
                side_channel_port=args.side_channel_port,
                kv_cache_bytes=args.kv_cache_bytes,
                block_bytes=args.block_bytes,
                device=args.device,
                faults=faults,
                slow_start_s=args.slow_start_s,
                kv_ttl_s=args.kv_ttl_s,
                token_delay_s=args.token_delay_ms / 1000,
            )
        )

    from matrix.reference.frontend import FrontendConfig, parse_upstream, run_frontend

    pair = args.prefill_url is not None and args.decode_url is not None
    if pair == (args.aggregated_url is not None) or (not pair and (args.prefill_url or args.decode_url)):
        parser.error("give --prefill-url and --decode-url, or --aggregated-url alone")
    try:
        if pair:
            prefills = tuple(parse_upstream("prefill", url) for url in args.prefill_url)
            decodes = tuple(parse_upstream("decode", url) for url in args.decode_url)
        else:
            prefills = decodes = (parse_upstream("aggregated", args.aggregated_url),)
    except ValueError as exc:
        parser.error(str(exc))
    return run_frontend(
        FrontendConfig(
            port=args.port,
            prefills=prefills,
            decodes=decodes,
            model=args.model,
            faults=faults,
            max_body_bytes=args.max_body_bytes,
            worker_timeout_s=args.worker_timeout_s,
        )
    )


if __name__ == "__main__":
    try:
        code = main()
    finally:
        # Its pool and sockets are closed by now: what is left goes to the OS without the GC walking it
        # while the interpreter shuts down, which was half of the time between SIGTERM and the exit.
        gc.freeze()
    sys.exit(code)
