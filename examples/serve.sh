#!/usr/bin/env bash
# Serve an NVFP4 checkpoint with the plugin on an sm_120 GPU (RTX 5090 / RTX PRO 6000), then ask it once.
#
#   bash examples/serve.sh MODEL_DIR [extra vllm serve args]
#   LINEAR_BACKEND=nvfp4_sm120_w4a16 bash examples/serve.sh MODEL_DIR      # W4A16 checkpoint: name our kernel
#
# With the plugin installed, W4A4 linears on sm_120 use our kernels with --linear-backend auto.  The flags below
# name them explicitly so the log says what ran:
#   --linear-backend nvfp4_sm120           our route for the checkpoint (W4A4: triton; W4A16: w4a16)
#   --linear-backend nvfp4_sm120_triton    | _cublas | _b12x | _w4a16 | _flashinfer_w4a16   (one route)
#   --moe-backend nvfp4_sm120              our MoE experts (needs the MoE glue of the plugin)
# Switches: VLLM_NVFP4_SM120=0 turns the plugin off; VLLM_NVFP4_SM120_DISABLE_GLUON=1 keeps Gluon kernels out.
set -euo pipefail
MODEL=${1:?usage: serve.sh MODEL_DIR [vllm serve args]}
shift
PORT=${PORT:-8000}
LINEAR_BACKEND=${LINEAR_BACKEND:-nvfp4_sm120}
MOE_BACKEND=${MOE_BACKEND:-nvfp4_sm120}

vllm-nvfp4-sm120 env | sed -n '1,/^Linear plan/p'     # what this GPU will run

vllm serve "$MODEL" --port "$PORT" \
  --linear-backend "$LINEAR_BACKEND" --moe-backend "$MOE_BACKEND" \
  --max-model-len 1024 --gpu-memory-utilization 0.5 "$@" &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -sf "localhost:$PORT/health" >/dev/null; do
  kill -0 $SERVER 2>/dev/null || { echo "vllm serve exited" >&2; exit 1; }
  sleep 2
done
curl -s "localhost:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}"
echo
