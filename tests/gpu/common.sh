# shellcheck shell=bash
# What the GPU scripts share, sourced by each after it has set its own variables:
#   . "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# PY (PYTHON or python3), `m` (the matrix CLI through PY), `stamp` (a line with the seconds since the source),
# `smi` (each GPU's memory in use), `left` (the engine, proxy and matrix processes still running) and
# `no_multicast` (NVLink multicast off for NCCL, torch and NVSHMEM: the lent H200 hosts do not allow it).
PY=${PYTHON:-python3}
started=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - started )) s] $*"; }
smi() { nvidia-smi --query-gpu=index,uuid,memory.used --format=csv,noheader; }
m() { "$PY" -m matrix "$@"; }
left() {
  # The calling script's own command line mentions its name: it is not a leftover.
  ps -eo pid,args | grep -E "vllm|sglang|dynamo|python -m matrix" | grep -v -e grep -e "$(basename "$0" .sh)" \
    || echo "no engine, sidecar, proxy or matrix process left"
}
no_multicast() { export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; }
