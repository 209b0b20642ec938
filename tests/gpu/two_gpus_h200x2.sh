#!/usr/bin/env bash
# [M32] on a host with two GPUs (nvidia-h200-x2; not run yet: that kind was withheld). One vLLM release
# ($RUNTIME, default vllm=0.31.0, the one [M31] ran on CUDA), provisioned offline from the seed's vLLM wheelhouse
# (the upload and `prepare` of tests/gpu/seed_packed_h200.sh with RUNTIMES=$RUNTIME).
#
#   there:  KIT=FLAT RUNTIMES=vllm=0.31.0 PHASES=prepare bash tests/gpu/seed_packed_h200.sh OUTDIR
#           PHASES="devices" bash tests/gpu/two_gpus_h200x2.sh OUTDIR
#           PHASES="spread" bash tests/gpu/two_gpus_h200x2.sh OUTDIR
#           RUNTIMES=vllm=0.31.0 PHASES=collect bash tests/gpu/seed_packed_h200.sh OUTDIR
#
# Phases (one per command, each within the host's command limit):
#   devices  item 1 and 3: the `gpu_2` cases of tests/gpu/catalog-two-gpus.toml (prefill on GPU 1, decode on
#            GPU 0: the native pair, the sidecar over vllm-rs, the 2p2d topology) and the seed's co-located
#            one-GPU twins of the first two, packed over GPUs 0 and 1; every compute process sampled once a
#            second with the GPU NVML puts it on (placement) and the cell log its stdout goes to. The KV
#            ledger of each row (bytes, seconds, GB/s) sets the cross-device transfer against the co-located.
#   spread   item 2: the release's one-GPU cells packed on GPU 0 alone, then on GPUs 0 and 1 (the local
#            executor's --pack), then through the Ray executor on both: each campaign's makespan, from the
#            rows by the `collect` phase of seed_packed_h200.sh.
set -uo pipefail
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
PHASES=${PHASES:-"devices spread"}
RUNTIME=${RUNTIME:-vllm=0.31.0}
WHEELHOUSE=${WHEELHOUSE:-/tmp/wheelhouse}
DEPS=${DEPS:-/tmp/matrix-deps}
RUN_TIMEOUT=${RUN_TIMEOUT:-520}
export MATRIX_HOME=${MATRIX_HOME:-/tmp/matrix-home} PYTHONUNBUFFERED=1
# shellcheck source=tests/gpu/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
no_multicast
export PYTHONPATH="$DEPS:$PWD"
offline=(--find-links "$WHEELHOUSE" --offline)

# Every compute process on every GPU once a second: "T epoch", then "pid gpu_uuid MiB log".
sample_placement() {
  declare -A seen
  while :; do
    echo "T $(date +%s.%N)"
    while IFS=', ' read -r pid uuid mib; do
      [ -n "$pid" ] || continue
      [ -n "${seen[$pid]:-}" ] || seen[$pid]=$(readlink "/proc/$pid/fd/1" 2>/dev/null || echo "?")
      echo "$pid $uuid $mib ${seen[$pid]}"
    done < <(nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits 2>/dev/null)
    sleep 1
  done
}

timed_run() {  # label, then matrix run's arguments
  local label=$1; shift
  sample_placement > "$OUT/placement-$label.txt" 2>&1 &
  local sampler=$!
  timeout -s INT "$RUN_TIMEOUT" "$PY" -m matrix run "$@" "${offline[@]}" --no-report
  echo "matrix run ($label): exit $?"
  sleep 3; kill "$sampler"; wait "$sampler" 2>/dev/null
}

for phase in $PHASES; do
  case $phase in
  devices)
    m catalog sync tests/gpu/catalog-two-gpus.toml > /dev/null || exit 1
    stamp "GPUs before"; smi; left
    timed_run devices --runtime "$RUNTIME" --case vllm_native_disaggregated_gpu2 --case vllm_disaggregated_gpu2 \
      --case vllm_native_topology_2p2d_gpu2 --case vllm_native_disaggregated --case vllm_disaggregated \
      --gpus 0,1 --pack -j 5
    stamp "GPUs after"; smi; left
    ;;
  spread)
    stamp "GPUs before"; smi; left
    for gpus in 0 0,1; do
      timed_run "pack-$gpus" --runtime "$RUNTIME" -m "gpu_1 and not sidecar" --gpus "$gpus" --pack -j 8
    done
    timed_run ray --runtime "$RUNTIME" -m "gpu_1 and not sidecar" --gpus 0,1 --executor ray
    stamp "GPUs after"; smi; left
    m campaigns list | tee "$OUT/campaigns.txt"
    ;;
  *) echo "unknown phase $phase (devices, spread)"; exit 2 ;;
  esac
done
stamp "done"
