#!/usr/bin/env bash
# [M24] steps 1 and 2 together on one GPU host with no package index: the seed's 12 cells in ONE packed
# campaign. vLLM 0.29.0 / 0.30.0 / 0.31.0 x (Dynamo's sidecar over vllm-rs `vllm_disaggregated`, vLLM's native
# NIXL pair `vllm_native_disaggregated`) and SGLang 0.5.18 / 0.5.19 / 0.5.21 x (Dynamo's sidecar
# `sglang_disaggregated`, SGLang's own P/D `sglang_native_disaggregated`), all on GPU 0 with `--pack`, every
# runtime provisioned offline from one wheelhouse that holds both families. Run by hand on an NVIDIA host
# (not part of CI); docs/results/gpu-h200-seed-packed.md has the run:
#
#   here (with an index):  matrix catalog sync data/*.toml
#                          matrix runtime wheelhouse $(grep -v '^#' tests/gpu/wheelhouse-vllm.args) --out WH_V
#                          matrix runtime wheelhouse $(grep -v '^#' tests/gpu/wheelhouse-sglang.args) --out WH_S
#                          pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#                            --platform manylinux_2_39_x86_64 --platform manylinux_2_17_x86_64 \
#                            --platform manylinux2014_x86_64 sqlalchemy alembic mako -d EXTRA
#                          python tests/gpu/kit.py merge WH WH_V WH_S --extra EXTRA   # shared wheels once
#                          python tests/gpu/kit.py split WH CHUNKS --chunk-mib 54   # 62 chunks, 3320 MiB
#                          (54: a command's upload of at most 64 MiB includes the checkout); create STAGING
#                          first, upload CHUNKS/c* into it, then move the chunk folders' files into FLAT
#                          (`mv STAGING/c*/* FLAT/`)
#   there, one phase list per command (none may outlast the host's command limit; MATRIX_HOME, the
#   wheelhouse and WORK stay in /tmp between the commands):
#                          KIT=FLAT PHASES=prepare bash tests/gpu/seed_packed_h200.sh OUTDIR
#                          PHASES=packed bash tests/gpu/seed_packed_h200.sh OUTDIR
#                          PHASES="resume collect" bash tests/gpu/seed_packed_h200.sh OUTDIR
#
# Phases:
#   prepare  join the chunks, matrix's own needs (--target), catalog, the six runtimes provisioned side by
#            side, each environment's versions, and the tiny random model built once (timed), so that no
#            cell's start-up waits on it.
#   packed   GPU 0 sampled every second (device total, and every compute process with the cell log its
#            stdout goes to) while ONE `matrix run --pack -j 12` runs the 12 cells, under
#            `timeout -s INT $RUN_TIMEOUT` (matrix tears the pairs down on SIGINT; `resume` finishes).
#   resume   `matrix run --resume` of the latest campaign when it was cut; nothing when it finished.
#   again    the SGLang cells once more, packed: does a runtime's engine cache (`matrix/launch/caches.py`)
#            make the second start of a version warm? (the first took ~137 s on 2026-12-04, later ones 38-46 s)
#   traffic  [M27]'s traffic cell and 1p2d topology on CUDA ($TRAFFIC_CASES: `vllm_native_traffic`,
#            `vllm_native_topology_1p2d`, tests/gpu/catalog-traffic-cuda.toml) on $TRAFFIC_RUNTIME, one at a
#            time, GPU 0 sampled as in `packed`.
#   faults   [M28]'s detection table on CUDA: `vllm_kv_fault_*` (tests/gpu/catalog-kv-faults-cuda.toml), the A/A
#            control and one cell per KV fault class ($FAULT_CASES narrows them, $FAULT_REPEAT repeats each),
#            on $TRAFFIC_RUNTIME, on GPU 0: one fault grid (one pair serves every cell); then `matrix
#            detection`.
#   collect  rows (campaign_h200.sh's query), makespan / median / sum per campaign, gates, report, `ps`,
#            `nvidia-smi`, tarballs of the report and the cells' logs.
set -uo pipefail
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
PHASES=${PHASES:-"prepare packed resume collect"}
WHEELHOUSE=${WHEELHOUSE:-/tmp/wheelhouse}
DEPS=${DEPS:-/tmp/matrix-deps}
WORK=${WORK:-/tmp/seed-work}
RUN_TIMEOUT=${RUN_TIMEOUT:-520}
# The seed's six runtimes, plus (since [M31] item 4) the seed's own combination: Python vLLM 0.29.0 with the
# vllm-rs of the 0.30.0 wheel (tests/gpu/catalog-vllm-rs-skew.toml), so 14 cells; RUNTIMES overrides.
RUNTIMES=${RUNTIMES:-"vllm=0.29.0 vllm=0.30.0 vllm=0.31.0 vllm=0.29.0+vllm.rs.0.30.0 sglang=0.5.18 sglang=0.5.19 sglang=0.5.21"}
CASES="vllm_disaggregated vllm_native_disaggregated sglang_disaggregated sglang_native_disaggregated"
CATALOGS="data/*.toml tests/gpu/catalog-vllm-rs-skew.toml tests/gpu/catalog-traffic-cuda.toml tests/gpu/catalog-kv-faults-cuda.toml tests/gpu/catalog-two-gpus.toml"
TRAFFIC_RUNTIME=${TRAFFIC_RUNTIME:-vllm=0.31.0}
TRAFFIC_CASES=${TRAFFIC_CASES:-"vllm_native_traffic vllm_native_topology_1p2d"}
# Default: every case of catalog-kv-faults-cuda.toml once. `never_complete` costs its 90 s request timeout and a
# pair restart per cell, `lost_notification` about 30 s of the prefill's lease: leave the first out of a series.
FAULT_CASES=${FAULT_CASES:-$(grep -o '^name = "vllm_kv_fault_[a-z_]*"' "$HERE/catalog-kv-faults-cuda.toml" | cut -d'"' -f2)}
FAULT_REPEAT=${FAULT_REPEAT:-1}
export MATRIX_HOME=${MATRIX_HOME:-/tmp/matrix-home} PYTHONUNBUFFERED=1
# shellcheck source=tests/gpu/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# Never NVLink multicast on a shared host.
no_multicast
export PYTHONPATH="$DEPS:$PWD"
offline=(--find-links "$WHEELHOUSE" --offline)
selection=()
for r in $RUNTIMES; do selection+=(--runtime "$r"); done
for c in $CASES; do selection+=(--case "$c"); done
mkdir -p "$WORK"

