#!/usr/bin/env bash
# The seed's own system on a GPU host with no package index: Dynamo's native sidecar over vllm-rs, and
# vLLM's native NIXL pair, on vLLM 0.29.0 / 0.30.0 / 0.31.0, each provisioned offline from a wheelhouse.
# Run by hand on an NVIDIA host from the repo root (not part of CI):
#
#   here (with an index):  matrix runtime wheelhouse --runtime vllm=0.29.0 --runtime vllm=0.30.0 \
#                            --runtime vllm=0.31.0 --python 3.12 --platform manylinux_2_39_x86_64 \
#                            --exclude NAME... --out WHEELHOUSE        (NAMEs: what the host's python has)
#                          pip download sqlalchemy alembic mako (matrix's own needs the host lacks) into it
#                          python tests/gpu/kit.py split WHEELHOUSE CHUNKS; upload CHUNKS/c* into STAGING
#                          (a version's vLLM wheel may travel as a set of its own, last, as time allows)
#   there:                 copy the repo out of the upload folder (later uploads replace it), then
#                          KIT=STAGING bash tests/gpu/sidecar_h200.sh OUTDIR
#                          A runtime whose wheels did not arrive is skipped with the missing wheel's name.
#
# OUTDIR receives the run's log, one JSON line per cell, the compare and gate outputs, the HTML report
# and the cells' logs (tarballs).
set -uo pipefail
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
KIT=${KIT:?set KIT to the staging folder that holds the uploaded chunks}
WHEELHOUSE=${WHEELHOUSE:-/tmp/wheelhouse}
export MATRIX_HOME=${MATRIX_HOME:-/tmp/matrix-home} PYTHONUNBUFFERED=1
# shellcheck source=tests/gpu/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# Never NVLink multicast on a shared host.
no_multicast

stamp "join the uploaded chunks"
"$PY" tests/gpu/kit.py join "$KIT" "$WHEELHOUSE" || exit 1
# matrix's own needs that the host's python lacks travel in the same wheelhouse (no dependencies).
deps=$(mktemp -d)
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$deps" \
  "$WHEELHOUSE"/sqlalchemy-*.whl "$WHEELHOUSE"/alembic-*.whl "$WHEELHOUSE"/mako-*.whl || exit 1
export PYTHONPATH="$deps:$PWD"
offline=(--find-links "$WHEELHOUSE" --offline)

stamp "GPU before"; smi
m catalog sync > /dev/null
m gpus

stamp "provision the three runtimes offline, side by side"
for v in 0.29.0 0.30.0 0.31.0; do
  m runtime provision --runtime "vllm=$v" "${offline[@]}" > "$OUT/provision-$v.txt" 2>&1 &
done
wait
tail -n 3 "$OUT"/provision-*.txt
m runtime envs

stamp "the sidecar case, as CI selects it"
m run --since v0.29.0 -m "pre_merge and sidecar and gpu_1" "${offline[@]}" --gpus 0 --report-dir "$OUT/report"
stamp "GPU after the sidecar cells"; smi

stamp "the native NIXL case"
m run --since v0.29.0 --case vllm_native_disaggregated --backend vllm "${offline[@]}" --gpus 0 \
  --report-dir "$OUT/report"
stamp "GPU after the native cells"; smi

stamp "rows"
"$PY" - "$MATRIX_HOME/matrix.db" > "$OUT/rows.jsonl" <<'PYEOF'
import json, sqlite3, sys
q = ('SELECT c.name, rt.version, r.status, r.failure_kind, r.ready_s, r.request_s, r.total_s, '
     'r.prefill_worker_id, r.decode_worker_id, r.completion_tokens, r.completion_excerpt, r.checks, '
     'r.gpu, r.peaks, r.components, r.message FROM cell_run r JOIN "case" c ON c.id = r.case_id '
     'JOIN runtime rt ON rt.id = r.runtime_id WHERE r.status != "skipped" ORDER BY r.id')
keys = ("case", "version", "status", "kind", "ready_s", "request_s", "total_s", "prefill_worker_id",
        "decode_worker_id", "completion_tokens", "excerpt", "checks", "gpu", "peaks", "components", "message")
for row in sqlite3.connect(sys.argv[1]).execute(q):
    print(json.dumps(dict(zip(keys, row))))
PYEOF
cat "$OUT/rows.jsonl" | cut -c1-600

stamp "compare and gate from these rows"
m compare --component vllm-rs 0.29.0 0.30.0 | tee "$OUT/compare.txt"
m gate vllm 0.30.0 | tee "$OUT/gate.txt"
m gate vllm 0.29.0 | tee -a "$OUT/gate.txt"
m export markdown > "$OUT/summary.md"

stamp "anything left?"
ps -eo pid,args | grep -E "vllm|dynamo|matrix" | grep -v grep || echo "no engine, sidecar or matrix process left"
smi
tar -czf "$OUT/report.tgz" -C "$OUT" report
tar -czf "$OUT/logs.tgz" -C "$MATRIX_HOME" runs $(cd "$MATRIX_HOME" && ls -d envs/*/provision.log 2>/dev/null)
rm -rf "$OUT/report"
stamp "done"
