#!/usr/bin/env bash
# GPU check of the equivalence oracle and of the start-up work (run by hand on an NVIDIA host; not CI).
# Needs a CUDA vLLM 0.26.0 + NIXL 1.5.1 site (MATRIX_GPUKIT_SITE, its env file sourced first) and matrix
# importable (pip install . or PYTHONPATH). From the repo root:
#   MATRIX_GPUKIT_SITE=/path/to/site bash tests/gpu/oracle_speed_h200.sh [OUTDIR]
# 1. one native vLLM cell with empty engine caches, then the same cell again (caches warm);
# 2. eight copies of that cell packed on one GPU (absolute memory bounds: start-ups run together);
# 3. vllm_native_equivalence: the pair vs one aggregated instance, 16 prompts x 64 greedy token ids.
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
q = ('SELECT c.name, r.status, r.failure_kind, r.ready_s, r.request_s, r.teardown_s, r.total_s, r.started_at, '
     'r.finished_at, r.checks, r.gpu, r.peaks, r.message FROM cell_run r JOIN "case" c ON c.id = r.case_id '
     'WHERE r.campaign_id = ? ORDER BY r.id')
con = sqlite3.connect(db)
for name, status, kind, ready, request, teardown, total, start, end, checks, gpu, peaks, message in con.execute(q, (campaign,)):
    print(json.dumps({"case": name, "status": status, "kind": kind, "ready_s": ready, "request_s": request,
                      "teardown_s": teardown, "total_s": total, "started": start, "finished": end,
                      "checks": json.loads(checks), "gpu": json.loads(gpu), "peaks": json.loads(peaks),
                      "message": message[:600]}))
(started, finished), = con.execute('SELECT started_at, finished_at FROM campaign WHERE id = ?', (campaign,))
print(json.dumps({"campaign": campaign, "started": started, "finished": finished}))
PYEOF
}
CELL=vllm_native_disaggregated
echo "== GPU before"; smi
m catalog sync > /dev/null
twins=()
for i in 1 2 3 4 5 6 7; do
  sed -n "/^name = \"$CELL\"\$/,/^launch/p" data/cases.toml \
    | sed "s/^name = \"$CELL\"\$/name = \"${CELL}_twin$i\"/" | { echo "[[case]]"; cat; } >> "$MATRIX_HOME/twins.toml"
  twins+=(--case "${CELL}_twin$i")
done
m catalog sync "$MATRIX_HOME/twins.toml" data/*.toml > /dev/null
m gpus

echo "== 1. one cell, caches empty"; date +%s.%N
m run --case $CELL --runtime vllm=0.26.0 --gpus 0 --no-report || true
rows 1
echo "== cache directories after the first cell"; du -sh "$MATRIX_HOME"/caches/* 2>/dev/null || true
echo "== 1b. the same cell, caches warm"
m run --case $CELL --runtime vllm=0.26.0 --gpus 0 --no-report || true
rows 2
echo "== GPU after"; smi

echo "== 2. eight cells packed on one GPU"
m run --case $CELL "${twins[@]}" --runtime vllm=0.26.0 --gpus 0 --pack -j 8 --no-report || true
rows 3
echo "== GPU after the packed run"; smi
echo "== start-up windows (spawn -> ready) per instance"
for log in "$MATRIX_HOME"/runs/campaign-3/*/prefill.log "$MATRIX_HOME"/runs/campaign-3/*/decode.log; do
  start=$(head -1 "$log" | cut -d' ' -f1)
  ready=$(grep -m1 "Application startup complete" "$log" | cut -d' ' -f1 || true)
  echo "$start $ready $(basename "$(dirname "$log")")/$(basename "$log")"
done | sort

echo "== 3. equivalence: the pair vs one aggregated instance"
m run --case vllm_native_equivalence --runtime vllm=0.26.0 --gpus 0 --no-report || true
rows 4
for f in "$MATRIX_HOME"/runs/campaign-4/*/equivalence.json; do echo "--- $f"; cat "$f"; done || true
echo "== GPU after everything"; smi
echo "== processes left"; ps -eo pid,cmd | grep -E "vllm|matrix\.(pdproxy|reference)" | grep -v grep || echo none
m report --out "$OUT/report" > /dev/null || true
echo "report: $OUT/report/index.html"
