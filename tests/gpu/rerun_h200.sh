#!/usr/bin/env bash
# [M24] step 1 (and the first part of step 3) on a GPU host with no package index: the seed row re-proved
# under today's rules. Dynamo's sidecar over vllm-rs and vLLM's native NIXL pair on vLLM 0.29.0 / 0.30.0 /
# 0.31.0, and the sidecar cell of Python vLLM 0.29.0 with the vllm-rs of the 0.30.0 wheel
# (tests/gpu/catalog-vllm-rs-skew.toml), each provisioned offline from one wheelhouse.
# Run by hand on an NVIDIA host (not part of CI). docs/results/gpu-h200-rerun-2026-12.md has every command:
#
#   here (with an index):  matrix catalog sync data/*.toml tests/gpu/catalog-vllm-rs-skew.toml
#                          matrix runtime wheelhouse $(grep -v '^#' tests/gpu/wheelhouse-vllm.args) \
#                            --runtime vllm=0.29.0+vllm.rs.0.30.0 --out WH
#                          pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                            --platform manylinux_2_39_x86_64 sqlalchemy alembic mako -d WH
#                          python tests/gpu/kit.py split WH CHUNKS; upload CHUNKS/c* into STAGING
#   there:                 KIT=STAGING PHASES="prepare sidecar" bash tests/gpu/rerun_h200.sh OUTDIR
#                          KIT=STAGING PHASES="native collect" bash tests/gpu/rerun_h200.sh OUTDIR
#                          (one phase list per command, so that none outlasts the host's command limit;
#                          MATRIX_HOME and the wheelhouse stay in /tmp between the commands)
#
# OUTDIR receives, per phase, its log lines on stdout and, from `collect`, the rows (one JSON line per cell),
# the compare and gate outputs, the report and the cells' logs (tarballs).
set -uo pipefail
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
KIT=${KIT:?set KIT to the staging folder that holds the uploaded chunks}
PHASES=${PHASES:-"prepare sidecar native collect"}
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
  prepare)
    stamp "join the uploaded chunks"
    "$PY" "$HERE/kit.py" join "$KIT" "$WHEELHOUSE" || exit 1
    # matrix's own needs that the host's python lacks travel in the same wheelhouse (no dependencies).
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$DEPS" \
      "$WHEELHOUSE"/sqlalchemy-*.whl "$WHEELHOUSE"/alembic-*.whl "$WHEELHOUSE"/mako-*.whl || exit 1
    stamp "GPU before"; smi
    m catalog sync data/*.toml "$HERE/catalog-vllm-rs-skew.toml" > /dev/null || exit 1
    m gpus
    stamp "provision the four runtimes offline, side by side"
    for v in $VERSIONS $SKEW; do
      m runtime provision --runtime "vllm=$v" "${offline[@]}" > "$OUT/provision-$v.txt" 2>&1 &
    done
    wait
    tail -n 3 "$OUT"/provision-*.txt
    m runtime envs
    for env in "$MATRIX_HOME"/envs/*/; do
      [ -x "$env/bin/vllm-rs" ] && echo "$env: python vllm $("$env/bin/python" -c \
        'import importlib.metadata as m; print(m.version("vllm"))'), $("$env/bin/vllm-rs" --version 2>&1 | head -1)"
    done
    ;;
  sidecar)
    stamp "GPU before the sidecar cells"; smi
    stamp "the sidecar case as CI selects it, on the three releases and on 0.29.0 with 0.30.0's vllm-rs"
    m run -m "pre_merge and sidecar and gpu_1" "${runtimes[@]}" --runtime "vllm=$SKEW" "${offline[@]}" \
      --gpus 0 --report-dir "$OUT/report-sidecar"
    stamp "GPU after the sidecar cells"; smi; left
    ;;
  native)
    stamp "GPU before the native cells"; smi
    stamp "the native NIXL case"
    m run --case vllm_native_disaggregated "${runtimes[@]}" "${offline[@]}" --gpus 0 \
      --report-dir "$OUT/report-native"
    stamp "GPU after the native cells"; smi; left
    ;;
  collect)
    stamp "rows"
    "$PY" - "$MATRIX_HOME/matrix.db" > "$OUT/rows.jsonl" <<'PYEOF'
import json, sqlite3, sys
keys = ("case", "version", "status", "kind", "ready_s", "request_s", "teardown_s", "total_s", "prefill_worker_id",
        "decode_worker_id", "prompt_tokens", "completion_tokens", "excerpt", "checks", "expected_failure",
        "gpu", "peaks", "components", "kv_ledger", "message", "log_dir")
q = ('SELECT c.name, rt.version, r.status, r.failure_kind, r.ready_s, r.request_s, r.teardown_s, r.total_s, '
     'r.prefill_worker_id, r.decode_worker_id, r.prompt_tokens, r.completion_tokens, r.completion_excerpt, '
     'r.checks, r.expected_failure, r.gpu, r.peaks, r.components, r.kv_ledger, r.message, r.log_dir '
     'FROM cell_run r JOIN "case" c ON c.id = r.case_id JOIN runtime rt ON rt.id = r.runtime_id '
     'WHERE r.status != "skipped" ORDER BY r.id')
for row in sqlite3.connect(sys.argv[1]).execute(q):
    print(json.dumps(dict(zip(keys, row))))
PYEOF
    cut -c1-900 "$OUT/rows.jsonl"
    stamp "compare and gate from these rows"
    m compare --component vllm-rs 0.29.0 0.30.0 | tee "$OUT/compare.txt"
    m compare "vllm=0.29.0" "vllm=$SKEW" | tee -a "$OUT/compare.txt"
    for v in $VERSIONS $SKEW; do m gate vllm "$v" | tee -a "$OUT/gate.txt"; done
    m export markdown > "$OUT/summary.md"
    m report --backend vllm --out "$OUT/report"
    stamp "anything left?"; left; smi
    tar -czf "$OUT/report.tgz" -C "$OUT" report $(cd "$OUT" && ls -d report-* 2>/dev/null)
    tar -czf "$OUT/logs.tgz" -C "$MATRIX_HOME" runs $(cd "$MATRIX_HOME" && ls -d envs/*/provision.log 2>/dev/null)
    rm -rf "$OUT"/report "$OUT"/report-*
    ;;
  *) echo "unknown phase $phase (prepare, sidecar, native, collect)"; exit 2 ;;
  esac
done
stamp "done"