# GPU 0 once a second: "T epoch", the device total (MiB), then "pid MiB log" per compute process; the log is
# where the process's stdout goes (a cell's log directory names the cell), read once per pid.
sample_gpu() {
  declare -A seen
  while :; do
    echo "T $(date +%s.%N) $(nvidia-smi -i 0 --query-gpu=memory.used --format=csv,noheader,nounits)"
    while IFS=', ' read -r pid mib; do
      [ -n "$pid" ] || continue
      [ -n "${seen[$pid]:-}" ] || seen[$pid]=$(readlink "/proc/$pid/fd/1" 2>/dev/null || echo "?")
      echo "$pid $mib ${seen[$pid]}"
    done < <(nvidia-smi -i 0 --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null)
    sleep 1
  done
}

for phase in $PHASES; do
  case $phase in
  prepare)
    stamp "join the uploaded chunks"
    "$PY" "$HERE/kit.py" join "${KIT:?set KIT to the folder that holds the uploaded chunks}" "$WHEELHOUSE" || exit 1
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$DEPS" \
      "$WHEELHOUSE"/sqlalchemy-*.whl "$WHEELHOUSE"/alembic-*.whl "$WHEELHOUSE"/mako-*.whl || exit 1
    stamp "GPU before"; smi; df -h /tmp | tail -n 1
    # shellcheck disable=SC2086
    m catalog sync $CATALOGS > /dev/null || exit 1
    m gpus
    stamp "provision the six runtimes offline, side by side"
    for r in $RUNTIMES; do
      ( t0=$(date +%s); m runtime provision --runtime "$r" "${offline[@]}" > "$OUT/provision-${r/=/-}.txt" 2>&1
        echo "$r: exit $?, $(( $(date +%s) - t0 )) s" ) &
    done
    wait
    tail -n 2 "$OUT"/provision-*.txt
    m runtime envs
    for env in "$MATRIX_HOME"/envs/*/; do
      "$env/bin/python" - "$env" <<'PYEOF' 2>&1 | tail -n 1
import importlib.metadata as md, sys
found = []
for name in ("vllm", "sglang", "sglang-kernel", "ai-dynamo", "nixl", "torch"):
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
print(sys.argv[1].rstrip("/").rsplit("/", 1)[-1], ", ".join(found))
PYEOF
      [ -x "$env/bin/vllm-rs" ] && "$env/bin/vllm-rs" --version 2>&1 | head -n 1
    done
    du -sh "$MATRIX_HOME"/envs/* 2>/dev/null; df -h /tmp | tail -n 1
    # Cells build it on first use too (one at a time, under a lock); built here, its time is not a cell's.
    stamp "the tiny random model, built once with the first environment's interpreter that has torch"
    for env in "$MATRIX_HOME"/envs/*/; do
      "$env/bin/python" -c 'import torch, transformers, safetensors' 2> /dev/null || continue
      "$PY" -c 'import sys; from matrix.model_files import ensure_tiny_model
