#!/usr/bin/env bash
# The seed's SGLang row on a GPU host with no package index: Dynamo's native sidecar over SGLang, SGLang's
# own P/D (matrix's proxy in front) and its KV-transfer control, on SGLang 0.5.18 / 0.5.19 / 0.5.21, each
# provisioned offline from a wheelhouse. Run by hand on an NVIDIA host (not part of CI):
#
#   here (with an index):  matrix runtime wheelhouse --runtime sglang=0.5.18 --runtime sglang=0.5.19 \
#                            --runtime sglang=0.5.21 --python 3.12 --platform manylinux_2_39_x86_64 \
#                            --exclude NAME... --omit NAME... --out WHEELHOUSE
#                          pip download sqlalchemy alembic mako (matrix's own needs the host lacks) into it
#                          python tests/gpu/kit.py split WHEELHOUSE CHUNKS; upload CHUNKS/c* into STAGING
#   there:                 copy the repo somewhere later uploads do not replace, then from that copy
#                          KIT=STAGING bash tests/gpu/sglang_h200.sh OUTDIR
#                          (a run longer than one command may last: start it with setsid in the background
#                          and read its log; to stop it, kill it by pid, since a `pkill -f` pattern written
#                          on the command line also matches the shell that runs that command line)
#                          (VERSIONS="0.5.21" runs one version; a runtime whose wheels did not arrive is
#                          skipped with the missing wheel's name)
#
# OUTDIR receives the run's rows (one JSON line per cell), the compare and gate outputs, the recorded
# /metrics scrapes, the HTML report and the cells' logs (tarballs).
set -uo pipefail
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
KIT=${KIT:?set KIT to the staging folder that holds the uploaded chunks}
WHEELHOUSE=${WHEELHOUSE:-/tmp/wheelhouse-sglang}
VERSIONS=${VERSIONS:-"0.5.21 0.5.19 0.5.18"}
export MATRIX_HOME=${MATRIX_HOME:-/tmp/matrix-home-sglang} PYTHONUNBUFFERED=1
# shellcheck source=tests/gpu/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# Never NVLink multicast on a shared host.
no_multicast

stamp "join the uploaded chunks"
"$PY" tests/gpu/kit.py join "$KIT" "$WHEELHOUSE" || exit 1
deps=$(mktemp -d)
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$deps" \
  "$WHEELHOUSE"/sqlalchemy-*.whl "$WHEELHOUSE"/alembic-*.whl "$WHEELHOUSE"/mako-*.whl || exit 1
export PYTHONPATH="$deps:$PWD"
offline=(--find-links "$WHEELHOUSE" --offline)

stamp "GPU before"; smi
m catalog sync > /dev/null
m gpus

stamp "provision the runtimes offline, side by side"
for v in $VERSIONS; do
  m runtime provision --runtime "sglang=$v" "${offline[@]}" > "$OUT/provision-$v.txt" 2>&1 &
done
wait
tail -n 3 "$OUT"/provision-*.txt
m runtime envs

stamp "what each server imports at start, before any GPU time is spent on a cell (SMOKE=0 skips)"
for env in "$MATRIX_HOME"/envs/*/; do
  [ "${SMOKE:-1}" = 1 ] || break
  [ -x "$env/bin/python" ] || continue
  "$env/bin/python" - <<'PYEOF' 2>&1 | tail -n 4
import importlib, importlib.metadata as md
print("sglang", md.version("sglang"), "sglang-kernel", md.version("sglang-kernel"), "nixl", md.version("nixl"))
for name in ("sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler", "sglang.srt.models.qwen3",
             "sglang.srt.layers.sampler", "sglang.srt.disaggregation.nixl.conn", "dynamo.sglang.sidecar"):
    try:
        importlib.import_module(name)
    except Exception as exc:  # report every module, not only the first
        print(f"IMPORT {name}: {type(exc).__name__}: {exc}")
PYEOF
done

for v in $VERSIONS; do
  stamp "SGLang $v: the sidecar case, SGLang's own P/D and the control"
  m run --runtime "sglang=$v" --backend sglang "${offline[@]}" --gpus 0 --report-dir "$OUT/report"
  stamp "GPU after SGLang $v"; smi
done

stamp "rows"
"$PY" - "$MATRIX_HOME/matrix.db" > "$OUT/rows.jsonl" <<'PYEOF'
import json, sqlite3, sys
q = ('SELECT c.name, rt.version, r.status, r.failure_kind, r.ready_s, r.request_s, r.total_s, '
     'r.prefill_worker_id, r.decode_worker_id, r.completion_tokens, r.completion_excerpt, r.checks, '
     'r.gpu, r.peaks, r.components, r.message, r.log_dir FROM cell_run r JOIN "case" c ON c.id = r.case_id '
     'JOIN runtime rt ON rt.id = r.runtime_id WHERE r.status != "skipped" ORDER BY r.id')
keys = ("case", "version", "status", "kind", "ready_s", "request_s", "total_s", "prefill_worker_id",
        "decode_worker_id", "completion_tokens", "excerpt", "checks", "gpu", "peaks", "components", "message",
        "log_dir")
for row in sqlite3.connect(sys.argv[1]).execute(q):
    print(json.dumps(dict(zip(keys, row))))
PYEOF
cut -c1-700 "$OUT/rows.jsonl"

stamp "compare and gate from these rows"
m compare sglang=0.5.18 sglang=0.5.19 | tee "$OUT/compare.txt"
m compare sglang=0.5.19 sglang=0.5.21 | tee -a "$OUT/compare.txt"
for v in $VERSIONS; do m gate sglang "$v" | tee -a "$OUT/gate.txt"; done
m export markdown > "$OUT/summary.md"
# Each `matrix run` above wrote a report of its own selection; this one is every SGLang row of the database.
m report --backend sglang --out "$OUT/report"

stamp "anything left?"
ps -eo pid,args | grep -E "sglang|dynamo|matrix" | grep -v -e grep -e sglang_h200 || echo "no server, sidecar or matrix process left"
smi
tar -czf "$OUT/report.tgz" -C "$OUT" report
# The recorded /metrics scrapes and the cells' logs; the environments' build logs beside them.
tar -czf "$OUT/logs.tgz" -C "$MATRIX_HOME" runs $(cd "$MATRIX_HOME" && ls -d envs/*/provision.log 2>/dev/null)
rm -rf "$OUT/report"
stamp "done"
