#!/usr/bin/env bash
# The same prompt, greedy, under our routes and under vLLM's own NVFP4 kernels; prints one completion per backend.
#
#   bash examples/compare_backends.sh MODEL_DIR ["prompt"]
#
# Greedy outputs of different kernels agree on the first tokens and may drift later (different accumulation
# order, and W4A4 routes quantize activations where W4A16 ones do not).  A completely different first token
# points at a kernel or scale bug: rerun `vllm-nvfp4-sm120 selftest` and report it.
set -euo pipefail
MODEL=${1:?usage: compare_backends.sh MODEL_DIR [prompt]}
PROMPT=${2:-The capital of France is}
HERE=$(cd "$(dirname "$0")" && pwd)

run() {  # label, then env assignments and offline.py flags
  local label=$1; shift
  printf '%-34s ' "$label"
  env "$@" python "$HERE/offline.py" "$MODEL" --prompt "$PROMPT" "${ARGS[@]}" 2>/dev/null | tail -1 || echo "(failed)"
}

ARGS=(--linear-backend nvfp4_sm120 --moe-backend nvfp4_sm120); run "ours (nvfp4_sm120)"
ARGS=(--linear-backend nvfp4_sm120_w4a16);                      run "ours, W4A16 route"
ARGS=(--linear-backend auto --moe-backend auto);                run "vLLM defaults (plugin off)" VLLM_NVFP4_SM120=0
ARGS=(--linear-backend flashinfer_cutlass);                     run "vLLM FlashInfer CUTLASS" VLLM_NVFP4_SM120=0
ARGS=(--linear-backend marlin --moe-backend marlin);            run "vLLM Marlin (W4A16)" VLLM_NVFP4_SM120=0
ARGS=(--linear-backend emulation --moe-backend emulation);      run "vLLM emulation (reference)" VLLM_NVFP4_SM120=0
