#!/usr/bin/env bash
# The decode table's streaming late-cast down through the MoE flow.  PARTS picks the parts for short calls:
# "a" the ready-launcher and graph-replay tests (eager, ready and deterministic paths) and the op's map, fp16,
# odd-shape and graph-replay tests, then `bench moe_decode` on the narrow layers at T = 1-16 (the op with today's
# path in the same run; ~6 min); "b" the same bench on the wide layers, then the op on the GPU shapes against
# moe_ref (~4 min).
set -x
source .carry/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}  # kept by a warm machine between calls
bench() {  # models, json name, seconds
  timeout $3 python3 -m vllm_nvfp4_sm120.bench moe_decode --tokens ${TOK:-1,2,4,8,16} --models $1 \
    --json $OUT/$2.json 2>&1 | grep -v '^#  ' | tail -30
}
if [[ ${PARTS:-a b} == *a* ]]; then
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -n 6 tests/dispatch/test_moe_ready.py \
  tests/dispatch/test_moe_flow.py -k "ready or odd or graph_replay or expert_map_fp16 or stream" 2>&1 | tail -6
bench qwen3-30b-a3b,qwen3-next-80b-a3b moe_decode_narrow 150
fi
[[ ${PARTS:-a b} == *b* ]] || exit 0
bench qwen3-235b-a22b,deepseek-v3 moe_decode_wide 200
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/dispatch/test_moe_flow.py \
  -k "op_runs_the_decode_plan and not deepseek" 2>&1 | tail -6
