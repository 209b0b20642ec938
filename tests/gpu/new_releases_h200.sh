#!/usr/bin/env bash
# [M24] step 4 on a GPU host with no package index: the releases after the seed's first ones (vLLM 0.32.0 /
# 0.33.0 / 0.34.0, SGLang 0.5.22 / 0.5.23) as a user gets them. Catalogued since [M31]; `matrix discover`
# (which made them runtimes from the backends' runtime_template before) then finds nothing new in the
# wheelhouse served on loopback as its index
# (tests/gpu/wheelhouse_index.py); `matrix run --new` runs their cells, offline from that wheelhouse;
# `matrix gate` decides each. Run by hand on an NVIDIA host (not part of CI); every command, the ones made
# where an index is reachable too, is in docs/results/gpu-h200-new-releases.md.
#
#   there:  KIT=STAGING PHASES="prepare" bash tests/gpu/new_releases_h200.sh OUTDIR
#           KIT=STAGING PHASES="vllm" bash tests/gpu/new_releases_h200.sh OUTDIR
#           KIT=STAGING PHASES="sglang collect" bash tests/gpu/new_releases_h200.sh OUTDIR
#           (NEW_VLLM / NEW_SGLANG narrow the releases to those the upload holds; one phase list per
#           command, so that none outlasts the host's command limit; MATRIX_HOME and
#           the wheelhouse stay in /tmp between the commands; a phase cut short is continued with
#           `matrix run --resume CAMPAIGN`, the id its first line printed). BACKENDS="vllm" (or "sglang")
#           when the upload holds one backend's wheelhouse only: prepare then discovers and provisions
#           that backend alone, collect gates it alone.
#
# OUTDIR receives, per phase, its log lines on stdout and, from `collect`, the rows (one JSON line per cell),
# the gate outputs, the report and the cells' logs (tarballs).
set -uo pipefail
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
KIT=${KIT:?set KIT to the staging folder that holds the uploaded chunks}
PHASES=${PHASES:-"prepare vllm sglang collect"}
WHEELHOUSE=${WHEELHOUSE:-/tmp/wheelhouse-new}
DEPS=${DEPS:-/tmp/matrix-deps}
BACKENDS=${BACKENDS:-"vllm sglang"}
# A phase is cut (SIGINT: matrix tears its pairs down) before the host's 600 s command limit; `matrix run
# --resume CAMPAIGN` finishes it.
RUN_TIMEOUT=${RUN_TIMEOUT:-540}
# NEW_VLLM / NEW_SGLANG: the releases the upload holds (a smaller upload: e.g. NEW_VLLM=0.33.0 alone).
declare -A NEW=([vllm]="${NEW_VLLM:-0.32.0 0.33.0 0.34.0}" [sglang]="${NEW_SGLANG:-0.5.22 0.5.23}")
export MATRIX_HOME=${MATRIX_HOME:-/tmp/matrix-home} PYTHONUNBUFFERED=1
# shellcheck source=tests/gpu/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# Never NVLink multicast on a shared host.
no_multicast
export PYTHONPATH="$DEPS:$PWD"
offline=(--find-links "$WHEELHOUSE" --offline)
# A fresh database has run nothing, so every runtime is new there: the lower bounds keep `--new` to the
# discovered releases (on a database that holds the earlier runs, `--new` alone selects the same cells).
first() { set -- $1; echo "$1"; }
last() { set -- $1; echo "${!#}"; }
new_vllm=(--new --backend vllm --since "vllm=$(first "${NEW[vllm]}")" --until "vllm=$(last "${NEW[vllm]}")")
new_sglang=(--new --backend sglang --since "sglang=$(first "${NEW[sglang]}")" --until "sglang=$(last "${NEW[sglang]}")")

for phase in $PHASES; do
  case $phase in
  prepare)
    stamp "join the uploaded chunks"
    "$PY" "$HERE/kit.py" join "$KIT" "$WHEELHOUSE" || exit 1
    # matrix's own needs that the host's python lacks travel in the same wheelhouse (no dependencies).
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$DEPS" \
      "$WHEELHOUSE"/sqlalchemy-*.whl "$WHEELHOUSE"/alembic-*.whl "$WHEELHOUSE"/mako-*.whl || exit 1
    stamp "GPU before"; smi
    m catalog sync data/*.toml > /dev/null || exit 1
    m gpus
    stamp "discover the new releases, the wheelhouse served on loopback as the index"
    for backend in $BACKENDS; do
      "$PY" "$HERE/wheelhouse_index.py" "$WHEELHOUSE" -- "$PY" -m matrix discover "$backend" \
        --index-url "{index}" | tee "$OUT/discover-$backend.txt" || exit 1
    done
    m runtimes list | grep -E "discovered|version"
    stamp "provision the new runtimes offline, side by side"
    for backend in $BACKENDS; do
      for v in ${NEW[$backend]}; do
        m runtime provision --runtime "$backend=$v" "${offline[@]}" > "$OUT/provision-$backend=$v.txt" 2>&1 &
      done
    done
    wait
    tail -n 3 "$OUT"/provision-*.txt
    m runtime envs
    for env in "$MATRIX_HOME"/envs/*/; do
      "$env/bin/python" -c 'import importlib.metadata as m
for n in ("vllm", "sglang", "sglang-kernel", "torch", "ai-dynamo", "nixl"):
    try: print(n, m.version(n), end="; ")
    except m.PackageNotFoundError: pass
print()' | sed "s|^|$env: |"
      [ -x "$env/bin/vllm-rs" ] && echo "$env: $("$env/bin/vllm-rs" --version 2>&1 | head -1)"
    done
    ;;
  vllm)
    stamp "GPU before the vLLM cells"; smi
    stamp "every case of the new vLLM releases"
    # Packed: every cell's KV is bounded in bytes, so the 15 start together on GPU 0 (without --pack the
    # 2026-12-04 run's 10 cells ran one at a time, about 660 s, past one command's limit).
    timeout -s INT "$RUN_TIMEOUT" "$PY" -m matrix run "${new_vllm[@]}" "${offline[@]}" --gpus 0 --pack -j 15 \
      --report-dir "$OUT/report-vllm"
    echo "matrix run (vllm): exit $?"
    stamp "GPU after the vLLM cells"; smi; left
    ;;
  sglang)
    stamp "GPU before the SGLang cells"; smi
    stamp "every case of the new SGLang releases"
    timeout -s INT "$RUN_TIMEOUT" "$PY" -m matrix run "${new_sglang[@]}" "${offline[@]}" --gpus 0 --pack -j 10 \
      --report-dir "$OUT/report-sglang"
    echo "matrix run (sglang): exit $?"
    stamp "GPU after the SGLang cells"; smi; left
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
    stamp "gate each new release"
    for backend in $BACKENDS; do
      for v in ${NEW[$backend]}; do
        m gate "$backend" "$v" --html "$OUT/gate-$backend-$v.html" | tee -a "$OUT/gate.txt"
      done
    done
    m export markdown > "$OUT/summary.md"
    m report --out "$OUT/report"
    stamp "anything left?"; left; smi
    tar -czf "$OUT/report.tgz" -C "$OUT" report $(cd "$OUT" && ls -d report-* 2>/dev/null)
    tar -czf "$OUT/logs.tgz" -C "$MATRIX_HOME" runs $(cd "$MATRIX_HOME" && ls -d envs/*/provision.log 2>/dev/null)
    rm -rf "$OUT"/report "$OUT"/report-*
    ;;
  *) echo "unknown phase $phase (prepare, vllm, sglang, collect)"; exit 2 ;;
  esac
done
stamp "done"
