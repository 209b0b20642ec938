#!/usr/bin/env bash
# GPU check for the Ray executor (run by hand on an NVIDIA host; not part of CI). Needs matrix and ray
# importable by $PYTHON (pip install '.[ray]', or PYTHONPATH) and torch with CUDA for the reference pair's
# GPU KV pools. From the repo root:
#   bash tests/gpu/ray_reference.sh [OUTDIR]
# Starts a Ray head that detects the host's GPUs, runs two GPU reference cells through `--executor ray`
# (each a Ray task with num_gpus=1: on a one-GPU host they run one after the other), prints the rows, and
# checks that the GPU is back at its baseline and that no process of the cells or of Ray is left.
set -euo pipefail
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
export MATRIX_HOME=${MATRIX_HOME:-$(mktemp -d)} PYTHONUNBUFFERED=1 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
# shellcheck source=tests/gpu/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ray_cli() { "$PY" -c 'import sys; from ray.scripts.scripts import main; sys.argv[0] = "ray"; main()' "$@"; }
port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

echo "== GPU before"; smi
m catalog sync >/dev/null
sed -n '/^name = "reference_disaggregated_gpu"$/,/^launch/p' data/cases.toml \
  | sed 's/^name = "reference_disaggregated_gpu"$/name = "reference_disaggregated_gpu_twin"/' \
  | { echo "[[case]]"; cat; } >"$MATRIX_HOME/twin.toml"
m catalog sync "$MATRIX_HOME/twin.toml" data/backends.toml data/markers.toml data/fixes.toml data/runtimes.toml \
  data/cases.toml >/dev/null

echo "== Ray head on port $port"
ray_cli start --head --port "$port" --num-cpus 4 --include-dashboard false --disable-usage-stats \
  --object-store-memory 200000000 >"$OUT/ray-start.log" 2>&1
trap 'ray_cli stop --force >/dev/null 2>&1 || true' EXIT
"$PY" -c "import ray; ray.init(address='127.0.0.1:$port', logging_level='ERROR'); print('cluster', ray.cluster_resources())"

echo "== two GPU cells through the Ray executor"
status=0
m run --case reference_disaggregated_gpu --case reference_disaggregated_gpu_twin --executor ray \
  --ray-address "127.0.0.1:$port" --report-dir "$OUT/report" || status=$?
echo "matrix run exit code: $status"
"$PY" - "$MATRIX_HOME/matrix.db" <<'PYEOF'
import json, sqlite3, sys
q = ('SELECT c.name, r.uid, r.status, r.failure_kind, r.ready_s, r.request_s, r.total_s, r.started_at, '
     'r.finished_at, r.gpu, r.peaks, r.log_dir, r.message FROM cell_run r JOIN "case" c ON c.id = r.case_id '
     'ORDER BY r.id')
for name, uid, status, kind, ready, request, total, start, end, gpu, peaks, log_dir, message in sqlite3.connect(
        sys.argv[1]).execute(q):
    visible = {}
    for role in ("prefill", "decode"):
        for line in open(f"{log_dir}/{role}.log"):
            if "starting role=" in line:
                visible[role] = line.split("CUDA_VISIBLE_DEVICES=", 1)[1].split(" ", 1)[0]
    print(json.dumps({"case": name, "uid": uid, "status": status, "kind": kind, "ready_s": ready,
                      "request_s": request, "total_s": total, "started_at": start, "finished_at": end,
                      "gpu": json.loads(gpu), "peaks": json.loads(peaks), "workers_saw": visible,
                      "message": message[:300]}))
PYEOF
ray_cli stop --force >/dev/null 2>&1 || true
trap - EXIT
sleep 2
echo "== GPU after"; smi
echo "== processes left (cells or Ray)"
ps -eo pid,args | grep -E "matrix.reference|raylet|gcs_server|ray::" | grep -v grep || echo "none"
exit "$status"
