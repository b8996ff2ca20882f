#!/usr/bin/env bash
# The decode table's down rules after run 71 (the token-major down at I <= 512 from T = 6, the TMA expert-major down
# at I = 768 for T = 5-16) through the op, and the streaming kernel after the prefetch option left it: GPU tests
# against moe_ref, then the table timed against the align + tile path.  About 5 minutes.
set -x
source .carry/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -n 6 tests/kernels/test_gluon_moe_decode.py \
  tests/dispatch/test_moe_flow.py -k "decode" 2>&1 | tail -3
timeout 150 python3 -m vllm_nvfp4_sm120.bench moe_decode --tokens 1,2,4,5,6,7,8,12,16 --json $OUT/bench_moe_decode.json \
  2>&1 | tail -40
