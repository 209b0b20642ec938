"""`matrix show` for people: one attempt as the runtime page shows it (units, words, no Python reprs).

The input is `matrix.results.describe_cell`'s mapping, already redacted and made printable; `--json` prints
that mapping itself, with every digit.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from matrix.outcome import EXPOSED, beyond_loopback, describe_listeners, exposure_only
from matrix.report.fmt import DASH, fmt_kv_ledger, fmt_pairs, fmt_peaks, fmt_seconds, fmt_time
from matrix.report.stats import PassRate

__all__ = ["show_lines"]

WIDTH = 12  # the label column


def _time(value: Any) -> str:
    if not isinstance(value, str) or not value:
        return DASH
    try:
        return fmt_time(dt.datetime.fromisoformat(value))
    except ValueError:
        return value


def _seconds(value: Any) -> str:
    return fmt_seconds(float(value)) if isinstance(value, int | float) and not isinstance(value, bool) else DASH


def _rate(data: Any) -> str:
    if not isinstance(data, Mapping):
        return ""
    rate = PassRate(int(data.get("passed") or 0), int(data.get("failed") or 0), str(data.get("history") or ""))
    text = rate.text()
    return text + (f", flaky (history {rate.history})" if rate.flaky else "")


def show_lines(d: Mapping[str, Any]) -> list[str]:
    """The attempt as aligned ``label  text`` lines, then its failed checks and log files."""
    status = str(d.get("status", ""))
    checks = [c for c in d.get("checks") or () if isinstance(c, Mapping)]
    listeners = [e for e in d.get("listeners") or () if isinstance(e, Mapping)]
    if exposure_only(status, d.get("failure_kind"), (str(c.get("name", "")) for c in checks)):
        # Exposure is its own finding (docs/security.md): the pair served correctly, where it listened did not.
        where = describe_listeners(beyond_loopback(listeners))
        status = (f"{EXPOSED.upper()}: served correctly, but under --loopback-only a listener is beyond loopback"
                  + (f" ({where})" if where else "") + f" · stored as {status} ({d.get('failure_kind')})")
    elif d.get("failure_kind"):
        status += f" ({d['failure_kind']})"
    flags = [
        "flaky (passed after a failed attempt)" if d.get("flaky") else "",
        f"expected failure: {d['expected_failure']}" if d.get("expected_failure") else "",
        "unexpected pass (a required fix is missing, yet it passed)" if d.get("unexpected_pass") else "",
    ]
    timings = " · ".join(
        f"{name} {_seconds(d.get(key))}"
        for name, key in (("ready", "ready_s"), ("request", "request_s"), ("TTFT", "ttft_s"),
                          ("teardown", "teardown_s"), ("total", "total_s"))
    )  # fmt: skip
    workers = ""
    if d.get("prefill_worker_id") or d.get("decode_worker_id"):
        workers = f"prefill {d.get('prefill_worker_id') or DASH} · decode {d.get('decode_worker_id') or DASH}"
    usage = ""
    if d.get("prompt_tokens") is not None or d.get("finish_reason"):
        usage = (f"prompt tokens {d.get('prompt_tokens', DASH)} · completion tokens "
                 f"{d.get('completion_tokens', DASH)} · finish reason {d.get('finish_reason') or DASH}")  # fmt: skip
    rows = [
        ("cell", str(d.get("cell", ""))),
        ("attempt", f"{d.get('attempt')} of campaign {d.get('campaign')} · id {d.get('id')}"),
        ("status", status),
        ("flags", "; ".join(f for f in flags if f)),
        ("time", f"{_time(d.get('started_at'))} → {_time(d.get('finished_at'))}"),
        ("timings", timings),
        ("message", str(d.get("message") or "")),
        ("worker ids", workers),
        ("usage", usage),
        ("completion", str(d.get("completion_excerpt") or "")),
        ("ports", fmt_pairs(d.get("ports") or {})),
        ("exit codes", fmt_pairs(d.get("exit_codes") or {})),
        ("components", fmt_pairs(d.get("components") or {})),
        ("GPU", fmt_pairs(d.get("gpu") or {})),
        ("peaks", fmt_peaks(d.get("peaks") or {})),
        ("KV transfer", fmt_kv_ledger(d.get("kv_ledger") or {})),
        ("listens on", describe_listeners(listeners)),
        ("pass rate", _rate(d.get("pass_rate"))),
        ("logs in", str(d.get("log_dir") or "")),
    ]
    lines = []
    for name, text in rows:
        if not text:
            continue
        first, *rest = text.splitlines() or [""]
        lines.append(f"{name:<{WIDTH}} {first}")
        lines.extend(f"{'':<{WIDTH}} {line}" for line in rest)
    for check in checks:
        lines.append(f"  check failed: {check.get('name', '')}: {check.get('message', '')}")
    for role, path in (d.get("logs") or {}).items():
        lines.append(f"  log {role}: {path}")
    return lines
