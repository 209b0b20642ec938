"""GPU check (run by hand on an NVIDIA host; not part of the CI suite).

1. `matrix gpus` against `nvidia-smi`.
2. A campaign of N reference cells whose KV pools live on the GPU (`--device cuda`), packed onto one GPU
   with `--pack`: every cell pinned to the right device, start-ups serialised, memory back to baseline
   afterwards, peaks recorded.
Run from the repository root:  python tests/gpu/reference_pack.py --cells 16 --gpu 0
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def sh(*argv: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=False, env=env).stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cells", type=int, default=16)
    parser.add_argument("--gpu", default="0")
    parser.add_argument("--kv-mib", type=int, default=1024)
    # Steady state per cell (64 tokens x delay), so packed cells overlap on the GPU after their start-ups.
    parser.add_argument("--token-delay-ms", type=int, default=300)
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="matrix-gpu-"))
    env = {**os.environ, "MATRIX_HOME": str(home), "MATRIX_DB": str(home / "m.db"), "PYTHONUNBUFFERED": "1"}
    matrix = [sys.executable, "-m", "matrix"]
    smi = ["nvidia-smi", "--query-gpu=index,uuid,name,memory.total,memory.used", "--format=csv,noheader"]
    print("== nvidia-smi\n" + sh(*smi))
    print("== matrix gpus --json\n" + sh(*matrix, "gpus", "--json", env=env))

    lines = []
    for i in range(args.cells):
        lines += [
            "[[case]]", f'name = "gpu_ref_{i:02d}"', 'backend = "reference"', 'arm = "reference"',
            'model = "tiny"', 'markers = ["gpu_1", "e2e"]', f"kv_bound = {{ bytes = {args.kv_mib * 2**20} }}",
            "startup_timeout_s = 300", "request_timeout_s = 120",
            f'launch = {{ device = "cuda", token_delay_ms = {args.token_delay_ms} }}', "",
        ]  # fmt: skip
    (home / "gpu.toml").write_text("\n".join(lines))
    data = REPO / "data"
    sync = [*matrix, "catalog", "sync", str(home / "gpu.toml")]
    sync += [str(data / f) for f in ("backends.toml", "markers.toml", "fixes.toml", "runtimes.toml")]
    subprocess.run(sync, env=env, check=True, capture_output=True)

    before = sh(*smi)
    started = time.monotonic()
    run = subprocess.run(
        [*matrix, "run", "-m", "gpu_1", "--pack", "--gpus", args.gpu, "--quiet"],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    wall = time.monotonic() - started
    print(f"== matrix run --pack (exit {run.returncode}, {wall:.1f}s)\n{run.stdout[-3000:]}{run.stderr[-2000:]}")
    after = sh(*smi)
    print(f"== memory before\n{before}== memory after\n{after}")

    with sqlite3.connect(home / "m.db") as conn:
        rows = conn.execute(
            "SELECT c.name, r.status, r.ready_s, r.request_s, r.total_s, r.gpu, r.peaks, r.started_at, r.finished_at,"
            ' r.message FROM cell_run r JOIN "case" c ON c.id = r.case_id ORDER BY r.id'
        ).fetchall()
    print("== cells")
    device_peak, pair_bytes = 0, 0
    for name, status, ready, request, total, gpu, peaks, s_at, f_at, message in rows:
        g, p = json.loads(gpu), json.loads(peaks)
        device_peak = max([device_peak, *p.get("device_used_bytes", {}).values()])
        pair_bytes = max(pair_bytes, sum(p.get("gpu_bytes", {}).values()))
        print(f"{name} {status} ready={ready} request={request} total={total} gpu={g} peaks={p} {message[:200]}")
    baseline = json.loads(sh(*matrix, "gpus", "--json", env=env) or "[{}]")[0].get("memory_used", 0)
    if pair_bytes:
        # Rows are claimed at once under --pack, so their timestamps cannot show overlap; GPU memory can.
        resident = (device_peak - baseline) / pair_bytes
        peak_gib, pair_gib = device_peak / 2**30, pair_bytes / 2**30
        print(f"== GPU memory peak {peak_gib:.2f} GiB = baseline + {resident:.1f} pairs of {pair_gib:.2f} GiB")
    logs = sorted((home / "runs").rglob("prefill.log"))
    spans = []
    for log in logs:
        text = log.read_text().splitlines()
        start = next((ln.split()[0] for ln in text if "[matrix] starting" in ln), None)
        ready = next((ln.split()[0] for ln in text if " ready " in ln), None)
        spans.append((start, ready, log.parent.name))
    print("== prefill spawn -> ready spans (serialised start-ups should not overlap per GPU)")
    for span in sorted(spans):
        print(*span)
    return run.returncode


if __name__ == "__main__":
    raise SystemExit(main())
