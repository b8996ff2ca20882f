#!/usr/bin/env bash
# The streaming MoE kernel's next-run L2 prefetch (MoeStreamTile.prefetch_steps) and the H = 2048 decode rows under
# the GPU tests, then the dispatch's decode table through the op.  About 7 minutes.
set -x
source .carry/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu -n 6 tests/kernels/test_gluon_moe_decode.py \
  tests/dispatch/test_moe_flow.py 2>&1 | tail -15
timeout 150 python3 -m vllm_nvfp4_sm120.bench moe_decode --tokens 1,2,4,6,8,16 --json $OUT/bench_moe_decode.json \
  2>&1 | tail -40
