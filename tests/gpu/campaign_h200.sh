#!/usr/bin/env bash
# [M24] steps 2 and 3 on one GPU host with no package index, after rerun_h200.sh's `prepare` phase built the
# four vLLM runtimes offline (0.29.0 / 0.30.0 / 0.31.0 and 0.29.0 with the vllm-rs of the 0.30.0 wheel):
#
#   packed   the seed's vLLM cells (Dynamo's sidecar over vllm-rs, vLLM's native NIXL pair, the equivalence
#            oracle) on the three releases in one packed campaign (`--pack`: start-ups overlap while the
#            GPU's memory allows); makespan vs the cells' own durations comes from the rows.
#   skew     the native NIXL pair's 3x3 prefill x decode grid of the three releases ([M20] on CUDA engines).
#   skewsc   the sidecar cell's grid of 0.29.0 / 0.30.0 / 0.31.0: which side carries vllm-rs 0.29.0's bug.
#   collect  rows, skew grids, compare, gates, report, logs.
#
# Run by hand on an NVIDIA host (not part of CI); docs/results/gpu-h200-campaign-2026-12.md has the commands:
#   KIT=STAGING PHASES=prepare bash tests/gpu/rerun_h200.sh OUTDIR
#   PHASES="packed skew" bash tests/gpu/campaign_h200.sh OUTDIR
#   PHASES="skewsc collect" bash tests/gpu/campaign_h200.sh OUTDIR
set -uo pipefail
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
PHASES=${PHASES:-"packed skew skewsc collect"}
WHEELHOUSE=${WHEELHOUSE:-/tmp/wheelhouse-vllm}
DEPS=${DEPS:-/tmp/matrix-deps}
VERSIONS="0.29.0 0.30.0 0.31.0"
SKEW="0.29.0+vllm.rs.0.30.0"
export MATRIX_HOME=${MATRIX_HOME:-/tmp/matrix-home} PYTHONUNBUFFERED=1
# shellcheck source=tests/gpu/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# Never NVLink multicast on a shared host.
no_multicast
export PYTHONPATH="$DEPS:$PWD"
offline=(--find-links "$WHEELHOUSE" --offline)
runtimes=()
for v in $VERSIONS; do runtimes+=(--runtime "vllm=$v"); done

for phase in $PHASES; do
  case $phase in
  packed)
    stamp "GPU before the packed campaign"; smi
    m run --case vllm_disaggregated --case vllm_native_disaggregated --case vllm_native_equivalence \
      "${runtimes[@]}" "${offline[@]}" --gpus 0 --pack -j 9 --report-dir "$OUT/report-packed"
    stamp "GPU after the packed campaign"; smi; left
    ;;
  skew)
    stamp "GPU before the native skew grid"; smi
    m run --case vllm_native_disaggregated --skew "${runtimes[@]}" "${offline[@]}" --gpus 0 --pack -j 9 \
      --report-dir "$OUT/report-skew"
    stamp "GPU after the native skew grid"; smi; left
    m skew vllm_native_disaggregated | tee "$OUT/skew-native.txt"
    ;;
  skewsc)
    stamp "GPU before the sidecar skew grid"; smi
    m run --case vllm_disaggregated --skew "${runtimes[@]}" "${offline[@]}" --gpus 0 --pack -j 9 \
      --report-dir "$OUT/report-skewsc"
    stamp "GPU after the sidecar skew grid"; smi; left
    m skew vllm_disaggregated | tee "$OUT/skew-sidecar.txt"
    ;;
  collect)
    stamp "rows"
    "$PY" - "$MATRIX_HOME/matrix.db" > "$OUT/rows.jsonl" <<'PYEOF'
import json, sqlite3, sys
keys = ("campaign", "case", "version", "roles", "status", "kind", "ready_s", "request_s", "teardown_s", "total_s",
        "started_at", "finished_at", "prefill_worker_id", "decode_worker_id", "completion_tokens", "checks",
        "expected_failure", "gpu", "peaks", "kv_ledger", "message", "log_dir")
q = ('SELECT r.campaign_id, c.name, rt.version, r.roles, r.status, r.failure_kind, r.ready_s, r.request_s, '
     'r.teardown_s, r.total_s, r.started_at, r.finished_at, r.prefill_worker_id, r.decode_worker_id, '
     'r.completion_tokens, r.checks, r.expected_failure, r.gpu, r.peaks, r.kv_ledger, r.message, r.log_dir '
     'FROM cell_run r JOIN "case" c ON c.id = r.case_id JOIN runtime rt ON rt.id = r.runtime_id '
     'WHERE r.status != "skipped" ORDER BY r.id')
for row in sqlite3.connect(sys.argv[1]).execute(q):
    print(json.dumps(dict(zip(keys, row))))
PYEOF
    cut -c1-600 "$OUT/rows.jsonl"
    m skew vllm_native_disaggregated --json > "$OUT/skew-native.json"
    m skew vllm_disaggregated --json > "$OUT/skew-sidecar.json"
    m campaigns | tee "$OUT/campaigns.txt"
    for v in $VERSIONS; do m gate vllm "$v" | tee -a "$OUT/gate.txt"; done
    m compare --component vllm-rs 0.29.0 0.30.0 | tee "$OUT/compare.txt"
    m report --backend vllm --out "$OUT/report"
    stamp "anything left?"; left; smi
    tar -czf "$OUT/report.tgz" -C "$OUT" report $(cd "$OUT" && ls -d report-* 2>/dev/null)
    tar -czf "$OUT/logs.tgz" -C "$MATRIX_HOME" runs
    rm -rf "$OUT"/report "$OUT"/report-*
    ;;
  *) echo "unknown phase $phase (packed, skew, skewsc, collect)"; exit 2 ;;
  esac
done
stamp "done"