print(ensure_tiny_model(weights_python=sys.argv[1]))' "$env/bin/python" || exit 1
      break
    done
    stamp "prepared"
    ;;
  packed)
    stamp "GPU before the packed campaign"; smi; left
    sample_gpu > "$OUT/gpu-trace.txt" 2>&1 &
    sampler=$!
    timeout -s INT "$RUN_TIMEOUT" "$PY" -m matrix run "${selection[@]}" "${offline[@]}" --gpus 0 --pack -j 12 \
      --no-report
    echo "matrix run: exit $?"
    sleep 3; kill "$sampler"; wait "$sampler" 2>/dev/null
    stamp "GPU after the packed campaign"; smi; left
    ;;
  resume)
    last=$("$PY" -c 'import sqlite3, sys
print(sqlite3.connect(sys.argv[1]).execute("SELECT id, status FROM campaign ORDER BY id DESC LIMIT 1").fetchone())' \
      "$MATRIX_HOME/matrix.db")
    echo "latest campaign: $last"
    case $last in
    *finished*) echo "nothing to resume" ;;
    *)
      id=${last#(}; id=${id%%,*}
      sample_gpu > "$OUT/gpu-trace-resume.txt" 2>&1 &
      sampler=$!
      timeout -s INT "$RUN_TIMEOUT" "$PY" -m matrix run --resume "$id" "${offline[@]}" --gpus 0 --pack -j 12 \
        --no-report
      echo "matrix run --resume $id: exit $?"
      sleep 3; kill "$sampler"; wait "$sampler" 2>/dev/null
      stamp "GPU after the resumed campaign"; smi; left
      ;;
    esac
    ;;
  again)
    sel=(--case sglang_disaggregated --case sglang_native_disaggregated)
    for r in $RUNTIMES; do [ "${r%%=*}" = sglang ] && sel+=(--runtime "$r"); done
    stamp "the SGLang cells again (warm caches?)"; smi
    timeout -s INT "$RUN_TIMEOUT" "$PY" -m matrix run "${sel[@]}" "${offline[@]}" --gpus 0 --pack -j 12 --no-report
    echo "matrix run (again): exit $?"
    stamp "GPU after"; smi; left
    ;;
  traffic)
    stamp "the traffic cells ($TRAFFIC_CASES) on $TRAFFIC_RUNTIME"; smi
    sample_gpu > "$OUT/gpu-trace-traffic.txt" 2>&1 &
    sampler=$!
    sel=(--runtime "$TRAFFIC_RUNTIME")
    for c in $TRAFFIC_CASES; do sel+=(--case "$c"); done
    timeout -s INT "$RUN_TIMEOUT" "$PY" -m matrix run "${sel[@]}" "${offline[@]}" --gpus 0 -j 1 --no-report
    echo "matrix run (traffic): exit $?"
    sleep 3; kill "$sampler"; wait "$sampler" 2>/dev/null
    stamp "GPU after"; smi; left
    ;;
  faults)
    # [M28]'s detection table on CUDA: the A/A control and the KV fault classes on one pair (a fault grid).
    sel=(--runtime "$TRAFFIC_RUNTIME" --repeat "$FAULT_REPEAT")
    for c in $FAULT_CASES; do sel+=(--case "$c"); done
    stamp "the KV fault cells on $TRAFFIC_RUNTIME, $FAULT_REPEAT time(s) each"; smi
    sample_gpu > "$OUT/gpu-trace-faults.txt" 2>&1 &
    sampler=$!
    timeout -s INT "$RUN_TIMEOUT" "$PY" -m matrix run "${sel[@]}" "${offline[@]}" --gpus 0 --pack -j 7 --no-report
    echo "matrix run (faults): exit $?"
    sleep 3; kill "$sampler"; wait "$sampler" 2>/dev/null
    stamp "GPU after"; smi; left
    m detection --campaign last --markdown | tee "$OUT/detection.md"
    ;;
  collect)
    stamp "rows (the query of campaign_h200.sh's collect phase)"
    awk '/<<.PYEOF./ {on = 1; next} /^PYEOF/ {on = 0} on' "$HERE/campaign_h200.sh" > "$WORK/rows.py"
    "$PY" "$WORK/rows.py" "$MATRIX_HOME/matrix.db" > "$OUT/rows.jsonl"
    cut -c1-400 "$OUT/rows.jsonl"
    stamp "makespan per campaign: campaign start to end, and first cell start to last cell end"
    "$PY" - "$MATRIX_HOME/matrix.db" <<'PYEOF' | tee "$OUT/makespan.txt"
