#!/usr/bin/env bash
# GPU check for the native vLLM disaggregated cell (run by hand on an NVIDIA host; not part of CI).
# Needs: a CUDA vLLM 0.26.0 + NIXL 1.5.1 site (set MATRIX_GPUKIT_SITE, and source its env file first so
# LD_LIBRARY_PATH is right), and matrix importable (pip install . or PYTHONPATH). From the repo root:
#   MATRIX_GPUKIT_SITE=/path/to/site bash tests/gpu/vllm_native.sh [OUTDIR]
set -euo pipefail
OUT=${1:-$(mktemp -d)}
export MATRIX_HOME=${MATRIX_HOME:-$(mktemp -d)} PYTHONUNBUFFERED=1
: "${MATRIX_GPUKIT_SITE:?set MATRIX_GPUKIT_SITE to the vLLM site}"
# shellcheck source=tests/gpu/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
rows() {
  "$PY" - "$MATRIX_HOME/matrix.db" "$1" <<'PYEOF'
import json, sqlite3, sys
db, campaign = sys.argv[1], int(sys.argv[2])
q = ('SELECT c.name, r.status, r.failure_kind, r.ready_s, r.request_s, r.total_s, r.prefill_worker_id, '
     'r.decode_worker_id, r.completion_tokens, r.completion_excerpt, r.checks, r.gpu, r.peaks, r.message '
     'FROM cell_run r '
     'JOIN "case" c ON c.id = r.case_id WHERE r.campaign_id = ? ORDER BY r.id')
for row in sqlite3.connect(db).execute(q, (campaign,)):
    name, status, kind, ready, request, total, pid, did, tokens, excerpt, checks, gpu, peaks, message = row
    print(json.dumps({"case": name, "status": status, "kind": kind, "ready_s": ready, "request_s": request,
                      "total_s": total, "prefill_worker_id": pid, "decode_worker_id": did,
                      "completion_tokens": tokens, "completion_excerpt": excerpt[:120],
                      "checks": json.loads(checks), "gpu": json.loads(gpu),
                      "peaks": json.loads(peaks), "message": message[:400]}))
PYEOF
}

echo "== GPU before"; smi
m catalog sync > /dev/null
# A second copy of the case, so two cells can share the GPU in the packed run.
sed -n '/^name = "vllm_native_disaggregated"$/,/^launch/p' data/cases.toml \
  | sed 's/^name = "vllm_native_disaggregated"$/name = "vllm_native_disaggregated_twin"/' \
  | { echo "[[case]]"; cat; } > "$MATRIX_HOME/twin.toml"
m catalog sync "$MATRIX_HOME/twin.toml" data/backends.toml data/markers.toml data/fixes.toml data/runtimes.toml \
  data/cases.toml > /dev/null
m gpus

echo "== one cell"
m run --case vllm_native_disaggregated --runtime vllm=0.26.0 --gpus 0 --report-dir "$OUT/report" || true
rows 1
echo "== GPU after the cell"; smi
echo "== the generated model's weights, checked again with the runtime's interpreter"
for dir in "$MATRIX_HOME"/models/tiny-qwen3-*-random*; do "$PY" matrix/tools/make_tiny_qwen3.py --check "$dir" || echo "== weights check FAILED"; done

echo "== two cells packed on one GPU"
m run --case vllm_native_disaggregated --case vllm_native_disaggregated_twin --runtime vllm=0.26.0 --gpus 0 \
  --pack --report-dir "$OUT/report" || true
rows 2
echo "== GPU after the packed run"; smi
echo "== start-up windows (spawn -> ready) per instance"
for log in "$MATRIX_HOME"/runs/campaign-2/*/prefill.log "$MATRIX_HOME"/runs/campaign-2/*/decode.log; do
  start=$(head -1 "$log" | cut -d' ' -f1)
  ready=$(grep -m1 "Application startup complete" "$log" | cut -d' ' -f1 || true)
  echo "$start $ready $(basename "$(dirname "$log")")/$(basename "$log")"
done | sort
m export markdown > "$OUT/summary.md" || true
echo "report: $OUT/report/index.html"