import datetime as dt, sqlite3, statistics, sys
db = sqlite3.connect(sys.argv[1])
t = lambda s: dt.datetime.fromisoformat(s).replace(tzinfo=dt.timezone.utc).timestamp() if s else None
for cid, c0, c1, status in db.execute("SELECT id, started_at, finished_at, status FROM campaign ORDER BY id"):
    # Finished cells only: an attempt cut by the host's command limit (`interrupted`) is resumed as another
    # row, and counting both made the 2026-12-04 run's cell count and sum too large.
    rows = db.execute("SELECT r.started_at, r.finished_at, r.total_s FROM cell_run r WHERE r.campaign_id = ? "
                      "AND r.status IN ('passed', 'failed', 'error', 'timeout') AND r.finished_at IS NOT NULL",
                      (cid,)).fetchall()
    if not rows:
        continue
    total = [r[2] or t(r[1]) - t(r[0]) for r in rows]
    span = max(t(r[1]) for r in rows) - min(t(r[0]) for r in rows)
    whole = t(c1) - t(c0) if c1 else float("nan")
    median = statistics.median(total)
    print(f"campaign {cid} ({status}): {len(rows)} cells; campaign {whole:.1f} s, cells' span {span:.1f} s; "
          f"cell median {median:.1f} s, max {max(total):.1f} s, sum {sum(total):.1f} s; span/median "
          f"{span / median:.2f}, span/sum {span / sum(total):.2f}")
PYEOF
    m campaigns list | tee "$OUT/campaigns.txt"
    for r in $RUNTIMES; do m gate "${r%%=*}" "${r#*=}" | tee -a "$OUT/gate.txt"; done
    m export markdown > "$OUT/summary.md"
    m report --out "$WORK/report" > /dev/null
    stamp "anything left?"; left; smi
    tar -czf "$OUT/report.tgz" -C "$WORK" report
    tar -czf "$OUT/logs.tgz" -C "$MATRIX_HOME" $(cd "$MATRIX_HOME" && ls -d runs envs/*/provision.log 2>/dev/null)
    ls -l "$OUT"
    ;;
  *) echo "unknown phase $phase (prepare, packed, resume, again, traffic, faults, collect)"; exit 2 ;;
  esac
done
stamp "done"
